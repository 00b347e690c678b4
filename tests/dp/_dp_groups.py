"""Shared by the colocated DP group tests (test_dp_ep.py, test_dp_tp.py): one group per tiny MoE
family started side by side, the TP1 reference, running a group dry, and the abort check."""

from __future__ import annotations

from pdkv.config import ModelConfig
from pdkv.dp.group import DPGroup
from pdkv.engine import LLMEngine


def start_groups(moe_models, kv, sched, parallel):
    """Yields {family: DPGroup}, closed after (a module fixture's body)."""
    from concurrent.futures import ThreadPoolExecutor

    def start(folder):  # the groups start side by side: their ranks' imports and loads overlap
        return DPGroup(ModelConfig(path=str(folder)), kv, sched, parallel)

    with ThreadPoolExecutor(len(moe_models)) as pool:
        futures = {family: pool.submit(start, folder) for family, folder in moe_models.items()}
    made = {}
    try:
        for family, f in futures.items():
            made[family] = f.result()
        yield made
    finally:
        for f in futures.values():
            if f.exception() is None:
                f.result().close()


def reference(folder, prompts, kv, sched, params) -> list[list[int]]:
    """One TP1 engine's greedy tokens for ``prompts``."""
    one = LLMEngine(ModelConfig(path=str(folder)), kv, sched)
    return [o.output_token_ids for o in one.generate(prompts, params)]


def run_all(g) -> dict:
    """Steps until every request finished: request id -> its final output."""
    final = {}
    while g.has_unfinished():
        final.update((o.request_id, o) for o in g.step() if o.finished)
    return final


def check_abort_mid_run(g, ref, keep, drop, params, steps: int) -> None:
    """``keep`` on rank 0, ``drop`` on rank 1 aborted after ``steps`` steps (mid-prefill): rank 1
    runs dummies from then on, ``keep`` still gives ``ref``, every page and request is freed."""
    g.add_request("keep", keep, params, rank=0)
    g.add_request("drop", drop, params, rank=1)
    for _ in range(steps):
        g.step()
    g.abort("drop")
    dummies = g.dummy_steps[1]
    final = run_all(g)
    assert final["drop"].finish_reason == "abort"
    assert final["keep"].output_token_ids == ref
    assert g.dummy_steps[1] > dummies
    load = g.load()
    assert load["total"]["free_pages"] == load["total"]["total_pages"]
    assert load["total"]["requests"] == 0 and load["total"]["held_pages"] == 0


def check_uneven_run_finishes(g, family: str, num_short: int, ref, num_pages: int, dummies: int) -> None:
    """Runs the uneven test's requests (``family``-s0.. on rank 0, ``family``-long on rank 1) to
    the end: TP1's tokens ``ref``, every page back, rank 1 ran at least ``dummies`` dummy forwards
    by its own count, and every pair sent was received."""
    final = run_all(g)
    got = [final[f"{family}-s{i}"] for i in range(num_short)] + [final[f"{family}-long"]]
    assert [o.output_token_ids for o in got] == ref
    assert all(o.finish_reason == "length" for o in got)
    load = g.load()
    assert load["healthy"] and load["total"]["free_pages"] == load["total"]["total_pages"] == 2 * num_pages
    assert load["ranks"][1]["dummies"] >= dummies  # the ranks' own counts agree with the front's
    assert load["total"]["pairs_sent"] == load["total"]["pairs_received"] > 0
