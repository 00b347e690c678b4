"""`python -m pdkv.bench structured`: what structured output costs a decode step, and how long
its grammars take to compile.

For each model (the default model's vocabulary, and a random-weight model with Qwen's 151,936
tokens whose grammar vocabulary is a synthetic byte-level one of the same size) and batch size
B, B requests decode together, alternately without and with a JSON-schema constraint (the same
run, interleaved, so the shared machine's noise hits both alike); only steps in which all B
requests decode are timed. Both modes carry the same logit_bias (EOS held at -100, so requests
keep running), so the difference is the masks: matcher fills and their application.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["text", "n"]}
COMPILE_CASES = {
    "test schema (nested, enums, patterns)": ("json", json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{2,6}$"}, "kind": {"enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9 ]{1,4}$"}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                  "required": ["id", "ok"]}}, "required": ["name", "kind", "age", "tags", "owner"]})),
    "json_object": ("json_object", ""),
    "regex (ab|cd)[0-9]{2,4}x": ("regex", "(ab|cd)[0-9]{2,4}x"),
    "tool_choice required (2 tools)": ("json", json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}},
         "required": ["name", "parameters"]},
        {"type": "object", "properties": {"name": {"enum": ["get_time"]}, "parameters": {
            "type": "object", "properties": {"tz": {"type": "string"}}}}, "required": ["name", "parameters"]}]}})),
}


def synthetic_vocab(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct byte-level token strings: the 256 single bytes, then random 2-8 byte runs."""
    from tokenizers import pre_tokenizers  # noqa: PLC0415

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    rnd, seen = random.Random(seed), set(alphabet)
    out = list(alphabet)
    common = alphabet[:95]  # mostly printable: what a real vocabulary is made of
    while len(out) < n:
        s = "".join(rnd.choice(common if rnd.random() < 0.9 else alphabet) for _ in range(rnd.randint(2, 8)))
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def _engine(path, B):
    from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig  # noqa: PLC0415
    from pdkv.engine import LLMEngine  # noqa: PLC0415

    return LLMEngine(ModelConfig(path=str(path)), KVCacheConfig(page_size=16, num_pages=max(64, B * 8)),
                     SchedulerConfig(max_num_seqs=max(B, 8)))


def _start(engine, B: int, constraint, steps: int) -> list[str]:
    from pdkv.engine import SamplingParams  # noqa: PLC0415

    eos = next(iter(engine.tokenizer.eos_token_ids))
    params = SamplingParams(max_tokens=steps + 8, temperature=1.0, logit_bias={eos: -100.0}, constraint=constraint)
    ids = [f"b{i}-{time.monotonic_ns()}" for i in range(B)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [3 + i % 50, 7, 9, 11], params)
    return ids


def _decoding(engine, ids) -> bool:
    return all(engine.requests.get(r) is not None and engine.requests[r].output_token_ids for r in ids)


def _timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


MODES = {"overlapped": True, "after": False}  # runner.overlap_masks of the constrained engines


def bench_model(label: str, path, cache, Bs, steps: int, rounds: int) -> list[dict]:
    """Engines of the model stepped in turn: one decoding B plain requests, the others B
    constrained ones with the runner's default (its masks filled during the forward pass where
    that pays, pdkv.engine.logits.start_masks) and each of MODES (always overlapped; after the
    forward on the engine thread, how it was before). Each round of steps meets the same machine
    load; the ratios to the plain step are taken per round."""
    rows = []
    constraint = cache.get("json", json.dumps(SCHEMA))
    names = ["default", *MODES]
    for B in Bs:
        engines = [_engine(path, B) for _ in range(len(names) + 1)]
        for e, name in zip(engines[2:], MODES):
            e.runner.overlap_masks = MODES[name]
        times, ratios = [[] for _ in engines], [[] for _ in names]
        for _ in range(rounds):
            ids = [_start(e, B, None if j == 0 else constraint, steps) for j, e in enumerate(engines)]
            for _ in range(3):  # prefill and warm-up
                for e in engines:
                    e.step()
            for _ in range(steps):
                if not all(_decoding(e, i) for e, i in zip(engines, ids)):
                    break
                t = [_timed_step(e) for e in engines]
                if all(_decoding(e, i) for e, i in zip(engines, ids)):
                    for j, x in enumerate(t):
                        times[j].append(x)
                    for j in range(len(names)):
                        ratios[j].append(t[j + 1] / t[0])
            for e, i in zip(engines, ids):
                for r in i:
                    e.abort(r)
                e.step()
        med = [statistics.median(x) * 1e3 for x in times]
        over = [100 * (statistics.median(x) - 1) for x in ratios]
        row = {"model": label, "B": B, "plain_ms": med[0], "steps": len(ratios[0])}
        for j, name in enumerate(names):
            row[f"{name}_ms"], row[f"{name}_overhead_pct"] = med[j + 1], over[j]
        rows.append(row)
        print(f"{label:>22}  B={B:<3} plain step {med[0]:8.2f} ms; structured: " + ", ".join(
            f"{name} {med[j + 1]:8.2f} ms ({over[j]:+6.1f}%)" for j, name in enumerate(names))
            + f" (medians of {len(ratios[0])} steps and of their paired ratios)", flush=True)
    return rows


def mask_cost(label: str, cache, vocab: int, Bs, reps: int = 15) -> None:
    """The sampler's mask work alone for B rows inside a JSON string (the state that allows the
    most tokens): pdkv.engine.logits.process with B masks, and the matchers' fills within it."""
    from types import SimpleNamespace  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from pdkv.engine import SamplingParams  # noqa: PLC0415
    from pdkv.engine.logits import bitmask_width, process  # noqa: PLC0415

    constraint = cache.get("json", json.dumps(SCHEMA))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runner's tuner picks for small steps on a busy CPU
    for B in Bs:
        masks = [constraint.new_mask() for _ in range(B)]
        for m in masks:
            m.matcher.accept_string('{"text": "')
        groups = [(SimpleNamespace(params=SamplingParams(), mask=m, output_token_ids=[], prompt_token_ids=[]), [])
                  for m in masks]
        logits = torch.randn(B, vocab)
        bitmask = torch.empty(B, bitmask_width(vocab), dtype=torch.int32)
        full, fills = [], []
        process(logits, groups)  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            process(logits, groups)
            full.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i, m in enumerate(masks):
                m.fill(bitmask, i)
            fills.append(time.perf_counter() - t0)
        # the minimum: the work itself, without the other processes' share of the CPU
        f, a, med = min(full), min(fills), statistics.median(full)
        print(f"{label:>22}  B={B:<3} masks {f * 1e3:7.2f} ms per step (median {med * 1e3:7.2f}) = "
              f"{f * 1e6 / B:6.1f} us per token (matcher fills {a * 1e6 / B:6.1f} us, applying "
              f"{(f - a) * 1e6 / B:6.1f} us)", flush=True)
        for m in masks:
            m.close()
    torch.set_num_threads(threads)


def compile_times(label: str, make_cache) -> None:
    t0 = time.perf_counter()
    cache = make_cache()
    print(f"{label:>22}  tokenizer info + compiler: {time.perf_counter() - t0:.2f} s")
    for name, (kind, value) in COMPILE_CASES.items():
        t0 = time.perf_counter()
        cache.get(kind, value)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache.get(kind, value)
        hit = time.perf_counter() - t0
        print(f"{label:>22}  compile {name}: {cold * 1e3:.1f} ms (cached: {hit * 1e6:.0f} us)")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench structured", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--big-vocab", type=int, default=151936)
    ap.add_argument("--big-hidden", type=int, default=256)
    ap.add_argument("--no-steps", action="store_true", help="masks and compile times only")
    ap.add_argument("--only", choices=["default", "random"], help="one vocabulary's decode steps only")
    a = ap.parse_args(argv)
    import torch  # noqa: PLC0415

    from pdkv.default_model import ensure_default_model  # noqa: PLC0415
    from pdkv.engine.structured import GrammarCache  # noqa: PLC0415
    from pdkv.tiny_model import make_tiny_model  # noqa: PLC0415
    from pdkv.tokenizer import Tokenizer  # noqa: PLC0415

    print(f"torch threads: {torch.get_num_threads()}; median step times; shared machine: noisy")
    default = ensure_default_model()
    dtok = Tokenizer(default)
    dvocab = json.loads(open(f"{default}/config.json").read())["vocab_size"]
    compile_times(f"default ({dvocab})", lambda: GrammarCache(dtok, dvocab))
    with tempfile.TemporaryDirectory() as tmp:
        big = make_tiny_model(f"{tmp}/big", vocab_size=a.big_vocab, hidden_size=a.big_hidden,
                              intermediate_size=2 * a.big_hidden, num_layers=2)
        btok = Tokenizer(big)
        vocab = synthetic_vocab(a.big_vocab)
        compile_times(f"random ({a.big_vocab})", lambda: GrammarCache(btok, a.big_vocab, encoded_vocab=vocab))
        mask_cost(f"default ({dvocab})", GrammarCache(dtok, dvocab), dvocab, a.batch)
        mask_cost(f"random ({a.big_vocab})", GrammarCache(btok, a.big_vocab, encoded_vocab=vocab), a.big_vocab,
                  a.batch)
        if a.no_steps:
            return 0
        if a.only != "random":
            bench_model(f"default ({dvocab})", default, GrammarCache(dtok, dvocab), a.batch, a.steps, a.rounds)
        if a.only != "default":
            bench_model(f"random ({a.big_vocab})", big, GrammarCache(btok, a.big_vocab, encoded_vocab=vocab),
                        a.batch, a.steps, a.rounds)
    return 0
