"""One rank of a data-parallel group (``python -m pdkv.dp.rank CONTROL_FD``): its own engine
(scheduler, paged latent KV cache, prefix cache, requests) over a model whose routed experts are
this rank's share, stepping when the group's front says so (pdkv/dp/group.py).

Control messages (pdkv/tp/channel.py framing), front → rank:
  ("init", dict) ("add", (request_id, prompt, params, arrival, priority, remote)) ("abort", ...)
  ("step", None) ("load", None) ("record", bool) ("stop", None); on a disaggregated decode group
  (pdkv/dp/remote.py) also ("pool_mapped", None) ("kv_ready", (request_id, prompt_logprobs))
  ("release", request_id); a disaggregated prefill group's rank sends ("note", RankChunks |
  RankHidden) during a step, before its reply
and each answered, rank → front, by ("ok", payload) or ("err", exception); first ("hello", pid)
and ("ready", info) or ("error", traceback text).

A step is lock-step: every rank gets ("step") for every group step and runs exactly one forward
pass: its engine's, or, when its scheduler has nothing to compute (no requests, or only ones
waiting), a dummy one that joins every MoE layer's all-to-all with zero tokens. With
``parallel.tp`` > 1 (tp x dp) the engine is a TP engine whose followers are this rank's lanes
(pdkv/dp/lane.py); its ExpertGroup announces every forward, dummies too, to them.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import traceback

log = logging.getLogger("pdkv.dp.rank")


def load_info(engine) -> dict:
    """What the front places requests by (pdkv/dp/placement.py) and reports in /load."""
    s = engine.scheduler
    # Outstanding tokens, counted as the front counts what it places (prompt + max_tokens): the
    # prompt tokens still to compute plus the output tokens still to come, for every request not
    # finished -- not admitted yet, waiting, running, or waiting for its KV from a prefill node.
    # A report counting less would undo the front's count and send the next request here too.
    def outstanding(r) -> int:
        return (max(0, r.num_prompt_tokens - r.num_computed_tokens)
                + max(0, r.params.max_tokens - len(r.output_token_ids)))
    return {"running": len(s.running), "waiting": len(s.waiting) + len(s.pending) + len(s.remote),
            "tokens": sum(outstanding(r) for r in (*s.running, *s.waiting, *s.pending, *s.remote.values())),
            "free_pages": engine.allocator.num_free, "total_pages": engine.allocator.num_total,
            "requests": len(engine.requests), "held_pages": engine.num_held_pages}


def step(engine, group) -> dict:
    """One lock-step step: the engine's forward if it has one to run, else a dummy."""
    from pdkv.engine.request import RequestOutput  # noqa: PLC0415

    before = group.forwards
    # the requests this rank's scheduler can take now (pages free); one refused ends here
    outputs = [RequestOutput(rid, [], "", True, "error", 0, 0, [], "") for rid, _ in engine.admit()]
    outputs += engine.step() if engine.has_work() else []
    dummy = group.forwards == before
    error = None
    if dummy:
        try:
            group.dummy_forward()
        except Exception as e:  # noqa: BLE001 - the group is broken: report it, fail nothing here twice
            error = str(e)
    broken = group.broken  # its all-to-all, or (tp x dp) one of its TP ranks
    if broken is not None:
        error = str(broken)
        # The group cannot step again: every request left fails now, its pages freed.
        for rid in list(engine.requests):
            engine.abort(rid, reason="error")
        outputs += engine.step()  # nothing left to schedule: only the aborts' final outputs
    return {"outputs": outputs, "dummy": dummy, "reserved": _reserved(engine),
            "work": engine.has_work() or engine.num_pending > 0, "load": load_info(engine), "error": error,
            "stats": engine.stats(),
            "running": [r.request_id for r in engine.scheduler.running],
            # tp x dp: this rank's TP followers that exited (the cause of the others' failures)
            "lost": _lost(engine) if error is not None else []}


def _lost(engine) -> list[int]:
    """The exit codes of this rank's TP followers that exited."""
    tp = engine.tp
    codes = [] if tp is None else [tp.followers.procs[r].poll() for r in tp.followers.ranks]
    return [c for c in codes if c is not None]


def serve(ch) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from pdkv.dp.expert import ExpertGroup  # noqa: PLC0415
    from pdkv.engine import LLMEngine  # noqa: PLC0415

    kind, init = ch.recv()
    if kind != "init":
        raise RuntimeError(f"expected an 'init' message first, got {kind!r}")
    rank, size = init["rank"], init["size"]
    model = init["model"]
    device = torch.device(model.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = init["num_threads"]
    if init.get("cpus"):  # this rank's share of parallel.cpus (pdkv/dp/group.py rank_cpu_sets)
        from pdkv.cpus import pin_cpus  # noqa: PLC0415

        threads = len(pin_cpus(init["cpus"]))
    ch.send("hello", os.getpid())
    store = dist.TCPStore(init["host"], init["port"], size, False,
                          timeout=datetime.timedelta(seconds=init["startup_timeout_s"]))
    group = ExpertGroup(rank, size, store, device, init["timeout_s"],
                        store_addr=(init["host"], init["port"], init["startup_timeout_s"]))
    pool: list = []  # a disaggregated decode group's shared KV file (pdkv/dp/remote.py)
    kw = {}
    if init.get("shared_kv"):
        from pdkv.dp.remote import RankRemoteConnector, shared_kv_buffer  # noqa: PLC0415

        if device.type != "cpu":
            raise RuntimeError(f"a disaggregated DP group maps its ranks' KV pools in shared memory, "
                               f"CPU only: model.device {model.device} would need the ranks' cuMem "
                               "exported to the front (not implemented)")
        kw["kv_buffer"] = shared_kv_buffer(pool)
    # tp x dp: this rank is a TP engine whose followers are its lanes (pdkv/dp/lane.py)
    engine = LLMEngine(model, init["kv_cache"], init["scheduler"], num_threads=threads, ep=group,
                       parallel=init["parallel"], **kw)
    remote = None
    if pool:
        from pdkv.dp.remote import RankPrefillConnector, pool_info  # noqa: PLC0415

        if init.get("role") == "prefill":  # every request prefill-only: the front sends its pages
            engine.set_connector(RankPrefillConnector(ch, pool, engine.kv.num_layers))
        else:
            remote = RankRemoteConnector(engine.kv.page_size)
            engine.set_connector(remote)
    ch.send("ready", {"pid": os.getpid(), "load": load_info(engine), "max_model_len": engine.max_model_len,
                      "stats": engine.stats(), "vocab_size": engine.vocab_size,
                      "eos": list(engine.tokenizer.eos_token_ids), "cpus": sorted(os.sched_getaffinity(0)),
                      "page_size": engine.kv.page_size, "experts": list(engine.loaded.arch.moe.local_experts),
                      "model_name": engine.model_name, "hidden_size": int(engine.loaded.arch.hidden_size),
                      "dtype": str(engine.loaded.dtype).removeprefix("torch."),
                      "pool": pool_info(engine, pool) if pool else None,
                      "lanes": engine.tp.pids if engine.tp is not None else []})
    handlers = {
        "add": lambda p: _add(engine, remote, *p),
        "abort": lambda p: _abort(engine, remote, *p),
        "step": lambda _: step(engine, group),
        "load": lambda _: {**load_info(engine), "forwards": group.forwards, "dummies": group.dummies,
                           "comm_s": group.dispatcher.comm_s, "dispatch_s": group.dispatcher.total_s,
                           "pairs_sent": group.dispatcher.pairs_sent,
                           "pairs_received": group.dispatcher.pairs_received},
        "record": lambda on: _record(group, on),
        "cached": lambda prompt: engine.cached_prefix_tokens(prompt),
        # the front mapped this rank's pool: the file's name is no longer needed (a crash leaves none)
        "pool_mapped": lambda _: _unlink(pool),
        "kv_ready": lambda p: engine.remote_kv_ready(*p),
        "release": lambda rid: engine.release(rid),
    }
    while True:
        kind, payload = ch.recv()
        if kind == "stop":
            break
        try:
            ch.send("ok", handlers[kind](payload))
        except Exception as e:  # noqa: BLE001 - the front re-raises it for the caller
            ch.send("err", e)
    engine.release_all()
    engine.close()  # tp x dp: its lanes stop with it


def _add(engine, remote, request_id, prompt, params, arrival=None, priority=0, is_remote=False) -> dict:
    """Submits and tries to admit the request (remote: its prompt's KV comes from a prefill
    node); returns the reservations made, for the front to send their PREFILLs."""
    if is_remote:
        remote.remote.add(request_id)
    try:
        engine.add_request(request_id, prompt, params, arrival, priority)
    except BaseException:
        if remote is not None:
            remote.remote.discard(request_id)
        raise
    return {"reserved": _reserved(engine)}


def _abort(engine, remote, request_id, *args) -> None:
    if remote is not None:  # one that was still pending never reaches the connector
        remote.remote.discard(request_id)
    engine.abort(request_id, *args)


def _unlink(pool: list) -> None:
    for buf in pool:
        buf.unlink()


def _reserved(engine) -> list:
    take = getattr(engine.connector, "take_reserved", None)
    return take() if take is not None else []


def _record(group, on: bool):
    """Starts (True) or ends (False, returning it) the dispatcher's log of moved pairs."""
    d = group.dispatcher
    if on:
        d.record = []
        return None
    out, d.record = d.record, None
    return out


def main(argv: list[str]) -> int:
    from pdkv.tp.channel import Channel, ChannelClosed  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(asctime)s dp-rank %(levelname)s %(message)s")
    ch = Channel(socket.socket(fileno=int(argv[0])))
    try:
        serve(ch)
        return 0
    except ChannelClosed:
        return 0  # the front is gone: nothing to report to
    except BaseException:  # noqa: BLE001 - reported to the front, then we exit
        text = traceback.format_exc()
        try:
            ch.send("error", text)
        except Exception:  # noqa: BLE001
            print(text, file=sys.stderr, flush=True)
        return 1
    finally:
        ch.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
