"""A data-parallel group with expert parallelism (``parallel: {dp: N, ep: true}``): N rank
processes (``python -m pdkv.dp.rank``; with ``tp: M`` each a TP-M engine over M - 1 lane
followers of its own, pdkv/dp/lane.py), each with its own engine (scheduler, paged latent KV
cache, prefix cache, requests), attention and dense layers run on its own tokens, and every MoE
layer's routed experts shared by all ranks through an all-to-all (pdkv/dp/dispatch.py). This
object is the group's front: it places each request on a rank (pdkv/dp/placement.py), steps all
ranks together, and merges their outputs; it has LLMEngine's request API (add_request, abort,
step, has_unfinished, generate) so one endpoint serves the group.

Lock step: ``step`` sends "step" to every rank whenever any rank has work; each runs exactly one
forward (its own, or a dummy with zero tokens that joins the all-to-alls), so a prefill chunk on
one rank and decodes on another share the step and an idle rank never blocks the others.

Failures. Every wait on a rank polls its process: a rank that dies is named (``DPRankError``).
The others are then inside an all-to-all that can never complete; gloo / NCCL end it after
``parallel.timeout_s`` (or at once when the dead peer's connection closes), their engines fail
that step's requests with finish_reason "error" and free the pages, and every request of the
group is finished with "error" (the dead rank's by the front). The group is then unhealthy:
later steps and new requests fail at once. A step that no rank answers within
``parallel.timeout_s`` + ``STEP_GRACE_S`` fails the same way: no wait is unbounded.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref

from pdkv.config import KVCacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdkv.dp.placement import Placer
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import RequestOutput, RequestStatus
from pdkv.errors import PdkvError
from pdkv.tp.channel import Channel, ChannelClosed

log = logging.getLogger(__name__)

STEP_GRACE_S = 30.0  # beyond parallel.timeout_s: a rank's own collective timeout fires first


class DPRankError(PdkvError, RuntimeError):
    """A data-parallel rank died, failed or did not answer in time; the message names it."""


def _repo_root() -> str:
    import pdkv  # noqa: PLC0415

    return os.path.dirname(os.path.dirname(os.path.abspath(pdkv.__file__)))


def _shutdown(procs: list, chans: list, broken: dict, lanes: list) -> None:
    """``lanes``: the pids of the ranks' TP followers (tp x dp): a broken group's are killed
    too, as a rank killed here cannot stop them and they may wait in a collective."""
    for ch in chans:
        if not broken["broken"]:
            try:
                ch.send("stop")
            except (ChannelClosed, OSError):
                pass
        ch.close()
    for p in procs:
        if broken["broken"]:
            p.kill()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for pid in lanes if broken["broken"] else ():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class DPGroup:
    def __init__(self, model: ModelConfig, kv_cache: KVCacheConfig, scheduler: SchedulerConfig,
                 parallel: ParallelConfig, num_threads: int | None = None, balance_tokens: int = 2048,
                 shared_kv: bool = False, role: str = "colocated"):
        """``shared_kv``: the group is a disaggregated node's engine (``role`` decode or prefill):
        every rank's KV pool is mapped here too (``dp_regions``, pdkv/dp/remote.py) for the
        node's messenger."""
        import torch.distributed as dist  # noqa: PLC0415

        validate_parallel(parallel, model.path)
        if shared_kv and parallel.tp > 1:
            raise ValueError(f"parallel.tp={parallel.tp} with parallel.dp={parallel.dp} on a {role} node: a "
                             "disaggregated tp x dp group is not implemented (each rank's TP ranks would "
                             "each need their latent pool mapped by the front); use tp: 1")
        if model.path:  # the model's fit (a MoE model; dp divides its experts), before any process starts
            from pdkv.models.loader import read_json  # noqa: PLC0415

            from pathlib import Path  # noqa: PLC0415

            config_json = Path(model.path) / "config.json"
            check_dp_model(parallel, read_json(config_json), str(config_json))
        self.size = n = parallel.dp
        self.role = role
        self.timeout_s, self.startup_timeout_s = parallel.timeout_s, parallel.startup_timeout_s
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        # the ranks share this host's cores; num_threads: each process's, a TP rank's included
        threads = num_threads * parallel.tp if num_threads else max(parallel.tp, cores // n)
        cpu_sets = rank_cpu_sets(parallel.cpus, n)  # parallel.cpus: a share of the set per rank
        self.procs: list[subprocess.Popen] = []
        self.chans: list[Channel] = []
        self._state = {"broken": False}
        self.lane_pids: list[int] = []  # the ranks' TP followers (tp x dp), by rank then TP rank
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.chans, self._state, self.lane_pids)
        self.error: DPRankError | None = None
        self.step_grace_s = STEP_GRACE_S
        self.rank_of: dict[str, int] = {}  # unfinished request -> its rank
        self._last: dict[str, RequestOutput | None] = {}  # its latest output (a dead rank's are failed here)
        self._prompts: dict[str, int] = {}  # its prompt length
        self._status: dict = {}  # its RequestStatus as the front knows it (the server's queue-wait metric)
        self._loads: list[dict] = []
        self._ids = itertools.count()
        self.steps = 0
        self.dummy_steps = [0] * n  # steps each rank ran a dummy forward in
        self._store = dist.TCPStore("127.0.0.1", 0, n * parallel.tp + 1, True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.startup_timeout_s))
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH", "")) if p)
            for _ in range(n):
                mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    self.procs.append(subprocess.Popen([sys.executable, "-m", "pdkv.dp.rank", str(theirs.fileno())],
                                                       pass_fds=[theirs.fileno()], env=env))
                finally:
                    theirs.close()
                self.chans.append(Channel(mine))
            init = {"size": n, "host": "127.0.0.1", "port": self._store.port, "timeout_s": self.timeout_s,
                    "startup_timeout_s": self.startup_timeout_s, "model": model, "kv_cache": kv_cache,
                    "scheduler": scheduler, "num_threads": threads, "shared_kv": shared_kv, "role": role,
                    "parallel": ParallelConfig(tp=parallel.tp, timeout_s=self.timeout_s,
                                               startup_timeout_s=self.startup_timeout_s)}
            for r, ch in enumerate(self.chans):
                ch.send("init", {**init, "rank": r, "cpus": cpu_sets[r]})
            self.pids = self._wait_all("hello", self.startup_timeout_s)
            ready = self._wait_all("ready", self.startup_timeout_s)
            self.lane_pids += [pid for x in ready for pid in x["lanes"]]
        except BaseException:
            self.close()
            raise
        self.experts = [tuple(x["experts"]) for x in ready]  # each rank's routed experts
        self.rank_cpus = [tuple(x["cpus"]) for x in ready]  # each rank's CPU affinity
        self._loads = [x["load"] for x in ready]
        self._stats = [x["stats"] for x in ready]
        self.vocab_size = ready[0]["vocab_size"]
        self.max_model_len, self.page_size = ready[0]["max_model_len"], ready[0]["page_size"]
        self.model_name = ready[0]["model_name"]
        self.placer = Placer(n, self.page_size, balance_tokens)
        self.connector = None  # a disaggregated decode node's (set_connector); None: colocated
        self.tp = None  # each rank is a TP1 engine: a replicated latent, one region per rank
        self._remote: dict[str, int] = {}  # rid -> rank, while a transfer may touch its pages
        self._tokens: dict[str, list[int]] = {}  # a remote request's prompt, until its pages are reserved
        self._work = [False] * n  # each rank's answer: it has something to compute or admit
        self._dirty = False  # a command since the last step that may give a rank work
        self.remote_landed = [0] * n  # requests whose remote KV landed in each rank's pool
        self.dp_regions = None
        if shared_kv:
            self._map_pools(model, ready)
        self.tokenizer = None
        try:
            from pdkv.tokenizer import Tokenizer  # noqa: PLC0415

            self.tokenizer = Tokenizer(model.path, tuple(ready[0]["eos"])) if model.path else None
        except Exception:  # noqa: BLE001 - text prompts are then placed by load alone
            self.tokenizer = None

    def _map_pools(self, model: ModelConfig, ready: list) -> None:
        """Maps every rank's KV pool (pdkv/dp/remote.py) and gives the group what the decode
        node reads of an engine: ``kv`` (rank 0's view: every pool has its geometry),
        ``loaded`` (path, dtype, arch), ``config`` (the checkpoint's config.json)."""
        from pathlib import Path  # noqa: PLC0415
        from types import SimpleNamespace  # noqa: PLC0415

        import torch  # noqa: PLC0415

        from pdkv.dp.remote import RankPools  # noqa: PLC0415
        from pdkv.models.config import parse_arch_config  # noqa: PLC0415
        from pdkv.models.loader import read_json  # noqa: PLC0415

        try:
            path = Path(model.path)
            self.config = read_json(path / "config.json")
            arch = parse_arch_config(self.config, str(path / "config.json"))
            self.pools = RankPools(arch, [x["pool"] for x in ready])
            for r in range(self.size):
                self._call(r, "pool_mapped")
        except BaseException:
            self.close()
            raise
        self.dp_regions = self.pools.regions
        self.kv = self.pools.kv
        self.loaded = SimpleNamespace(path=str(path), dtype=getattr(torch, ready[0]["dtype"]), arch=arch)

    def set_connector(self, connector) -> None:
        """A disaggregated decode node's front connector (pdkv/disagg/dp_decode.py): it decides
        which requests prefill remotely (``route``) and sends the PREFILL of each reservation a
        rank made (``reserved``); None: every request prefills on its rank."""
        self.connector = connector

    # ---- talking to ranks ------------------------------------------------------------------
    def _alive(self, r: int) -> None:
        code = self.procs[r].poll()
        if code is None:
            return
        detail = ""
        try:
            while self.chans[r].readable(0):
                kind, payload = self.chans[r].recv()
                if kind == "error":
                    detail = f"; its traceback:\n{payload}"
        except (ChannelClosed, OSError, EOFError):
            pass
        raise self._broken(DPRankError(f"data-parallel rank {r} (pid {self.procs[r].pid}) exited with code "
                                       f"{code}; this group cannot run further steps{detail}"))

    def _broken(self, e: DPRankError) -> DPRankError:
        if self.error is None:
            self.error = e
            self._state["broken"] = True
        return self.error

    def _recv(self, r: int, deadline: float, what: str):
        try:
            msg = self.chans[r].recv_until(deadline, lambda: self._alive(r))
        except ChannelClosed:
            self._alive(r)  # raises if it exited
            raise self._broken(DPRankError(f"data-parallel rank {r} closed its channel during {what}")) from None
        if msg is None:
            raise self._broken(DPRankError(
                f"data-parallel rank {r} did not answer {what} in time (parallel.timeout_s={self.timeout_s:g} "
                f"+ {self.step_grace_s:g} s for a step, parallel.startup_timeout_s={self.startup_timeout_s:g} "
                "to start); this group cannot run further steps"))
        return msg

    def _wait_all(self, kind: str, timeout_s: float) -> list:
        out, deadline = [], time.monotonic() + timeout_s
        for r in range(self.size):
            k, payload = self._recv(r, deadline, repr(kind))
            if k == "error":
                raise self._broken(DPRankError(f"data-parallel rank {r} failed before {kind!r}:\n{payload}"))
            if k != kind:
                raise self._broken(DPRankError(f"data-parallel rank {r} sent {k!r}, expected {kind!r}"))
            out.append(payload)
        return out

    def _call(self, r: int, kind: str, payload=None, timeout_s: float | None = None, broken_ok: bool = False):
        if self.error is not None and not broken_ok:
            raise self.error
        try:
            self.chans[r].send(kind, payload)
        except ChannelClosed:
            self._alive(r)
            raise
        k, answer = self._recv(r, time.monotonic() + (timeout_s or self.timeout_s + self.step_grace_s), repr(kind))
        if k == "err":
            raise answer
        return answer

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival: float | None = None, rank: int | None = None, priority: int = 0) -> int:
        """Places the request (``rank``: on that rank) and submits it there (the rank admits it
        when its pages are free, before each of its steps); returns the rank. Raises what the
        rank's engine raises (InvalidRequest, a refusal) or DPRankError."""
        if request_id in self.rank_of:
            from pdkv.errors import InvalidRequest  # noqa: PLC0415

            raise InvalidRequest(f"request id {request_id!r} is already in use")
        ids = prompt if isinstance(prompt, list) else (self.tokenizer.encode(prompt) if self.tokenizer else None)
        if rank is None:
            rank = self.placer.choose(ids, self._loads)
        elif not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is out of range for parallel.dp={self.size}")
        remote = self.connector is not None and ids is not None and self.connector.route(len(ids))
        got = self._call(rank, "add", (request_id, ids if ids is not None else prompt, params, arrival, priority,
                                       remote))
        if remote:
            self._tokens[request_id] = list(ids)
        if self.role == "prefill":  # every page it computes is read by the front's writes until release
            self._remote[request_id] = rank
        self._dirty = True
        self.placer.placed(ids, rank)
        self.rank_of[request_id] = rank
        self._status[request_id] = _Seen(RequestStatus.WAITING)
        self._last[request_id] = None
        self._prompts[request_id] = len(ids) if ids is not None else 0
        load = self._loads[rank]  # until the rank's next report: count what was just placed
        load["tokens"] += len(ids or ()) + params.max_tokens
        load["free_pages"] -= -(-len(ids or ()) // self.page_size)
        self._reserved(rank, (got or {}).get("reserved", ()))
        return rank

    def _reserved(self, rank: int, reserved) -> None:
        """Rank ``rank`` reserved these requests' pages for remote KV: their PREFILLs go out."""
        for rid, cached, pages, priority in reserved:
            self._remote[rid] = rank
            self.connector.reserved(rid, rank, self._tokens.pop(rid), cached, pages, priority)

    def abort(self, request_id: str, quarantine: bool = False, reason: str = "abort") -> None:
        """As LLMEngine.abort, on the request's rank (its final output comes from the next step)."""
        r = self.rank_of.get(request_id)
        if r is not None and self.error is None:  # broken: every request was failed already
            self._call(r, "abort", (request_id, quarantine, reason))
            self._tokens.pop(request_id, None)
            self._dirty = True
            if self.connector is not None and request_id in self._remote:
                self.connector.finished(request_id, reason)

    # ---- what the server's engine loop and routes read (pdkv/engine/loop.py, server/) ----------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               arrival: float | None = None, priority: int = 0) -> None:
        """As LLMEngine.submit: the request goes to its rank's own pending queue at once."""
        self.add_request(request_id, prompt, params, arrival, priority=priority)

    def admit(self) -> list:
        """Nothing waits here: each rank admits its own pending requests before its steps (a
        refusal there ends the request with finish_reason "error" in that step's outputs)."""
        return []

    @property
    def num_pending(self) -> int:
        return 0

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """The checks that need no rank (each rank's engine checks everything again at admission,
        the priority against its scheduler.policy included)."""
        from pdkv.errors import InvalidRequest  # noqa: PLC0415

        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                 f"exceeds the model's context length ({self.max_model_len})")

    def in_transfer(self, request_id: str) -> bool:
        """Whether a remote write may still land in the request's pages (colocated: never)."""
        return request_id in self._remote and request_id in self.rank_of

    def remote_kv_ready(self, request_id: str, prompt_logprobs: list | None = None) -> None:
        """As LLMEngine.remote_kv_ready, on the request's rank (its pages were written there)."""
        r = self._remote.pop(request_id, None)
        if r is not None and self.error is None:
            self._dirty = True
            self.remote_landed[r] += 1
            self._call(r, "kv_ready", (request_id, prompt_logprobs))

    def release(self, request_id: str) -> int:
        """As LLMEngine.release: the request's held pages on its rank go back."""
        r = self._remote.pop(request_id, None)
        if r is None or self.error is not None:
            return 0
        self._dirty = True
        return self._call(r, "release", request_id)

    def release_all(self) -> None:
        pass

    @property
    def requests(self) -> dict:
        """request id -> its status as the front last saw it (WAITING until a step ran a chunk)."""
        return self._status

    @property
    def allocator(self):
        """The ranks' page counts summed, as of their last step (what /health reads)."""
        from types import SimpleNamespace  # noqa: PLC0415

        st = self.stats()
        return SimpleNamespace(num_free=st.get("num_pages_free", 0), num_total=st.get("num_pages_total", 0),
                               num_evictable=st.get("num_pages_cached", 0), num_used=st.get("num_pages_used", 0))

    @property
    def num_held_pages(self) -> int:
        return sum(s.get("num_pages_held", 0) for s in self._stats)

    def stats(self) -> dict:
        """The ranks' engine stats (as of their last step) summed, plus each rank's under "ranks"."""
        total: dict = {}
        for st in self._stats:
            for k, v in st.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        total["page_size"] = self.page_size
        return {**total, "dp": self.size, "healthy": self.error is None, "ranks": [dict(s) for s in self._stats]}

    def load_report(self, in_flight: int = 0) -> dict:
        """What /load serves for a group: the summed counts a router reads, and each rank's."""
        st = self.stats()
        ranks = [{"rank": r, "num_running": x.get("num_running", 0), "num_waiting": x.get("num_waiting", 0),
                  "queued_tokens": self._loads[r]["tokens"], "num_pages_free": x.get("num_pages_free", 0),
                  "num_pages_total": x.get("num_pages_total", 0), "num_remote_kv_landed": self.remote_landed[r]}
                 for r, x in enumerate(self._stats)]
        return {"in_flight": in_flight, "num_running": st.get("num_running", 0),
                "num_waiting": st.get("num_waiting", 0) + st.get("num_waiting_remote_kv", 0),
                "queued_prompt_tokens": sum(r["queued_tokens"] for r in ranks),
                "num_pages_free": st.get("num_pages_free", 0), "num_pages_total": st.get("num_pages_total", 0),
                "dp": self.size, "healthy": self.error is None, "ranks": ranks}

    def has_work(self) -> bool:
        """Colocated: any request open. With remote KV, only what a step can compute or admit
        (requests waiting for their KV are not work: stepping for them would spin)."""
        if self.connector is None:
            return bool(self.rank_of)
        return bool(self.rank_of) and (self._dirty or any(self._work))

    def has_unfinished(self) -> bool:
        return bool(self.rank_of)

    def step(self) -> list[RequestOutput]:
        """One lock-step step of every rank; their outputs merged. After a rank failure: every
        unfinished request's final output with finish_reason "error", then DPRankError."""
        if self.error is not None:
            raise self.error
        framed = Channel.pack("step")
        sent = []
        outputs: list[RequestOutput] = []
        failure: DPRankError | None = None
        silent: list[int] = []  # ranks that did not answer (gone, or stuck)
        lost: dict[int, tuple] = {}  # tp x dp: ranks whose TP followers exited -> (exit codes, error)
        for r, ch in enumerate(self.chans):
            try:
                ch.send_packed(framed)
                sent.append(r)
            except ChannelClosed:
                failure = failure or self._probe(r)
        replies = self._step_replies(sent, time.monotonic() + self.timeout_s + self.step_grace_s)
        for r in sent:
            if isinstance(replies[r], DPRankError):
                failure = failure or replies[r]
                silent.append(r)
                continue
            k, rep = replies[r]
            if k != "ok":
                failure = failure or self._broken(DPRankError(f"data-parallel rank {r} failed a step: {rep}"))
                continue
            self._loads[r] = rep["load"]
            self._stats[r] = rep["stats"]
            for rid in rep["running"]:
                seen = self._status.get(rid)
                if seen is not None:
                    seen.status = RequestStatus.RUNNING
            self.dummy_steps[r] += rep["dummy"]
            self._work[r] = rep["work"]
            if rep["reserved"]:
                self._reserved(r, rep["reserved"])
            if rep["error"] is not None:
                failure = failure or self._broken(DPRankError(f"data-parallel rank {r}: {rep['error']}"))
                if rep["lost"]:
                    lost[r] = (rep["lost"], rep["error"])
            outputs += rep["outputs"]
        self.steps += 1
        self._dirty = False
        for o in outputs:
            if o.finished:
                self.rank_of.pop(o.request_id, None)
                self._tokens.pop(o.request_id, None)  # its rank computed it after all (cached here)
                self._status.pop(o.request_id, None)
                self._last.pop(o.request_id, None)
                self._prompts.pop(o.request_id, None)
            else:
                self._last[o.request_id] = o
        if failure is not None:
            self._diagnose(silent, lost)
            if self.connector is not None:
                self.connector.group_failed(self.error)
            outputs += self._fail_all()
        return outputs

    def _step_replies(self, sent: list[int], deadline: float) -> dict:
        """Each rank's reply to "step" (or the DPRankError it ended with), read from whichever
        rank is ready first: the notes a rank sends its front's connector during the step (a
        prefill group's chunks, pdkv/dp/remote.py) are handed over as they come, while the other
        ranks still compute."""
        out: dict = {}
        left = list(sent)
        while left:
            wait = max(0.0, min(0.2, deadline - time.monotonic()))
            ready, _, _ = select.select([self.chans[r].sock for r in left], [], [], wait)
            due = [r for r in left if self.chans[r].sock in ready] or (left if wait == 0.0 else [])
            for r in left:
                try:
                    if r in due:
                        k, payload = self._recv(r, deadline, "step")
                        if k == "note":
                            self.connector.note(r, payload)
                            continue
                        out[r] = (k, payload)
                    else:
                        self._alive(r)
                except DPRankError as e:
                    out[r] = e
            left = [r for r in left if r not in out]
        return out

    def _diagnose(self, silent: list[int], lost: dict[int, tuple]) -> None:
        """After a failed step: a rank that exited, or one whose TP follower exited (tp x dp), or
        else one that never answered, is the cause (the others' all-to-alls failed because of
        it), so the group's error names it; an exited process gets a moment to be reaped."""
        deadline = time.monotonic() + 2.0
        while True:
            for r in range(self.size):
                code = self.procs[r].poll()
                if code is not None:
                    self.error = DPRankError(f"data-parallel rank {r} (pid {self.procs[r].pid}) exited with code "
                                             f"{code}; this group cannot run further steps (first failure seen: "
                                             f"{self.error})")
                    return
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if lost:
            # A follower killed by a signal is the cause; one that exited 1 reported the error its
            # lane's all-to-all got from the dead one (else: the lowest rank's)
            r = min(lost, key=lambda r: (not any(c < 0 for c in lost[r][0]), r))
            self.error = DPRankError(f"data-parallel rank {r} lost a tensor-parallel rank: {lost[r][1]} (first "
                                     f"failure seen: {self.error})")
        elif silent:
            r = silent[0]
            self.error = DPRankError(f"data-parallel rank {r} (pid {self.procs[r].pid}) is alive but did not answer "
                                     f"the step within parallel.timeout_s={self.timeout_s:g} + {self.step_grace_s:g} s "
                                     f"(stuck); this group cannot run further steps (first failure seen: {self.error})")

    def _probe(self, r: int) -> DPRankError:
        try:
            self._alive(r)
        except DPRankError as e:
            return e
        return self._broken(DPRankError(f"data-parallel rank {r} closed its channel"))

    def _fail_all(self) -> list[RequestOutput]:
        """The final outputs of every request still open (a rank is gone: they end with "error")."""
        out = []
        for rid in list(self.rank_of):
            last = self._last.get(rid)
            ids = list(last.output_token_ids) if last is not None else []
            out.append(RequestOutput(rid, [], "", True, "error", self._prompts.get(rid, 0), len(ids), ids,
                                     last.text if last is not None else ""))
        self.rank_of.clear()
        self._tokens.clear()
        self._status.clear()
        self._last.clear()
        self._prompts.clear()
        return out

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 ranks: list[int] | None = None) -> list[RequestOutput]:
        """Runs ``prompts`` to completion (``ranks``: where each goes; default: placed); one final
        output each, in order, as LLMEngine.generate."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"dp-{next(self._ids)}" for _ in prompts]
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, plist)):
            self.add_request(rid, prompt, p, rank=None if ranks is None else ranks[i])
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out.whole()
        return [final[r] for r in ids]

    # ---- observability -----------------------------------------------------------------------
    def load(self) -> dict:
        """Per rank (its engine's counts, forwards, dummy forwards, all-to-all seconds and pairs)
        and summed: what /load and /metrics report for the group."""
        ranks = [self._rank_load(r) for r in range(self.size)]
        live = [x for x in ranks if x is not None]
        total = {k: sum(x[k] for x in live) for k in live[0]} if live else {}
        return {"dp": self.size, "ranks": ranks, "total": total, "healthy": self.error is None,
                "error": None if self.error is None else str(self.error),
                "placed_by_affinity": self.placer.placed_by_affinity, "placed_by_load": self.placer.placed_by_load}

    def _rank_load(self, r: int) -> dict | None:
        """Rank r's counts; after a failure, those of the ranks still alive (None: gone)."""
        if self.error is None:
            return self._call(r, "load")
        if self.procs[r].poll() is not None:
            return None
        try:
            return self._call(r, "load", broken_ok=True, timeout_s=self.timeout_s + self.step_grace_s)
        except (DPRankError, ChannelClosed, OSError):
            return None

    def record(self, on: bool) -> list | None:
        """Starts (True) or ends (False) every rank's dispatch log; False returns them by rank."""
        got = [self._call(r, "record", on) for r in range(self.size)]
        return None if on else got

    @property
    def healthy(self) -> bool:
        return self.error is None

    @classmethod
    def from_config(cls, cfg) -> DPGroup:
        """The group of a pdkv.config.Config (any role; its model, kv_cache, scheduler and
        parallel sections: the scheduler and cache are each rank's)."""
        method = cfg.speculative.method if cfg.speculative is not None else None
        if cfg.role != "colocated" and method in ("mtp", "draft"):
            raise ValueError(f"{cfg.source}: parallel.dp={cfg.parallel.dp} with speculative.method "
                             f"{cfg.speculative.method}: the speculative hand-off with a DP-EP group is "
                             "not implemented")
        return cls(cfg.model, cfg.kv_cache, cfg.scheduler, cfg.parallel, shared_kv=cfg.role != "colocated",
                   role=cfg.role)

    def close(self) -> None:
        """Stops every rank (kills them if the group is broken: they may sit in a collective)."""
        self._finalizer()
        self._store = None


def rank_cpu_sets(text: str, dp: int) -> list[str]:
    """``parallel.cpus`` split into ``dp`` contiguous shares, one per rank (a rank's torch threads
    and its all-to-all stay on its own cores); "" for every rank when it is empty."""
    from pdkv.cpus import parse_cpu_list  # noqa: PLC0415

    cpus = parse_cpu_list(text)
    if not cpus:
        return [""] * dp
    if len(cpus) < dp:
        raise ValueError(f"parallel.cpus={text!r} lists {len(cpus)} CPU(s) for parallel.dp={dp} ranks: each rank "
                         "needs at least one")
    base, extra = divmod(len(cpus), dp)
    out, i = [], 0
    for r in range(dp):
        n = base + (r < extra)
        out.append(",".join(str(c) for c in cpus[i:i + n]))
        i += n
    return out


class _Seen:
    """A request's status as the front knows it (what server/async_engine.py reads of a request)."""

    __slots__ = ("status",)

    def __init__(self, status: RequestStatus):
        self.status = status


def validate_parallel(parallel: ParallelConfig, where: str = "") -> None:
    """parallel.dp / parallel.ep that cannot run, named (the model's own checks come at load)."""
    pre = f"{where}: " if where else ""
    if parallel.dp < 2:
        raise ValueError(f"{pre}parallel.dp must be >= 2 for a data-parallel group, got {parallel.dp}")
    if not parallel.ep:
        raise ValueError(f"{pre}parallel.dp={parallel.dp} needs parallel.ep: true (data-parallel attention shares "
                         "the MoE layers by expert parallelism; a dense model runs as separate engines behind "
                         "the router instead)")
    if parallel.tp < 1:
        raise ValueError(f"{pre}parallel.tp must be >= 1, got {parallel.tp}")
    if parallel.tp > 1 and parallel.expert_parallel:
        raise ValueError(f"{pre}parallel.expert_parallel with parallel.dp={parallel.dp} and parallel.tp="
                         f"{parallel.tp}: the routed experts are split whole across the DP ranks (parallel.ep) "
                         "and each DP rank's are sliced across its TP ranks; set expert_parallel: false")


def check_dp_model(parallel, hf_config: dict, source: str) -> None:
    """Raises ConfigError when ``parallel.dp`` with ``parallel.ep`` cannot split this model's
    experts: a dense model, or an expert count dp does not divide; with ``parallel.tp`` > 1
    (tp x dp) also when tp cannot split its heads, MLP widths or an expert's width."""
    if parallel.dp <= 1:
        return
    from pdkv.config import ConfigError  # noqa: PLC0415
    from pdkv.models.config import parse_arch_config  # noqa: PLC0415
    from pdkv.models.parallel import DataParallelError, ExpertLayout, TensorParallelError, TPLayout  # noqa: PLC0415

    arch = parse_arch_config(hf_config, source)
    try:
        ExpertLayout(0, parallel.dp, arch)
        if parallel.tp > 1:
            TPLayout(0, parallel.tp, arch, parallel.expert_parallel, parallel.dp)
    except (DataParallelError, TensorParallelError) as e:
        raise ConfigError(f"{source}: {e}") from None
