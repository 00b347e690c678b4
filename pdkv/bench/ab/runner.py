"""One A/B run: build the workload once, then for each architecture launch it, replay every rate
against it, measure, stop it. Everything is checked before anything is launched (the trace, the
window, the fit to the model, the endpoints), so a bad input costs no start-up time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdkv.bench.ab import machine, metrics, scrape, serverside
from pdkv.bench.ab.archs import ArchSpec
from pdkv.bench.ab.client import first_model, reachable, replay
from pdkv.bench.ab.fault import FaultInjector, FaultSpec, judge, target
from pdkv.bench.ab.launch import Deployment, LaunchError
from pdkv.bench.ab.prompts import PromptSynth, request_body
from pdkv.bench.ab.resources import Sampler, weight_bytes
from pdkv.bench.ab.traces import Trace
from pdkv.bench.ab.workload import Scaling, Workload, build_workload

SERVED_NAME = "pdkv-ab"  # every pdkv architecture serves the model under this name: identical bodies


class EndpointError(RuntimeError):
    """An --endpoint that does not answer."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str


@dataclass
class Options:
    trace: Trace
    scaling: Scaling
    rates: list[float | None]
    slo: metrics.SLO
    archs: list[ArchSpec | Endpoint]
    model_dir: str
    budget: list[int]
    out_dir: Path
    sets: list[str] = field(default_factory=list)
    fault: FaultSpec | None = None
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    argv: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Prepared:
    rate: float | None
    workload: Workload
    jobs: list  # [(id, offset_s, body, max_tokens)]


def model_info(model_dir: str) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {"path": model_dir, "vocab_size": int(cfg["vocab_size"]),
            "max_position_embeddings": int(cfg.get("max_position_embeddings") or 2048),
            "num_layers": cfg.get("num_hidden_layers"), "hidden_size": cfg.get("hidden_size"),
            "weight_bytes": weight_bytes(model_dir)}


def prepare(opts: Options, served_name: str = SERVED_NAME) -> list[Prepared]:
    info = model_info(opts.model_dir)
    out = []
    for rate in opts.rates:
        s = opts.scaling if rate is None else dataclasses.replace(opts.scaling, rate=rate)
        wl = build_workload(opts.trace, s)
        # ids from 3 up: pdkv's tiny tokenizers keep their special tokens at 0..2; a real model's
        # specials sit at the top of the vocabulary and are as harmless in a prompt as any id
        synth = PromptSynth(3, info["vocab_size"], wl.block_tokens, opts.seed)
        jobs = [(it.id, it.offset_s, request_body(served_name, synth.prompt(it.prompt_len, it.hash_ids, it.row),
                                                  it.max_tokens), it.max_tokens) for it in wl.items]
        out.append(Prepared(rate, wl, jobs))
    return out


def check_archs(opts: Options) -> None:
    """Every node's role config must load (with --set) before anything starts."""
    import tempfile

    import yaml

    from pdkv.bench.ab.archs import node_specs
    from pdkv.config import ConfigError, load_config

    with tempfile.TemporaryDirectory(prefix="pdkv-ab-") as tmp:
        for a in opts.archs:
            if isinstance(a, Endpoint):
                continue
            for n in node_specs(a, opts.budget):
                d = {**n.config, "model": {**n.config.get("model", {}), "path": opts.model_dir}}
                if n.role == "decode":
                    d["messenger"] = {**d.get("messenger", {}), "prefill_peers": ["127.0.0.1:1"]}
                f = Path(tmp) / f"{n.name}.yaml"
                f.write_text(yaml.safe_dump(d))
                try:
                    load_config(f, opts.sets)
                except ConfigError as e:
                    raise ConfigError(str(e).replace(str(f), f"{a.file} ({n.role} node)")) from None


def check_endpoints(opts: Options) -> None:
    for a in opts.archs:
        if isinstance(a, Endpoint):
            why = reachable(a.url)
            if why:
                raise EndpointError(f"--endpoint {a.name}={a.url} is not reachable ({why}); start the server "
                                    f"first or fix the URL (it must serve the OpenAI API: /v1/models, /v1/completions)")


def _progress(opts: Options, desc: str, total: int):
    if not opts.progress:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="req", leave=True)
    return bar, lambda: bar.update(1)


def _request_rows(p: Prepared, results) -> list[dict]:
    items = {it.id: it for it in p.workload.items}
    rows = []
    for r in results:
        it = items[r.id]
        rows.append({"id": r.id, "row": it.row, "class": it.prompt_class, "prompt_tokens": it.prompt_len,
                     "max_tokens": it.max_tokens, "clipped": it.clipped, "body_sha256": r.body_sha256,
                     "url": r.url, "scheduled_s": r.scheduled_s, "sent_s": r.sent_s, "status": r.status,
                     "error": r.error, "http_status": r.http_status, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                     "num_tokens": r.num_tokens, "usage_tokens": r.usage_tokens,
                     "chunk_s": [round(t, 6) for t in r.chunk_s], "chunk_tokens": r.chunk_tokens})
    return rows


def _replay_once(opts: Options, name: str, p: Prepared, urls: list[str], dep: Deployment | None) -> dict:
    classes = {it.id: it.prompt_class for it in p.workload.items}
    lens = {it.id: it.prompt_len for it in p.workload.items}
    run: dict = {"arch": name, "rate": p.rate, "loadavg_before": os.getloadavg(),
                 "started_at": time.strftime("%H:%M:%SZ", time.gmtime()),
                 "offered_rate_rps": (len(p.jobs) - 1) / p.workload.duration_s if p.workload.duration_s else None}
    if dep is not None:
        run["pools_before"] = dep.wait_pools_full(30.0)
        before = {n.name: scrape.scrape(n.url) for n in dep.nodes}
        sampler = Sampler(dep.pids, names=dep.pid_names).start()
    label = f"{name}" + (f" @ {p.rate:g} req/s" if p.rate else "")
    bar, tick = _progress(opts, label, len(p.jobs))
    inj = None
    t0 = time.perf_counter() + 0.2  # the replay's clock; the fault is timed on the same one
    node = target(dep, opts.fault) if (dep is not None and opts.fault) else None
    if node is not None:
        inj = FaultInjector(dep, node, opts.fault, t0)
        inj.start()
    results, t0, client_cpu = replay(urls, p.jobs, opts.timeout_s, tick, t0)
    if bar is not None:
        bar.close()
    if inj is not None:
        inj.join(opts.timeout_s)
    run["loadavg_after"] = os.getloadavg()  # the machine is shared: how busy it was is part of the result
    run["summary"] = metrics.summarize(results, lens, classes, opts.slo)
    run["client_overhead"] = metrics.client_overhead(results, client_cpu)
    if dep is not None:
        run["resources"] = sampler.stop()
        run["pools_after"] = dep.wait_pools_full(30.0)
        run["pools_back_to_start"] = all(v["free"] is not None and v["free"] == v["total"]
                                         for v in run["pools_after"].values())
        after = {n.name: scrape.scrape(n.url) for n in dep.nodes}
        api, pre = {}, {}
        for n in dep.nodes:
            d = scrape.delta(before[n.name], after[n.name])
            if n.role == "prefill":
                pre = scrape.add(pre, d)
            else:
                api = scrape.add(api, d)
        run["server"] = serverside.numbers(api, pre)
        run["agreement"] = None if inj is not None else serverside.agreement(results, run["server"])
    run["fault"] = judge(inj, results, run.get("pools_after", {})) if inj is not None else None
    if opts.fault and inj is None:
        run["fault"] = {"role": opts.fault.role, "skipped": f"{name} has no {opts.fault.role} node"}
    run["requests"] = _request_rows(p, results)
    return run


def run_ab(opts: Options) -> dict:
    """Run every architecture at every rate; returns the report dict (see schema.py)."""
    check_endpoints(opts)  # trace / fit / endpoint errors before anything starts
    # one model name in every body: an endpoint's own name if there is one (pdkv nodes then serve
    # under it too), so every architecture, external or not, gets byte-identical requests
    endpoints = [a for a in opts.archs if isinstance(a, Endpoint)]
    served = first_model(endpoints[0].url) if endpoints else SERVED_NAME
    prepared = prepare(opts, served)
    info = model_info(opts.model_dir)
    report = {"schema": "pdkv.bench.ab/1", "argv": opts.argv, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime()),
              "machine": machine.describe(opts.budget), "model": {**info, "served_name": served},
              "slo": opts.slo.__dict__,
              "trace": _trace_section(opts, prepared), "archs": [], "runs": []}
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    for a in opts.archs:
        if isinstance(a, Endpoint):
            report["archs"].append({"name": a.name, "kind": "endpoint", "url": a.url, "nodes": [],
                                    "served_model": first_model(a.url)})
            for p in prepared:
                report["runs"].append(_replay_once(opts, a.name, p, [a.url], None))
            continue
        dep = Deployment(a, opts.budget, opts.out_dir / "logs" / a.name, opts.model_dir, served, opts.sets)
        report["archs"].append(_arch_section(a, dep, info))
        t = time.monotonic()
        try:
            dep.start()
        except LaunchError as e:  # one architecture that does not start must not cost the others' runs
            report["archs"][-1]["launch_error"] = str(e)
            continue
        report["archs"][-1]["startup_s"] = time.monotonic() - t
        for row, n in zip(report["archs"][-1]["nodes"], dep.nodes):  # what the pinning really did
            row["cpus_actual"] = sorted(os.sched_getaffinity(n.proc.pid))
        try:
            for p in prepared:
                report["runs"].append(_replay_once(opts, a.name, p, dep.api_urls, dep))
        finally:
            dep.stop()
    if not report["runs"]:
        raise LaunchError("; ".join(a["launch_error"] for a in report["archs"] if "launch_error" in a))
    report["identical_requests"] = _identical(report["runs"])
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["machine"]["loadavg_end"] = os.getloadavg()
    return report


def _identical(runs: list[dict]) -> dict:
    """Per rate: did every architecture get the same bodies at the same scheduled offsets?"""
    out = {}
    for r in runs:
        seq = [(q["body_sha256"], q["scheduled_s"]) for q in r["requests"]]
        out.setdefault(str(r["rate"]), []).append(seq)
    return {rate: all(s == seqs[0] for s in seqs) for rate, seqs in out.items()}


def _arch_section(a: ArchSpec, dep: Deployment, info: dict) -> dict:
    nodes = [{"name": n.name, "role": n.role, "cpus": n.spec.cpus, "url": n.url, "config": n.spec.config}
             for n in dep.nodes]
    from pdkv.cpus import parse_cpu_list

    used = sorted({c for n in dep.nodes for c in parse_cpu_list(n.spec.cpus)})
    return {"name": a.name, "kind": a.kind, "file": a.file, "num_prefill": a.num_prefill, "cpus_used": used,
            "num_decode": a.num_decode, "nodes": nodes, "weight_bytes_per_node": info["weight_bytes"],
            "duplicated_weight_bytes": (len(dep.nodes) - 1) * info["weight_bytes"]}


def _trace_section(opts: Options, prepared: list[Prepared]) -> dict:
    t, s = opts.trace, opts.scaling
    wl = prepared[0].workload
    return {"name": t.name, "source": t.source, "format": t.format, "num_requests": len(t.requests),
            "rows": [t.requests[0].index, t.requests[-1].index], "span_s": t.span_s,
            "length_scale": s.length_scale, "output_scale": s.output_scale, "max_model_len": s.max_model_len,
            "clip": s.clip, "num_clipped": wl.num_clipped, "spread_ties": s.spread_ties,
            "num_ties_spread": wl.num_ties_spread, "long_prompt_tokens": s.long_prompt,
            "time_scale": {str(p.rate): p.workload.time_scale for p in prepared},
            "prompt_tokens": metrics.dist([it.prompt_len for it in wl.items]),
            "output_tokens": metrics.dist([it.max_tokens for it in wl.items]),
            "num_long": sum(it.prompt_class == "long" for it in wl.items)}
