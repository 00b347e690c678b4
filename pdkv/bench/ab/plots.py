"""PNG plots of a report (matplotlib, headless):

    ttft_cdf.png        CDF of TTFT per architecture, one panel per rate
    itl_cdf.png         CDF of per-token inter-token latency (log x), one panel per rate
    itl_timeline.png    every inter-token gap against wall time, one panel per architecture (at the
                        highest rate), long-prompt arrivals marked: prefill interference shows as
                        spikes right after the marks
    goodput_vs_rate.png goodput and p99 ITL against offered load
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"colocated": "tab:red", "chunked": "tab:orange", "disagg": "tab:blue"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rates(report: dict) -> list:
    return list(dict.fromkeys(r["rate"] for r in report["runs"]))


def _gaps(req: dict) -> list[tuple[float, float]]:
    """(wall time of the later token, gap) for each pair of consecutive chunks of a request."""
    t = req["chunk_s"]
    return [(req["sent_s"] + b, b - a) for a, b in zip(t, t[1:])]


def _cdf(ax, xs: list[float], label: str, color) -> None:
    if not xs:
        return
    xs = sorted(xs)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, color=color)


def _label(rate) -> str:
    return f"{rate:g} req/s" if rate else "as replayed"


def plot_all(report: dict, out: Path) -> list[Path]:
    plt = _plt()
    rates, files = _rates(report), []
    for name, key, xlabel, logx in (("ttft_cdf.png", "ttft", "TTFT (s)", False),
                                    ("itl_cdf.png", "itl", "inter-token latency (s)", True)):
        fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 3.6), squeeze=False)
        for ax, rate in zip(axes[0], rates):
            for r in (x for x in report["runs"] if x["rate"] == rate):
                ok = [q for q in r["requests"] if q["status"] == "ok"]
                xs = ([q["ttft_s"] for q in ok] if key == "ttft"
                      else [g for q in ok for _, g in _gaps(q) if g > 0])
                _cdf(ax, xs, r["arch"], COLORS.get(r["arch"]))
            ax.set(title=_label(rate), xlabel=xlabel, ylabel="fraction of " + ("requests" if key == "ttft" else "gaps"))
            if logx:
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"{report['trace']['name']}: {key.upper()} CDF")
        fig.tight_layout()
        files.append(out / name)
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    top = rates[-1]
    runs = [r for r in report["runs"] if r["rate"] == top]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.4 * len(runs)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        pts = [p for q in r["requests"] if q["status"] == "ok" for p in _gaps(q)]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] * 1e3 for p in pts], s=3, color=COLORS.get(r["arch"], "k"))
        for q in r["requests"]:
            if q["class"] == "long":
                ax.axvline(q["sent_s"], color="grey", lw=0.6, alpha=0.6)
        f = r.get("fault") or {}
        if f.get("kill_s") is not None:  # the outage of a --fault run
            ax.axvspan(f["kill_s"], f.get("ready_s") or f["kill_s"], color="red", alpha=0.15, label="node down")
        ax.set(ylabel="ITL (ms)", title=f"{r['arch']} ({_label(top)}); grey: long-prompt arrivals")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since replay start (s)")
    fig.tight_layout()
    files.append(out / "itl_timeline.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arch in dict.fromkeys(r["arch"] for r in report["runs"]):
        rs = sorted((r for r in report["runs"] if r["arch"] == arch), key=lambda r: r["offered_rate_rps"] or 0)
        x = [r["offered_rate_rps"] or 0 for r in rs]
        a1.plot(x, [r["summary"]["all"]["goodput_rps"] for r in rs], "o-", label=arch, color=COLORS.get(arch))
        a2.plot(x, [(r["summary"]["all"]["itl_s"]["p99"] or 0) * 1e3 for r in rs], "o-", label=arch,
                color=COLORS.get(arch))
    slo = report["slo"]
    a1.set(xlabel="offered load (req/s)", ylabel="goodput (req/s)",
           title=f"goodput at TTFT<={slo['ttft_s'] * 1e3:g} ms, TPOT<={slo['tpot_s'] * 1e3:g} ms")
    a2.set(xlabel="offered load (req/s)", ylabel="p99 ITL (ms)", title="p99 inter-token latency")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    files.append(out / "goodput_vs_rate.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files
