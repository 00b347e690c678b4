"""Speculative decoding with the ngram proposer: greedy output is token for token what plain
decoding gives (batched, prompts of different lengths, runs that end on EOS, a stop string or
max_tokens inside an accepted run), the KV of rejected drafts is rolled back page by page, aborts
and failed verification steps give every page back, and bad settings fail at start-up."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pdkv.config import ConfigError, KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, config_from_dict
from pdkv.engine import LLMEngine, SamplingParams
from pdkv.engine.spec.ngram import lookup

K = 4
NGRAM = SpeculativeConfig(method="ngram", num_tokens=K)


def _engine(path, spec=None, page_size=16, num_pages=256, **sched):
    return LLMEngine(ModelConfig(path=str(path)), KVCacheConfig(page_size=page_size, num_pages=num_pages),
                     SchedulerConfig(**sched), speculative=spec)


def _greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=kw.pop("ignore_eos", True), **kw)


def _prompts(n=6):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (length,), generator=g).tolist() for length in (3, 11, 26, 40, 75, 130)[:n]]


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    return _engine(tiny_model_dir, NGRAM)


def _run(engine, prompt, params):
    """(final output, the token lists each step delivered)."""
    deltas = [o.new_token_ids for o in engine.stream(prompt, params)]
    return deltas, [t for d in deltas for t in d]


def test_lookup_takes_the_latest_longest_match():
    ctx = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup(ctx, 1, 3, 2) == [7, 8]  # suffix [2, 3] last seen at 5..6, followed by 7, 8
    assert lookup(ctx, 1, 1, 3) == [7, 8, 5]  # suffix [3]: its latest earlier occurrence
    assert lookup(np.array([4, 5, 6]), 1, 3, 4) == []  # no earlier occurrence
    assert lookup(np.array([5]), 1, 3, 4) == []


def test_greedy_batch_same_tokens_as_plain(plain, spec):
    prompts, params = _prompts(), _greedy(32)
    want = [o.output_token_ids for o in plain.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.output_token_ids for o in got] == want
    s = spec.stats()
    # The tiny model falls into loops that ngram predicts: drafts were verified and kept.
    assert s["spec_num_accepted_tokens"] > 20 and s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"]
    assert s["num_pages_free"] == s["num_pages_total"]


@pytest.fixture(scope="module")
def looping(plain):
    """A prompt whose greedy continuation is known to repeat a span of the prompt itself: the
    prompt is P + O[:m] where O is P's greedy output (so the continuation is O[m:]), taken
    where O already loops. Returns (prompt, continuation)."""
    p = plain.tokenizer.encode("Hello")
    out = plain.generate([p], _greedy(160))[0].output_token_ids
    for m in range(8, 140):
        cont = out[m:]
        seen = any(out[i:i + 12] == cont[:12] for i in range(m - 12))
        if seen and len(set(cont[:3])) == 3:
            return p + out[:m], cont
    raise AssertionError(f"the tiny model's output does not loop: {out}")


def _ends_inside_a_run(engine, deltas, n_out, dropped):
    """The request ended on an accepted draft: the final step delivered several tokens and
    (``dropped``) verification emitted more than were delivered. Drafts are capped so that a
    run never passes max_tokens: a max_tokens end drops nothing."""
    st = engine.spec.stats
    emitted = 1 + st.num_drafts + st.num_accepted_tokens  # the prefill's token + each run
    return len(deltas[-1]) >= 2 and (emitted > n_out if dropped else emitted == n_out)


@pytest.mark.parametrize("end", ["max_tokens", "stop_token", "stop_string", "eos"])
def test_run_ends_at_the_right_token(tiny_model_dir, tmp_path, plain, looping, end):
    prompt, cont = looping
    j = 2  # end on the 3rd output token: an accepted draft of the first verification step
    assert cont[j] not in cont[:j]
    path = tiny_model_dir
    if end == "max_tokens":
        params = _greedy(j + 1)
    elif end == "stop_token":
        params = _greedy(64, stop_token_ids=[cont[j]])
    elif end == "stop_string":
        text = plain.tokenizer.decode(cont[:j + 1])
        stop = text[len(plain.tokenizer.decode(cont[:j])):]  # what the (j+1)-th token adds
        assert stop and stop not in plain.tokenizer.decode(cont[:j])
        params = _greedy(64, stop=[stop])
    else:  # the model folder declares cont[j] an EOS token
        path = tmp_path / "m"
        shutil.copytree(tiny_model_dir, path)
        gen = json.loads((path / "generation_config.json").read_text())
        gen["eos_token_id"] = [cont[j]]
        (path / "generation_config.json").write_text(json.dumps(gen))
        params = _greedy(64, ignore_eos=False)
    ref = _engine(path) if end == "eos" else plain
    spec = _engine(path, NGRAM)
    want = ref.generate([prompt], params)[0]
    deltas, got = _run(spec, prompt, params)
    assert got == want.output_token_ids == cont[:j + 1]
    final = spec.generate([prompt], params)[0]
    assert (final.text, final.finish_reason) == (want.text, want.finish_reason)
    assert final.finish_reason == ("length" if end == "max_tokens" else "stop")
    spec.spec.stats.__init__(K)
    deltas, _ = _run(spec, prompt, params)
    assert _ends_inside_a_run(spec, deltas, j + 1, dropped=end != "max_tokens"), deltas
    assert spec.allocator.num_free == spec.allocator.num_total


def test_streaming_delivers_accepted_runs(plain, spec, looping):
    prompt, cont = looping
    deltas, got = _run(spec, prompt, _greedy(40))
    assert got == cont[:40]
    assert max(len(d) for d in deltas) == K + 1  # a fully accepted run: k drafts + the bonus
    assert len(deltas) < 40 / 2


def test_rollback_frees_rejected_pages_and_nothing_leaks(tiny_model_dir, plain):
    # Page size 2: nearly every rejection frees a page. After every step each running request
    # holds exactly the pages of its computed tokens.
    eng = _engine(tiny_model_dir, NGRAM, page_size=2, num_pages=2048)
    freed, real = [0], eng.scheduler.truncate_computed

    def counting(req, n):  # observes the real rollback
        k = real(req, n)
        freed[0] += k
        return k
    eng.scheduler.truncate_computed = counting
    prompts, params = _prompts(), _greedy(40)
    want = [o.output_token_ids for o in plain.generate(prompts, params)]
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    got = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        for r in eng.scheduler.running:
            assert len(r.pages) == eng.scheduler.pages_for(r.num_computed_tokens)
    assert [got[r] for r in ids] == want
    assert freed[0] > 10
    assert eng.stats()["spec_num_draft_tokens"] - eng.stats()["spec_num_accepted_tokens"] > 30
    assert eng.allocator.num_free == eng.allocator.num_total


def test_abort_with_drafts_pending_and_failed_verification_free_everything(tiny_model_dir, looping):
    eng = _engine(tiny_model_dir, NGRAM, page_size=4, num_pages=512)
    prompt, _ = looping
    for i in range(4):
        eng.add_request(f"a{i}", prompt, _greedy(60))
    while not all(r.spec_token_ids for r in eng.scheduler.running) or len(eng.scheduler.running) < 4:
        eng.step()
    eng.abort("a0")  # drafts proposed, pages for them not yet grown
    eng.scheduler.schedule = _abort_after(eng, eng.scheduler.schedule, "a1")  # pages grown for drafts
    eng.step()
    # Fault injection: the forward pass of a verification step raises.
    real = eng.runner.model.forward

    def failing(*a, **kw):
        raise RuntimeError("injected fault in a verification step")
    eng.runner.model.forward = failing
    outs = eng.step()
    eng.runner.model.forward = real
    assert {o.request_id: o.finish_reason for o in outs if o.finished} == {"a1": "abort", "a2": "error", "a3": "error"}
    assert not eng.has_unfinished()
    assert eng.allocator.num_free == eng.allocator.num_total


def _abort_after(eng, schedule, rid):
    """Aborts ``rid`` right after the scheduler grew its pages for this step's drafts (then
    schedules without it), once."""
    def wrapped():
        out = schedule()
        if rid in eng.requests:
            assert any(s.num_draft for s in out.seqs if s.request.request_id == rid)
            eng.abort(rid)
            out.seqs[:] = [s for s in out.seqs if s.request.request_id != rid]
            eng.scheduler.schedule = schedule
        return out
    return wrapped


@pytest.mark.parametrize("k", [0, -1, 17])
def test_num_tokens_out_of_range_fails_at_start(tiny_model_dir, k):
    with pytest.raises(ConfigError, match=r"speculative.num_tokens must be an integer in \[1, 16\]"):
        _engine(tiny_model_dir, SpeculativeConfig(method="ngram", num_tokens=k))
    with pytest.raises(ConfigError, match=r"speculative.num_tokens"):
        config_from_dict({"speculative": {"method": "ngram", "num_tokens": k}})


def test_unknown_method_fails_at_start(tiny_model_dir):
    with pytest.raises(ConfigError, match="speculative.method must be one of ngram, draft, mtp"):
        _engine(tiny_model_dir, SpeculativeConfig(method="eagle"))
    with pytest.raises(ConfigError, match="speculative.method"):
        config_from_dict({"speculative": {"method": "eagle"}})


def test_config_refuses_a_speculative_handoff_through_staging_but_not_over_verbs(tiny_model_dir):
    """The prefill node writes an mtp/draft proposer's KV straight into the decode node's
    proposer cache, granted per request on tcp and verbs alike (pdkv/disagg/spec_handoff.py):
    never through the staging rings; ngram needs no hand-off and runs on any transport."""
    mtp = {"method": "mtp"}
    for role in ("prefill", "decode"):
        with pytest.raises(ConfigError, match=r"messenger.staging must be auto or off, with model.device cpu"):
            config_from_dict({"role": role, "speculative": mtp, "messenger": {"staging": "cpu",
                                                                             "prefill_peers": ["127.0.0.1:1"]}})
        for method in ("mtp", "draft"):
            sp = {"method": method, **({"draft_model": {"path": str(tiny_model_dir)}} if method == "draft" else {})}
            cfg = config_from_dict({"role": role, "speculative": sp, "messenger": {
                "transport": "verbs", "nics": ["x"], "prefill_peers": ["127.0.0.1:1"]}})
            assert cfg.messenger.transport == "verbs" and cfg.speculative.method == method
    config_from_dict({"role": "decode", "speculative": {"method": "ngram"},
                      "messenger": {"transport": "verbs", "nics": ["x"], "prefill_peers": ["127.0.0.1:1"]}})


def test_config_refuses_speculation_on_disaggregated_roles_and_bad_draft_settings(tmp_path):
    with pytest.raises(ConfigError, match="speculative.method must be one of draft, mtp or null for role prefill"):
        config_from_dict({"role": "prefill", "speculative": {"method": "ngram"}})
    with pytest.raises(ConfigError, match="speculative.draft_model.path must be a local Hugging Face model folder"):
        config_from_dict({"speculative": {"method": "draft"}})
    with pytest.raises(ConfigError, match="speculative.draft_model.path must be a local Hugging Face model folder that exists"):
        config_from_dict({"speculative": {"method": "draft", "draft_model": {"path": str(tmp_path / "nope")}}})
    with pytest.raises(ConfigError, match="speculative.draft_model.num_pages"):
        config_from_dict({"speculative": {"method": "ngram", "draft_model": {"num_pages": 0}}})
