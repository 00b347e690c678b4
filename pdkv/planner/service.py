"""``pdkv planner -c configs/planner.yaml``: observe the fleet every interval, decide, act, report.

HTTP (``server.host:server.port``):

- ``GET /plan``: the last decision as JSON: desired and previous counts per role, the reasons,
  the load it saw, the capacity per node at the SLOs, and (local actuator) the nodes and what the
  actuator did;
- ``GET /metrics``: ``pdkv_planner_desired_nodes{role}`` (what a Kubernetes HorizontalPodAutoscaler
  scales each role's workload from, through a metrics adapter: deploy/kubernetes),
  ``pdkv_planner_observed_nodes{role}``, ``pdkv_planner_decisions_total{role,direction}``,
  ``pdkv_planner_load{kind}``;
- ``GET /health``.

Actuators: ``none`` (report only), ``local`` (pdkv/planner/local.py) and ``kubernetes``, which acts
through the metric alone (the HPAs do the scaling; no controller of ours). Nodes to observe: the
local actuator's, or ``observe:`` (a static URL list, or a DNS name whose A records are the pods
of a headless Service, re-resolved every interval).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from pdkv.planner.config import PlannerConfig
from pdkv.planner.decide import ROLES, Planner
from pdkv.planner.observe import Observer, sample_node

log = logging.getLogger("pdkv.planner")


class PlannerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.desired = Gauge("pdkv_planner_desired_nodes", "Nodes of each role the offered load needs.", ["role"],
                             registry=r)
        self.observed = Gauge("pdkv_planner_observed_nodes", "Nodes of each role that answered this interval.",
                              ["role"], registry=r)
        self.decisions = Counter("pdkv_planner_decisions", "Changes of a role's desired count.",
                                 ["role", "direction"], registry=r)
        self.load = Gauge("pdkv_planner_load", "The load the last decision saw.", ["kind"], registry=r)

    def update(self, plan) -> None:
        for role in ROLES:
            self.desired.labels(role).set(plan.desired[role])
            self.observed.labels(role).set(plan.demand["ready"].get(role, 0))
            d = plan.desired[role] - plan.previous[role]
            if d:
                self.decisions.labels(role, "up" if d > 0 else "down").inc()
        for k in ("prefill_tokens_per_s", "decode_streams"):
            self.load.labels(k).set(plan.demand[k])


def _resolve(spec) -> list[str]:
    if isinstance(spec, list):
        return list(spec)
    try:
        infos = socket.getaddrinfo(spec["dns"], spec["port"], type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({f"http://{i[4][0]}:{spec['port']}" for i in infos})


class PlannerService:
    def __init__(self, cfg: PlannerConfig, actuator=None):
        self.cfg = cfg
        self.planner = Planner(cfg.policy, cfg.caps,
                               initial=actuator.counts() if actuator is not None else None)
        self.observer = Observer(cfg.quantile)
        self.actuator = actuator
        self.metrics = PlannerMetrics()
        self.history: list[dict] = []  # the decisions that changed a count (bounded)
        self._stop = asyncio.Event()

    def targets(self) -> list[tuple[str, str]]:
        if self.actuator is not None:
            return self.actuator.targets()
        return [(role, url) for role, spec in self.cfg.observe.items() for url in _resolve(spec)]

    async def step(self, session) -> None:
        targets = self.targets()
        got = await asyncio.gather(*(sample_node(session, url, role, self.cfg.poll_timeout_s)
                                     for role, url in targets))
        samples = [s for s in got if s is not None]
        obs = self.observer.observe(time.monotonic(), samples, unreachable=len(targets) - len(samples))
        plan = self.planner.decide(obs)
        self.metrics.update(plan)
        if plan.changed:
            log.info("plan: %s -> %s: %s", plan.previous, plan.desired,
                     "; ".join(f"{r}: {' / '.join(v)}" for r, v in plan.reasons.items()))
            self.history = (self.history + [{"at": time.time(), **plan.to_json()}])[-100:]
        if self.actuator is not None:
            await self.actuator.apply(plan.desired)

    async def run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    await self.step(session)
                except Exception:  # noqa: BLE001 - one bad interval must not end the planner
                    log.exception("planner interval failed")
                try:
                    await asyncio.wait_for(self._stop.wait(), max(0.0, self.cfg.policy.interval_s
                                                                    - (time.monotonic() - t0)))
                except asyncio.TimeoutError:
                    pass

    def stop(self) -> None:
        self._stop.set()

    def plan_json(self) -> dict:
        p = self.planner
        body = {"slo": {"ttft_ms": p.policy.ttft_ms, "itl_ms": p.policy.itl_ms, "quantile": self.cfg.quantile},
                "actuator": self.cfg.actuator, "capacities_source": self.cfg.caps.source,
                "last": p.last.to_json() if p.last else None, "changes": self.history}
        if self.actuator is not None:
            body["nodes"] = [{"name": n.name, "role": n.role, "url": n.url, "state": n.state, "pid": n.proc.pid,
                              "cpus": n.cpus, "exit_code": n.exit_code} for n in self.actuator.nodes]
            body["events"] = self.actuator.events[-200:]
            body["api"] = f"http://{self.actuator.api[0]}:{self.actuator.api[1]}" if self.actuator.api else None
        return body

    def app(self):
        from aiohttp import web

        async def plan(_r):
            return web.json_response(self.plan_json())

        async def metrics(_r):
            resp = web.Response(body=generate_latest(self.metrics.registry))
            resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
            return resp

        async def health(_r):
            return web.json_response({"status": "ok", "desired": self.planner.desired})

        app = web.Application()
        app.router.add_get("/plan", plan)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        return app


async def serve_planner(cfg: PlannerConfig, log_level: str | None = None) -> int:
    """Start the actuator (local: the initial fleet), serve HTTP, plan until SIGINT/SIGTERM."""
    import signal

    from aiohttp import web

    actuator = None
    if cfg.actuator == "local":
        from pdkv.planner.local import LocalActuator

        loc = cfg.local
        actuator = LocalActuator(loc["cluster"], cfg.policy.max_nodes, cpus=loc.get("cpus"),
                                 overrides=list(loc.get("set") or []),
                                 start_timeout_s=float(loc.get("start_timeout_s", 120)),
                                 drain_timeout_s=float(loc.get("drain_timeout_s", 60)), log_level=log_level)
        initial = {r: max(cfg.policy.min_nodes[r], int((loc.get("initial") or {}).get(r, 1))) for r in ROLES}
        try:
            await actuator.start(initial)
        except (RuntimeError, OSError) as e:
            print(f"pdkv planner: {e}", flush=True)
            await actuator.close()
            return 1
    svc = PlannerService(cfg, actuator)
    runner = web.AppRunner(svc.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except OSError as e:
        print(f"pdkv planner: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", flush=True)
        if actuator is not None:
            await actuator.close()
        return 1
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, svc.stop)
    api = f"; API at {svc.plan_json().get('api')}" if actuator is not None else ""
    print(f"pdkv planner: /plan and /metrics at http://{cfg.host}:{cfg.port}{api}", flush=True)
    try:
        await svc.run()
    finally:
        await runner.cleanup()
        if actuator is not None:
            await actuator.close()
    return 0
