"""The soak's plot: RSS, file descriptors, threads and page-pool levels of every node against
time, restarts shaded, failed requests marked. A PNG through matplotlib when it is installed,
otherwise a small SVG written here (no other dependency)."""

from __future__ import annotations

from pathlib import Path

PANELS = (("rss_bytes", "RSS (MiB)", 1 / (1 << 20)), ("fds", "open fds", 1), ("threads", "threads", 1),
          ("pages_used", "pages used / held", 1))
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def _series(report: dict, metric: str, scale: float) -> dict[str, list[tuple[float, float | None]]]:
    out: dict[str, list] = {}
    for s in report["samples"]:
        v = s.get(metric)
        out.setdefault(s["node"], []).append((s["t_s"], None if v is None else v * scale))
    return out


def _held(report: dict) -> dict[str, list]:
    return {f"{n} held": pts for n, pts in _series(report, "pages_held", 1).items()}


def plot(report: dict, out_dir: Path) -> Path:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return _svg(report, out_dir / "soak.svg")
    return _png(report, out_dir / "soak.png")


def _png(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(10, 2.3 * len(PANELS)), sharex=True)
    for ax, (metric, label, scale) in zip(axes, PANELS):
        series = _series(report, metric, scale)
        if metric == "pages_used":
            series.update(_held(report))
        for i, (name, pts) in enumerate(series.items()):
            ax.plot([t for t, _ in pts], [v if v is not None else float("nan") for _, v in pts],
                    lw=1, color=COLORS[i % len(COLORS)], label=name)
        for r in report["restarts"]:
            ax.axvspan(r["kill_s"], r.get("ready_s") or r["kill_s"], color="red", alpha=0.15)
        for f in report["failures"]["failed"]:
            ax.axvline(f["sent_s"], color="black", lw=0.4, alpha=0.5)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("time since the load started (s); red: prefill node down; black: failed requests")
    v = report["verdict"]
    fig.suptitle(f"pdkv soak, {report['minutes']:g} min: {'flat after warm-up' if v['flat'] else 'NOT flat'}, "
                 f"{report['failures']['num_failed_unexcused']} unexcused failures")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _svg(report: dict, path: Path) -> Path:
    w, ph, pad = 900, 160, 50
    t_max = max([s["t_s"] for s in report["samples"]] or [1.0]) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{ph * len(PANELS) + 30}" '
             f'font-family="sans-serif" font-size="10">']
    for k, (metric, label, scale) in enumerate(PANELS):
        y0 = k * ph + 10
        series = _series(report, metric, scale)
        if metric == "pages_used":
            series.update(_held(report))
        vals = [v for pts in series.values() for _, v in pts if v is not None] or [0.0]
        lo, hi = min(vals), max(vals)
        hi = hi if hi > lo else lo + 1

        def xy(t, v):
            return pad + (w - 2 * pad) * t / t_max, y0 + ph - 20 - (ph - 30) * (v - lo) / (hi - lo)

        parts.append(f'<text x="5" y="{y0 + 10}">{label} [{lo:.0f}..{hi:.0f}]</text>')
        for r in report["restarts"]:
            a, b = xy(r["kill_s"], lo)[0], xy(r.get("ready_s") or r["kill_s"], lo)[0]
            parts.append(f'<rect x="{a:.1f}" y="{y0}" width="{max(b - a, 1):.1f}" height="{ph - 20}" '
                         f'fill="red" fill-opacity="0.15"/>')
        for i, (name, pts) in enumerate(series.items()):
            line = " ".join("{:.1f},{:.1f}".format(*xy(t, v)) for t, v in pts if v is not None)
            parts.append(f'<polyline fill="none" stroke="{COLORS[i % len(COLORS)]}" points="{line}"/>')
            parts.append(f'<text x="{w - 200}" y="{y0 + 12 + 11 * i}" fill="{COLORS[i % len(COLORS)]}">{name}</text>')
    parts.append(f'<text x="{pad}" y="{ph * len(PANELS) + 22}">time 0..{t_max:.0f} s; red: prefill node down</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))
    return path
