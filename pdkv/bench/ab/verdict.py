"""The seed's rule, applied to the numbers of one run:

    1. test chunked prefill first, as the colocated alternative;
    2. adopt disaggregation only when the interference between phases is measured (colocated
       decode gaps that overlap another request's prefill are at least INTERFERENCE_RATIO times
       the gaps that overlap none: metrics.interference), and
    3. the transfer path preserves both latency objectives: disaggregated serving meets the TTFT
       and TPOT SLOs for at least ``attainment`` of requests, or, at a load where no colocated
       architecture reaches that either, for at least as many as the best of them does; and it
       beats the best colocated goodput by a margin.

Otherwise the answer is colocated serving — chunked when chunking does at least as well. Each
verdict is stated with the numbers behind it.
"""

from __future__ import annotations

import enum

INTERFERENCE_RATIO = 1.5  # colocated mean ITL during prefills / quiet mean ITL: interference is measured
MARGIN = 1.05  # disaggregated goodput must beat the best colocated goodput by 5%


class Choice(str, enum.Enum):
    DISAGGREGATE = "disaggregate"
    CHUNKED = "chunked"
    COLOCATED = "colocated"
    INCONCLUSIVE = "inconclusive"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def _get(run: dict | None, *path):
    x = run["summary"]["all"] if run else None
    for p in path:
        if x is None:
            return None
        x = x.get(p)
    return x


def decide(runs: dict[str, dict], slo: dict, attainment: float = 0.9, rate_label: str = "") -> dict:
    """``runs``: {'colocated': run, 'chunked': run, 'disagg': run} for one rate (any may be missing)."""
    c, k, d = runs.get("colocated"), runs.get("chunked"), runs.get("disagg")
    if d is None or (c is None and k is None):
        return {"choice": Choice.INCONCLUSIVE.value, "text": "needs a disaggregated and a colocated architecture"}
    itl = {n: _get(r, "itl_s", "p99") for n, r in runs.items()}
    good = {n: _get(r, "goodput_rps") or 0.0 for n, r in runs.items()}
    frac = {n: _get(r, "goodput_fraction") or 0.0 for n, r in runs.items()}
    inter = {n: _get(r, "interference", "ratio_mean") for n, r in runs.items()}
    stall = inter.get("colocated") if c is not None else inter.get("chunked")
    interference = stall is not None and stall >= INTERFERENCE_RATIO
    best_col = max((n for n in ("colocated", "chunked") if n in runs), key=lambda n: good[n])
    bar = min(attainment, max(frac[n] for n in ("colocated", "chunked") if n in runs))
    preserves = frac["disagg"] >= bar
    wins = good["disagg"] > MARGIN * good[best_col]
    if interference and preserves and wins:
        choice = Choice.DISAGGREGATE
    elif k is not None and (c is None or good["chunked"] >= good["colocated"]):
        choice = Choice.CHUNKED
    else:
        choice = Choice.COLOCATED
    ratios = {n: (itl["disagg"] / itl[n] if itl.get(n) and itl.get("disagg") is not None else None)
              for n in ("colocated", "chunked")}
    expect = {"itl_p99_vs_colocated": ratios["colocated"], "itl_p99_vs_chunked": ratios["chunked"],
              "met": bool(ratios["colocated"] is not None and ratios["colocated"] <= 0.5
                          and (ratios["chunked"] is None or ratios["chunked"] <= 0.8))}
    why = []
    if not interference:
        why.append(f"interference is small (decode gaps during prefills are {stall:.2f}x the quiet ones, "
                   f"< {INTERFERENCE_RATIO:g})" if stall is not None else "interference could not be measured")
    if not preserves:
        why.append(f"disaggregation meets both SLOs for only {frac['disagg']:.0%} of requests (< {bar:.0%})")
    if not wins:
        why.append(f"its goodput {good['disagg']:.2f} req/s does not beat {best_col}'s {good[best_col]:.2f} "
                   f"by {MARGIN - 1:.0%}")
    names = [n for n in ("colocated", "chunked", "disagg") if n in runs]
    def vs(n: str) -> str:
        r = ratios.get(n)
        return f"{_ms(itl[n])} ({n}{f', {r:.2f}x' if r else ''})"

    text = (f"{rate_label}p99 ITL is {_ms(itl['disagg'])} disaggregated against "
            + " and ".join(vs(n) for n in names[:-1])
            + f"; p50 TTFT is {_ms(_get(d, 'ttft_s', 'p50'))} against "
            + " / ".join(f"{_ms(_get(runs[n], 'ttft_s', 'p50'))} ({n})" for n in names[:-1])
            + f" (p99 {_ms(_get(d, 'ttft_s', 'p99'))} against "
            + " / ".join(f"{_ms(_get(runs[n], 'ttft_s', 'p99'))}" for n in names[:-1])
            + f"); goodput at SLO (TTFT <= {slo['ttft_s'] * 1e3:g} ms, TPOT <= {slo['tpot_s'] * 1e3:g} ms) is "
            + ", ".join(f"{good[n]:.2f} req/s = {frac[n]:.0%} ({n})" for n in names) + ". ")
    if all(inter.get(n) is not None for n in names):
        text += ("Decode gaps that overlap another request's prefill are "
                 + ", ".join(f"{inter[n]:.1f}x ({n})" for n in names) + " the gaps that overlap none. ")
    if k is not None and c is not None:
        r = itl["chunked"] / itl["colocated"] if itl.get("chunked") and itl.get("colocated") else None
        text += f"Chunked prefill alone gets p99 ITL {_ms(itl['chunked'])}" + (f" ({r:.2f}x colocated). " if r else ". ")
    text += f"Verdict: {choice.value}" + (f" ({'; '.join(why)})." if why and choice != Choice.DISAGGREGATE else ".")
    return {"choice": choice.value, "text": text, "interference_ratio": stall, "interference_ratios": inter,
            "interference": interference,
            "transfer_preserves_slos": preserves, "disagg_goodput_wins": wins, "attainment_target": attainment,
            "expectation": expect}


def overall(per_rate: list[dict]) -> str:
    """Most frequent choice over rates; a tie goes to colocated serving (no second pool to run)."""
    counts: dict[str, int] = {}
    for v in per_rate:
        counts[v["choice"]] = counts.get(v["choice"], 0) + 1
    order = [Choice.CHUNKED.value, Choice.COLOCATED.value, Choice.DISAGGREGATE.value, Choice.INCONCLUSIVE.value]
    return max(order, key=lambda c: (counts.get(c, 0), -order.index(c)))
