"""``python -m pdkv.bench ab``: replay one trace, open-loop, against colocated, chunked and
disaggregated serving (each launched here on the same CPUs), and say which one to run.

    python -m pdkv.bench ab --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --window 600:700 --first 40 --length-scale 0.02 --output-scale 0.25 --rates 1,2 --out out/ab

Input errors (trace, window, fit, endpoint, config) exit 2 with one line naming what was wrong and
how to fix it; an architecture that does not start exits 1 and names the node and its log.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pdkv.bench.ab import archs as A
from pdkv.bench.ab.metrics import SLO


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdkv.bench ab", description=__doc__.splitlines()[0])
    g = p.add_argument_group("trace")
    g.add_argument("--trace", help="a Mooncake .jsonl, an Azure 2023 .csv, or synth:short|long|mixed")
    g.add_argument("--format", choices=("mooncake", "azure"), help="trace format (default: detected)")
    g.add_argument("--window", help="START:END in trace seconds: only requests arriving in [START, END)")
    g.add_argument("--first", type=int, help="only the first N requests (after --window)")
    g.add_argument("--synth-requests", type=int, default=60, help="synthetic trace: number of requests")
    g.add_argument("--synth-rate", type=float, default=2.0, help="synthetic trace: Poisson rate (req/s)")
    g = p.add_argument_group("scaling")
    g.add_argument("--rate", type=float, help="rescale arrivals to this mean rate (req/s)")
    g.add_argument("--rates", help="comma-separated rates to sweep (req/s), e.g. 1,2,4")
    g.add_argument("--time-scale", type=float, help="multiply arrival offsets by this (0.5: twice as fast)")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt lengths (and hash blocks)")
    g.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths (max_tokens)")
    g.add_argument("--max-model-len", type=int, help="context to fit (default: the model's)")
    g.add_argument("--clip", action="store_true", help="cut prompts that do not fit the context (reported)")
    g.add_argument("--no-spread-ties", action="store_true",
                   help="send requests with the same timestamp at once (default: spread to the next arrival)")
    g.add_argument("--long-prompt", type=int, default=256, help="prompts with at least this many tokens are 'long'")
    g = p.add_argument_group("architectures")
    g.add_argument("--model", help="Hugging Face model folder (default: the embedded default model)")
    g.add_argument("--archs", default=",".join(A.BUILTIN),
                   help=f"built-in architectures from configs/ab/ (default {','.join(A.BUILTIN)}; '' for none)")
    g.add_argument("--arch", action="append", default=[], metavar="NAME=FILE", help="another architecture file")
    g.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                   help="an already running OpenAI-compatible server (client-side metrics only)")
    g.add_argument("--pd", help="P:D node counts for disaggregated architectures (default: the file's)")
    g.add_argument("--transport", choices=("tcp", "verbs", "shm"), help="KV transport of disaggregated architectures")
    g.add_argument("--cpus", help="the hardware budget every architecture gets (default: every allowed CPU)")
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a role-config field on every node, e.g. kv_cache.memory_gib=0.5")
    g = p.add_argument_group("measurement")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=100.0)
    g.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    g.add_argument("--fault", help="ROLE@SECONDS[+DOWN]: kill prefill (or decode) node 0 then restart it")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="ab-out", help="output folder (report.json, report.md, PNGs, node logs)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--render", metavar="DIR", help="no replay: recompute the verdict of DIR/report.json and "
                                                   "rewrite its report.md and plots")
    return p


def render(out: Path, attainment: float, plots: bool) -> int:
    import json

    from pdkv.bench.ab import report as R

    try:
        rep = json.loads((out / "report.json").read_text())
    except (OSError, ValueError) as e:
        print(f"pdkv bench ab: error: --render {out}: cannot read report.json: {e}", file=sys.stderr)
        return 2
    R.add_verdict(rep, attainment)
    R.write(rep, out, plots=plots)
    print((out / "report.md").read_text())
    return 0


# fields the harness fills in itself (ports, peers, the model): a --set of them would break the launch
_HARNESS_FIELDS = ("model.path", "model.served_name", "server.host", "server.port", "messenger.control_host",
                   "messenger.control_port", "messenger.prefill_peers")


def _pairs(items: list[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for it in items:
        name, eq, val = it.partition("=")
        if not eq or not name.strip() or not val.strip():
            raise ValueError(f"{flag} must be NAME=VALUE, got {it!r}")
        out.append((name.strip(), val.strip()))
    return out


def options(args: argparse.Namespace, argv: list[str]):
    from pdkv.bench.ab import runner, traces
    from pdkv.bench.ab.fault import FaultSpec
    from pdkv.bench.ab.synth import synth_trace
    from pdkv.bench.ab.workload import Scaling
    from pdkv.cpus import parse_cpu_list

    if args.trace.startswith("synth:"):
        trace = synth_trace(args.trace[6:], args.synth_requests, args.synth_rate, args.seed)
    else:
        trace = traces.read_trace(args.trace, args.format)
    trace = traces.select(trace, traces.parse_window(args.window) if args.window else None, args.first)
    if args.model:
        model_dir = args.model
    else:
        from pdkv.default_model import ensure_default_model

        model_dir = ensure_default_model()
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: not a Hugging Face model folder (no config.json)")
    info = runner.model_info(model_dir)
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
    if any(r is not None and r <= 0 for r in rates):
        raise ValueError(f"--rates must be positive numbers, got {args.rates}")
    scaling = Scaling(time_scale=args.time_scale, rate=None, length_scale=args.length_scale,
                      output_scale=args.output_scale, max_model_len=args.max_model_len or info["max_position_embeddings"],
                      clip=args.clip, spread_ties=not args.no_spread_ties, long_prompt=args.long_prompt)
    if args.length_scale <= 0 or args.output_scale <= 0:
        raise ValueError("--length-scale and --output-scale must be positive")
    budget = list(parse_cpu_list(args.cpus)) if args.cpus else sorted(os.sched_getaffinity(0))
    if not set(budget) <= os.sched_getaffinity(0):
        raise ValueError(f"--cpus {args.cpus}: this process may only use CPUs {sorted(os.sched_getaffinity(0))}")
    chosen: list = [A.with_pd(A.builtin(n.strip()), args.pd, args.transport)
                    for n in args.archs.split(",") if n.strip()]
    for name, f in _pairs(args.arch, "--arch"):
        chosen.append(A.with_pd(A.load_arch(name, f), args.pd, args.transport))
    for name, url in _pairs(args.endpoint, "--endpoint"):
        chosen.append(runner.Endpoint(name, url.rstrip("/")))
    if not chosen:
        raise ValueError("nothing to compare: give --archs, --arch NAME=FILE or --endpoint NAME=URL")
    for o in args.sets:
        key = o.partition("=")[0].strip()
        if key in _HARNESS_FIELDS:
            raise ValueError(f"--set {o}: {key} is set by the harness for every node "
                             f"({'use --model' if key == 'model.path' else 'it picks free loopback ports'})")
    names = [getattr(a, "name") for a in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"architecture names must be unique, got {names}")
    return runner.Options(trace=trace, scaling=scaling, rates=rates,
                          slo=SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3), archs=chosen,
                          model_dir=model_dir, budget=budget, out_dir=Path(args.out), sets=list(args.sets),
                          fault=FaultSpec.parse(args.fault) if args.fault else None, seed=args.seed,
                          timeout_s=args.timeout, progress=not args.no_progress, argv=list(argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.render:
        return render(Path(args.render), args.attainment, not args.no_plots)
    if not args.trace:
        parser().error("--trace is required (or --render DIR)")
    from pdkv.bench.ab import report as R
    from pdkv.bench.ab import runner
    from pdkv.bench.ab.launch import LaunchError
    from pdkv.config import ConfigError

    try:
        opts = options(args, argv)
        runner.check_archs(opts)
        rep = runner.run_ab(opts)
    except (ValueError, ConfigError, runner.EndpointError) as e:  # TraceError is a ValueError
        print(f"pdkv bench ab: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"pdkv bench ab: an architecture did not start: {e}", file=sys.stderr)
        return 1
    R.add_verdict(rep, args.attainment)
    files = R.write(rep, opts.out_dir, plots=not args.no_plots)
    print((opts.out_dir / "report.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))
    failed = [a for a in rep["archs"] if "launch_error" in a]
    for a in failed:
        print(f"pdkv bench ab: {a['name']} did not start: {a['launch_error']}", file=sys.stderr)
    return 1 if failed else 0
