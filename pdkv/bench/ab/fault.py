"""``--fault ROLE@SECONDS[+DOWN]``: kill one node during a replay, restart it, judge the recovery.

    prefill@5      SIGKILL prefill node 0 five seconds into the replay, restart it at once
    decode@5+2     kill decode node 0 (a colocated node counts as the decode node), restart 2 s later

Recovery is judged from outside, as a client and an operator would: which requests failed (each
must carry an error message), how long until every node was ready again (/health, decode nodes
reconnected to their prefill peers), how long until a request sent after the kill completed, and
whether every page pool returned to its start.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pdkv.bench.ab.client import RequestResult
from pdkv.bench.ab.launch import Deployment, LaunchError, NodeProc

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class FaultSpec:
    role: str
    at_s: float
    down_s: float = 0.0

    @staticmethod
    def parse(text: str) -> "FaultSpec":
        role, _, rest = text.partition("@")
        at, _, down = rest.partition("+")
        try:
            spec = FaultSpec(role.strip(), float(at), float(down) if down else 0.0)
        except ValueError:
            spec = None
        if spec is None or spec.role not in ROLES or spec.at_s < 0 or spec.down_s < 0:
            raise ValueError(f"--fault must be ROLE@SECONDS[+DOWN] with ROLE prefill or decode (e.g. prefill@5 "
                             f"or decode@5+2), got {text!r}")
        return spec


def target(dep: Deployment, spec: FaultSpec) -> NodeProc | None:
    """The node to kill, None when the architecture has no node of that role."""
    nodes = dep.by_role(spec.role) or (dep.by_role("colocated") if spec.role == "decode" else [])
    return nodes[0] if nodes else None


class FaultInjector(threading.Thread):
    def __init__(self, dep: Deployment, node: NodeProc, spec: FaultSpec, t0: float, ready_timeout: float = 300.0):
        super().__init__(name="ab-fault", daemon=True)
        self.dep, self.node, self.spec, self.t0, self.timeout = dep, node, spec, t0, ready_timeout
        self.kill_s: float | None = None
        self.restart_s: float | None = None
        self.ready_s: float | None = None
        self.error: str | None = None

    def run(self) -> None:
        time.sleep(max(0.0, self.t0 + self.spec.at_s - time.perf_counter()))
        self.node.kill()
        self.kill_s = time.perf_counter() - self.t0
        time.sleep(self.spec.down_s)
        self.restart_s = time.perf_counter() - self.t0
        try:
            self.node.start()
            self.node.wait_ready(self.timeout)
            for n in self.dep.api_nodes:  # decode nodes redial a restarted prefill node
                n.wait_ready(self.timeout)
            self.ready_s = time.perf_counter() - self.t0
        except LaunchError as e:
            self.error = str(e)


def judge(inj: FaultInjector, results: list[RequestResult], pools_after: dict) -> dict:
    """What the fault did: failed requests (all with errors, all in the outage), recovery times."""
    k, ready = inj.kill_s, inj.ready_s
    failed = [r for r in results if r.status != "ok"]
    after_kill_ok = [r.sent_s + r.e2e_s for r in results if r.status == "ok" and k is not None and r.sent_s >= k]

    def affected(r: RequestResult) -> bool:  # in flight at the kill, or sent before the node was back
        if k is None:
            return False
        end = r.sent_s + (r.e2e_s or 0.0) if r.status == "ok" else float("inf")
        return r.sent_s <= (ready if ready is not None else float("inf")) and end >= k

    return {
        "role": inj.spec.role, "node": inj.node.name, "at_s": inj.spec.at_s, "down_s": inj.spec.down_s,
        "kill_s": k, "restart_s": inj.restart_s, "ready_s": ready,
        "time_to_ready_s": None if ready is None or k is None else ready - k,
        "time_to_first_success_s": None if not after_kill_ok else min(after_kill_ok) - k,
        "restart_error": inj.error,
        "num_failed": len(failed),
        "failed_all_have_errors": all(bool(r.error) for r in failed),
        "failed_all_in_outage": all(affected(r) for r in failed),
        "failed": [{"id": r.id, "sent_s": r.sent_s, "error": r.error} for r in failed],
        "pools_back_to_start": all(p["free"] is not None and p["free"] == p["total"] for p in pools_after.values()),
    }
