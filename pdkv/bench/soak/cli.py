"""Arguments and outputs of ``python -m pdkv.bench soak``.

    python -m pdkv.bench soak --minutes 30 --out soak-out

Writes OUT/report.json (every sample and outcome), OUT/report.md (the numbers a reader wants)
and OUT/soak.png (or soak.svg without matplotlib); node logs in OUT/logs. Exit status 0 when the
verdict passes (flat after warm-up, every failure excused by a restart, pools back to their
start), 1 when it does not or a node did not start, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pdkv.bench.soak.load import LoadSpec

_HARNESS_FIELDS = ("model.path", "model.served_name", "server.host", "server.port", "messenger.control_host",
                   "messenger.control_port", "messenger.prefill_peers")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdkv.bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    p.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (Poisson, open loop)")
    p.add_argument("--long-p", type=float, default=0.2, help="share of long prompts (200-600 tokens)")
    p.add_argument("--stream-p", type=float, default=0.5, help="share of streamed requests")
    p.add_argument("--abort-p", type=float, default=0.15, help="share of requests the client drops on purpose")
    p.add_argument("--restart-every", type=float, default=300.0,
                   help="SIGKILL and restart the prefill node every this many seconds (0: never)")
    p.add_argument("--sample-s", type=float, default=5.0, help="sampling period of /proc and /health")
    p.add_argument("--slack-s", type=float, default=1.0,
                   help="a failure up to this long after a restart's recovery still counts as hit by it")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    p.add_argument("--model", help="Hugging Face model folder (default: the embedded default model)")
    p.add_argument("--transport", choices=("tcp", "verbs"), default="tcp")
    p.add_argument("--cpus", help="CPUs for the pair (default: every allowed CPU; prefill gets the first half)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a role-config field on both nodes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak-out")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def options(args: argparse.Namespace, argv: list[str]):
    from pdkv.bench.soak.run import SoakOptions
    from pdkv.cpus import parse_cpu_list

    if args.minutes <= 0 or args.rate <= 0 or args.sample_s <= 0 or args.timeout <= 0:
        raise ValueError("--minutes, --rate, --sample-s and --timeout must be positive")
    if args.restart_every < 0:
        raise ValueError(f"--restart-every must be >= 0 (0: never), got {args.restart_every:g}")
    for name in ("long_p", "stream_p", "abort_p"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name):g}")
    for o in args.sets:
        if o.partition("=")[0].strip() in _HARNESS_FIELDS:
            raise ValueError(f"--set {o}: this field is set by the harness (ports, peers, the model)")
    if args.model:
        model_dir = args.model
    else:
        from pdkv.default_model import ensure_default_model

        model_dir = ensure_default_model()
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"--model {model_dir}: not a Hugging Face model folder (no config.json)")
    cfg = json.loads(cfg_path.read_text())
    max_len = int(cfg.get("max_position_embeddings") or 2048)
    load = LoadSpec(rate=args.rate, long_p=args.long_p, stream_p=args.stream_p, abort_p=args.abort_p,
                    timeout_s=args.timeout, vocab=(3, int(cfg["vocab_size"])),
                    long_tokens=(min(200, max_len // 4), min(600, max_len - 64)))
    budget = sorted(parse_cpu_list(args.cpus)) if args.cpus else sorted(os.sched_getaffinity(0))
    if not set(budget) <= os.sched_getaffinity(0):
        raise ValueError(f"--cpus {args.cpus}: this process may only use CPUs {sorted(os.sched_getaffinity(0))}")
    return SoakOptions(minutes=args.minutes, model_dir=model_dir, out_dir=Path(args.out), budget=budget, load=load,
                       restart_every_s=args.restart_every, sample_s=args.sample_s, slack_s=args.slack_s,
                       transport=args.transport, sets=list(args.sets), seed=args.seed,
                       progress=not args.no_progress, argv=list(argv))


def markdown(rep: dict) -> str:
    v, f = rep["verdict"], rep["failures"]
    lines = [f"# pdkv soak: {rep['minutes']:g} minutes", "", f"`{rep['command']}`", "",
             f"**verdict: {'PASS' if v['pass'] else 'FAIL'}** — flat after warm-up: {v['flat']}; "
             f"failures all excused by a restart: {v['failures_ok']}; pools back to their start: {v['pools_ok']}; "
             f"restarts ok: {v['restarts_ok']}", "",
             f"requests: {f['num_requests']} ({f['num_ok']} ok, {f['num_aborted']} aborted by the client on "
             f"purpose, {f['num_failed']} failed: {f['num_failed_hit_by_restart']} hit by a restart, "
             f"{f['num_failed_unexcused']} not)", "",
             "restarts of the prefill node (SIGKILL, start, decode node reconnected):", ""]
    for r in rep["restarts"]:
        lines.append(f"- killed at {r['kill_s']:.1f} s, back at {r.get('ready_s') or float('nan'):.1f} s "
                     f"({r.get('down_s') or float('nan'):.1f} s down){' — ' + r['error'] if 'error' in r else ''}")
    lines += ["", "| node | window | metric | median | growth | bound | per hour | flat |", "|---|---|---|---|---|---|---|---|"]
    for name, n in v["flatness"]["nodes"].items():
        for w in n["windows"]:
            for m in ("rss_bytes", "fds", "threads"):
                j = w[m]
                if not j["judged"]:
                    lines.append(f"| {name} | start {w.get('start')} | {m} | ({j['samples']} samples: not judged) | | | | |")
                    continue
                sc, unit = (1 / (1 << 20), " MiB") if m == "rss_bytes" else (1, "")
                lines.append(f"| {name} | {j['from_s']:.0f}-{j['to_s']:.0f} s | {m} | {j['median'] * sc:.1f}{unit} | "
                             f"{j['growth'] * sc:+.2f}{unit} | {j['bound'] * sc:.1f}{unit} | "
                             f"{j['per_hour'] * sc:+.1f}{unit} | {j['flat']} |")
    lines += ["", f"rule: {v['flatness']['rule']}", "", "failed requests:", ""]
    for x in f["failed"][:50]:
        lines.append(f"- {x['id']} sent {x['sent_s']:.1f} s, {'hit by a restart' if x['hit_by_restart'] else 'NOT hit by a restart'}: {x['error']}")
    lines += ["", f"pools after the drain: {json.dumps(rep['pools_after'])}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    from pdkv.bench.ab.launch import LaunchError
    from pdkv.bench.soak.plot import plot
    from pdkv.bench.soak.run import run_soak
    from pdkv.config import ConfigError

    try:
        opts = options(args, argv)
    except (ValueError, ConfigError, FileNotFoundError) as e:
        print(f"pdkv bench soak: error: {e}", file=sys.stderr)
        return 2
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        rep = run_soak(opts)
    except LaunchError as e:
        print(f"pdkv bench soak: the pair did not start: {e}", file=sys.stderr)
        return 1
    if not args.no_plot:
        rep["plot"] = plot(rep, opts.out_dir).name
    (opts.out_dir / "report.json").write_text(json.dumps(rep, indent=1))
    md = markdown(rep)
    (opts.out_dir / "report.md").write_text(md)
    print(md)
    return 0 if rep["verdict"]["pass"] else 1
