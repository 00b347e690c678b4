"""Writing a run: report.json (every number, the configs, the trace slice, the machine), report.md
(the tables and the verdict) and the PNG plots (plots.py)."""

from __future__ import annotations

import json
from pathlib import Path

from pdkv.bench.ab import verdict


def add_verdict(report: dict, attainment: float) -> None:
    per_rate = []
    for rate in dict.fromkeys(r["rate"] for r in report["runs"]):
        runs = {r["arch"]: r for r in report["runs"] if r["rate"] == rate}
        label = (f"At {rate:g} req/s" if rate else "As replayed") + f" on {report['trace']['name']}: "
        per_rate.append({"rate": rate, **verdict.decide(runs, report["slo"], attainment, label)})
    report["verdict"] = {"overall": verdict.overall(per_rate), "per_rate": per_rate, "rule": verdict.__doc__.strip()}


def _ms(x) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def _table(rows: list[list[str]], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _memory_table(runs: list[dict]) -> list[str]:
    """Who held what at each run's peak (resources.peak_memory): every process's PSS without the
    /dev/shm files (its private part beside it), the files counted once, and the total against
    colocated's in the same run (the cost of splitting the roles on one host)."""
    mem = {r["arch"]: (r.get("resources") or {}).get("peak_memory") or {} for r in runs}
    base = (mem.get("colocated") or {}).get("held_bytes")
    rows = []
    for arch, pm in mem.items():
        if not pm:
            continue
        procs = ", ".join(f"{p['name']} {p['pss_bytes'] / 2**20:.0f} ({p['private_bytes'] / 2**20:.0f})"
                          for p in pm["procs"])
        ratio = f"{pm['held_bytes'] / base:.2f}x" if base else "–"
        rows.append([arch, procs, f"{pm['shm_bytes'] / 2**20:.0f}", f"{pm['held_bytes'] / 2**20:.0f}", ratio])
    if not rows:
        return []
    return ["", "memory at the peak (MiB): each process's PSS without /dev/shm files (its private bytes), "
                "the /dev/shm files counted once, their sum, and that sum against colocated's", "",
            _table(rows, ["arch", "process PSS (private)", "/dev/shm", "held", "vs colocated"])]


def markdown(report: dict) -> str:
    t, m, slo = report["trace"], report["machine"], report["slo"]
    lines = [f"# A/B replay: {t['name']}", "",
             f"- command: `python -m pdkv.bench ab {' '.join(report['argv'])}`",
             f"- trace: {t['source']} ({t['format']}), rows {t['rows'][0]}–{t['rows'][1]}, {t['num_requests']} "
             f"requests; length scale {t['length_scale']:g}, output scale {t['output_scale']:g}, context "
             f"{t['max_model_len']}, clipped {t['num_clipped']}, ties spread {t['num_ties_spread']}, "
             f"{t['num_long']} long prompts (>= {t['long_prompt_tokens']} tokens)",
             f"- machine: {m['cpu_model']}, {m['num_cpus']} CPUs, budget CPUs {m['budget_cpus']}, load "
             f"{m['loadavg_start'][0]:.2f} at start / {m.get('loadavg_end', [0])[0]:.2f} at end",
             f"- SLO: TTFT <= {slo['ttft_s'] * 1e3:g} ms, TPOT <= {slo['tpot_s'] * 1e3:g} ms", "",
             "| architecture | nodes (role: CPUs) | duplicated weights |", "|---|---|---:|"]
    for a in report["archs"]:
        nodes = ", ".join(f"{n['role']}: {n['cpus']}" for n in a["nodes"]) or a.get("url", "")
        if "launch_error" in a:
            nodes += f" (did not start: {a['launch_error'][:200]})"
        lines.append(f"| {a['name']} | {nodes} | {a.get('duplicated_weight_bytes', 0) / 2**20:.1f} MiB |")
    for rate in dict.fromkeys(r["rate"] for r in report["runs"]):
        runs = [r for r in report["runs"] if r["rate"] == rate]
        lines += ["", f"## {'rate ' + format(rate, 'g') + ' req/s' if rate else 'as replayed'} "
                      f"(offered {runs[0]['offered_rate_rps'] or 0:.2f} req/s)", "",
                  "load average (1 min) before / after each replay: " + ", ".join(
                      f"{r['arch']} {r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f} ({r['started_at']})"
                      for r in runs), ""]
        rows = []
        for r in runs:
            for cls in ("all", "short", "long"):
                s = r["summary"][cls]
                if s is None:
                    continue
                rows.append([r["arch"], cls, f"{s['num_ok']}/{s['num_requests']}",
                             f"{s['prompt_tokens_per_s']:.0f}", f"{s['output_tokens_per_s']:.1f}",
                             "/".join(_ms(s["ttft_s"][q]) for q in ("p50", "p90", "p99")),
                             "/".join(_ms(s["tpot_s"][q]) for q in ("p50", "p90", "p99")),
                             "/".join(_ms(s["itl_s"][q]) for q in ("p50", "p90", "p99")),
                             f"{s['goodput_rps']:.2f} ({s['goodput_fraction']:.0%})"])
        lines.append(_table(rows, ["arch", "class", "ok", "prompt tok/s", "output tok/s", "TTFT p50/p90/p99 ms",
                                   "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "goodput req/s"]))
        rows = []
        for r in runs:
            sv, res, co = r.get("server") or {}, r.get("resources") or {}, r["client_overhead"]
            qw = sv.get("queue_wait") or {}
            pq = sv.get("prefill_queue_wait") or {}
            tt = sv.get("kv_transfer_time") or {}
            en = res.get("energy", {})
            inter = r["summary"]["all"].get("interference") or {}
            rows.append([r["arch"], f"{inter['ratio_mean']:.1f}x" if inter.get("ratio_mean") else "–",
                         _ms(qw.get("mean_s")), _ms(pq.get("mean_s")),
                         f"{(sv.get('kv_bytes_received') or 0) / 2**20:.1f}", _ms(tt.get("mean_s")),
                         f"{res.get('peak_rss_bytes', 0) / 2**20:.0f}",
                         f"{en['joules']:.1f} J" if en.get("joules") is not None else
                         (f"{res['cpu_seconds']:.1f} CPU-s*" if res else "–"),
                         f"{co['cpu_per_request_ms']:.2f} / {co['cpu_per_token_us']:.0f}",
                         _ms(co["send_lag_s"]["p99"]),
                         str(r.get("pools_back_to_start", "–")), _agree(r.get("agreement"))])
        lines += ["", _table(rows, ["arch", "ITL during prefills / quiet", "queue wait mean ms", "prefill queue mean ms", "KV MiB moved",
                                    "KV transfer mean ms", "peak RSS MiB", "energy", "client CPU ms/req / us/token",
                                    "send lag p99 ms", "pools back", "client~server"])]
        lines += _memory_table(runs)
        if any(r.get("resources", {}).get("energy", {}).get("joules") is None and r.get("resources") for r in runs):
            lines.append("\n\\* CPU-seconds of the architecture's processes: a proxy for energy (no readable RAPL).")
        for r in runs:
            f = r.get("fault")
            if f and "skipped" not in f:
                lines += ["", f"**fault on {r['arch']}**: killed {f['node']} at {f['kill_s']:.2f} s, ready again "
                              f"after {_s(f['time_to_ready_s'])}, first success after {_s(f['time_to_first_success_s'])}; "
                              f"{f['num_failed']} requests failed (all with errors: {f['failed_all_have_errors']}, all in "
                              f"the outage: {f['failed_all_in_outage']}); pools back to start: {f['pools_back_to_start']}"]
                lines += [f"  - {x['id']} at {x['sent_s']:.2f} s: {x['error']}" for x in f["failed"][:10]]
    rates = list(dict.fromkeys(r["rate"] for r in report["runs"]))
    if len(rates) > 1:
        rows = [[r["arch"], f"{r['offered_rate_rps'] or 0:.2f}", f"{r['summary']['all']['goodput_rps']:.2f}",
                 f"{r['summary']['all']['goodput_fraction']:.0%}", _ms(r["summary"]["all"]["ttft_s"]["p99"]),
                 _ms(r["summary"]["all"]["tpot_s"]["p99"]), _ms(r["summary"]["all"]["itl_s"]["p99"])]
                for r in sorted(report["runs"], key=lambda r: (r["arch"], r["offered_rate_rps"] or 0))]
        lines += ["", "## Rate sweep", "", _table(rows, ["arch", "offered req/s", "goodput req/s", "attained",
                                                          "TTFT p99 ms", "TPOT p99 ms", "ITL p99 ms"])]
    v = report["verdict"]
    lines += ["", "## Verdict", "", f"**{v['overall']}**", ""] + [f"- {p['text']}" for p in v["per_rate"]]
    lines += ["", f"Identical request sequences across architectures: {report['identical_requests']}"]
    return "\n".join(lines) + "\n"


def _s(x) -> str:
    return "–" if x is None else f"{x:.2f} s"


def _agree(a) -> str:
    if not a:
        return "–"
    return "ok" if a["ttft_ok"] and a["itl_ok"] and a["counts_ok"] else "MISMATCH"


def write(report: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    from pdkv.bench.ab.schema import validate

    validate(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "report.json", out_dir / "report.md"]
    files[0].write_text(json.dumps(report, indent=1))
    files[1].write_text(markdown(report))
    if plots:
        from pdkv.bench.ab.plots import plot_all

        files += plot_all(report, out_dir)
    return files
