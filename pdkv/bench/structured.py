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


def bench_model(label: str, path, cache, Bs, steps: int, rounds: int) -> list[dict]:
    """Two engines of the model, one decoding B plain requests, one B constrained ones, stepped
    in turn: each pair of steps meets the same machine load, and the ratio is taken per pair."""
    rows = []
    constraint = cache.get("json", json.dumps(SCHEMA))
    for B in Bs:
        plain_e, struct_e = _engine(path, B), _engine(path, B)
        plain, struct, ratios = [], [], []
        for _ in range(rounds):
            a, b = _start(plain_e, B, None, steps), _start(struct_e, B, constraint, steps)
            for _ in range(3):  # prefill and warm-up
                plain_e.step()
                struct_e.step()
            for _ in range(steps):
                if not (_decoding(plain_e, a) and _decoding(struct_e, b)):
                    break
                tp, ts = _timed_step(plain_e), _timed_step(struct_e)
                if _decoding(plain_e, a) and _decoding(struct_e, b):
                    plain.append(tp)
                    struct.append(ts)
                    ratios.append(ts / tp)
            for e, ids in ((plain_e, a), (struct_e, b)):
                for r in ids:
                    e.abort(r)
                e.step()
        p, s, r = statistics.median(plain), statistics.median(struct), statistics.median(ratios)
        rows.append({"model": label, "B": B, "plain_ms": p * 1e3, "structured_ms": s * 1e3,
                     "overhead_pct": 100 * (r - 1)})
        print(f"{label:>22}  B={B:<3} step {p * 1e3:8.2f} ms plain, {s * 1e3:8.2f} ms structured "
              f"(medians of {len(ratios)} steps); paired ratio {100 * (r - 1):+6.1f}%", flush=True)
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
        bench_model(f"default ({dvocab})", default, GrammarCache(dtok, dvocab), a.batch, a.steps, a.rounds)
        bench_model(f"random ({a.big_vocab})", big, GrammarCache(btok, a.big_vocab, encoded_vocab=vocab),
                    a.batch, a.steps, a.rounds)
    return 0
