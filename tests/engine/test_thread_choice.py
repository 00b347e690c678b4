"""The CPU thread count per step (pdkv/engine/threads.py), and the second cause of chunked
prefill's decode stalls: a mixed
prefill + decode step used every thread even when the decode steps had measured the other cores
busy, which made each chunk step several times slower than on one thread (so chunking, with
more such steps, stalled decodes longer than whole-prompt prefill)."""

from __future__ import annotations

import torch

from pdkv.config import KVCacheConfig, ModelConfig, SchedulerConfig
from pdkv.engine import SamplingParams
from pdkv.engine.threads import ThreadTuner


def _run(tuner, cost, steps):
    picks = []
    for _ in range(steps):
        n = tuner.choose()
        picks.append(n)
        tuner.record(n, cost[n])
    return picks


def test_tuner_follows_the_faster_choice_and_probes_a_big_loser_less_often():
    tuner = ThreadTuner(2, explore_every=16, max_explore_every=64)
    picks = _run(tuner, {1: 0.015, 2: 0.060}, 200)  # a busy machine: one thread is 4x faster
    probes = [i + 1 for i, n in enumerate(picks) if n == 2]  # 1-based step numbers
    # Untried first (step 2), then waits of 16, 32, 64, 64 steps: each probe lost by > 2x.
    assert probes == [2, 16, 48, 112, 176]
    picks = _run(tuner, {1: 0.015, 2: 0.008}, 100)  # the machine went idle: the next probe finds out
    first_two = picks.index(2)
    assert first_two < 64 and picks[first_two:].count(1) <= 100 // 16  # then 1 is only probed
    assert ThreadTuner(1).candidates == [1] and _run(ThreadTuner(1), {1: 1.0}, 5) == [1] * 5


def test_a_close_probe_keeps_probing_at_the_base_rate():
    tuner = ThreadTuner(2, explore_every=16)
    picks = _run(tuner, {1: 0.015, 2: 0.020}, 100)  # 2 threads a little slower: follow changes fast
    assert [i + 1 for i, n in enumerate(picks) if n == 2] == [2, 16, 32, 48, 64, 80, 96]


def test_large_steps_follow_the_small_steps_verdict_on_busy_cores():
    tuner = ThreadTuner(2)
    assert tuner.choose_large() == 2  # nothing measured yet: every thread, as before
    _run(tuner, {1: 0.015, 2: 0.060}, 4)
    assert tuner.choose_large() == 1  # every thread 4x slower on a small step: the cores are busy
    idle = ThreadTuner(2)
    _run(idle, {1: 0.015, 2: 0.016}, 4)  # memory-bound small steps: a tie says nothing is busy
    assert idle.choose_large() == 2
    assert ThreadTuner(1).choose_large() == 1


def test_a_mixed_step_runs_on_one_thread_when_decodes_measured_busy_cores(tiny_model_dir):
    """The runner asks the tuner for mixed steps too: with the decode steps' measurements
    saying every thread is 4x slower, a prefill chunk + decodes step runs on one thread."""
    from pdkv.engine import LLMEngine

    engine = LLMEngine(ModelConfig(path=str(tiny_model_dir)), KVCacheConfig(page_size=16, num_pages=64),
                       SchedulerConfig(max_num_batched_tokens=64, chunk_size=32), num_threads=2)
    seen = []
    engine.connector.after_layer = lambda layer: seen.append(torch.get_num_threads())
    before = torch.get_num_threads()
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        engine.add_request("d", [5, 6, 7], params)
        engine.step()  # the decode's prompt
        engine.runner.tuner.avg = {1: 0.010, 2: 0.040}  # what a busy machine's decode steps measure
        engine.add_request("p", list(range(3, 60)), params)
        seen.clear()
        engine.step()  # one decode + a 32-token chunk: a large, mixed step
        assert seen and set(seen) == {1}, seen
        engine.runner.tuner.avg = {1: 0.010, 2: 0.009}  # idle cores: every thread again
        seen.clear()
        engine.step()  # one decode + the 25-token last chunk
        assert seen and set(seen) == {2}, seen
    finally:
        engine.connector.after_layer = None
        torch.set_num_threads(before)


def test_a_verification_step_follows_the_decodes_verdict_without_being_recorded(tiny_model_dir):
    """A 5-row verification (k = 4 drafts) is memory-bound like a decode: it runs on
    the thread count the decode steps measured faster, and its (longer) time does not enter
    their averages. Before, it counted as a large step and ran on every thread unless every
    thread had measured 1.5x slower than one (2 threads 1.2x slower here: one thread now)."""
    from pdkv.engine import LLMEngine
    from pdkv.engine.connector import KVConnector
    from pdkv.engine.request import Request, RequestStatus
    from pdkv.engine.scheduler import ScheduledSeq

    engine = LLMEngine(ModelConfig(path=str(tiny_model_dir)), KVCacheConfig(page_size=16, num_pages=16),
                       SchedulerConfig(max_num_batched_tokens=64, chunk_size=32), num_threads=2)
    runner, conn = engine.runner, KVConnector()
    req = Request("v", list(range(3, 19)), SamplingParams(temperature=0), None)
    req.pages, req.status = engine.allocator.allocate(2), RequestStatus.RUNNING
    runner.verify = lambda logits, r, drafts: [int(logits[0].argmax())]  # keeps no draft
    seen = []
    conn.after_layer = lambda layer: seen.append(torch.get_num_threads())
    before = torch.get_num_threads()
    try:
        runner.execute([ScheduledSeq(req, req.prompt_token_ids, 0, True)], conn)
        for avg, want in (({1: 0.010, 2: 0.012}, 1), ({1: 0.010, 2: 0.006}, 2)):
            runner.tuner.avg = dict(avg)
            seen.clear()
            runner.execute([ScheduledSeq(req, [5, 6, 7, 8, 9], 16, True, 4)], conn)
            assert seen and set(seen) == {want}, (avg, seen)
            assert runner.tuner.avg == avg  # not recorded
    finally:
        torch.set_num_threads(before)
        engine.allocator.free(req.pages)
