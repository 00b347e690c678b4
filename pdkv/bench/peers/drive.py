"""Driving one server with one workload: AIPerf (its own venv, its own process), pdkv's own
closed-loop client at the same concurrency, or the A/B harness's trace-slice replay.

Every workload asks for exactly ``osl`` tokens (ignore_eos), streamed, greedy, from prompts of
``isl`` random token ids, so both servers do the same work. AIPerf's numbers are read from its
profile_export_aiperf.json; pdkv's clients' from pdkv.bench.ab.metrics (ITL there is every gap
between two tokens; AIPerf's ITL p50 is the median of the requests' mean gaps).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pdkv.bench.ab import client, metrics
from pdkv.bench.ab.prompts import PromptSynth, request_body

AIPERF_INSTALL = "python3 -m venv VENV && VENV/bin/pip install aiperf"


class AiperfError(RuntimeError):
    """AIPerf failed or wrote no result; the message has the command's output tail."""


@dataclass(frozen=True)
class Shape:
    """What every request of a concurrency workload is: prompt and output lengths."""
    isl: int = 512
    osl: int = 128
    duration_s: float = 30.0
    seed: int = 0


@dataclass(frozen=True)
class Numbers:
    output_tok_s: float | None
    ttft_p50_s: float | None
    itl_p50_s: float | None
    num_requests: int
    num_errors: int


def parse_aiperf(path: Path) -> Numbers:
    """Numbers from AIPerf's profile_export_aiperf.json (schema 1.x: metric -> {unit, avg, p50, ...})."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise AiperfError(f"cannot read AIPerf's result {path}: {e}") from None
    if not isinstance(d, dict) or "output_token_throughput" not in d:
        raise AiperfError(f"{path} has no output_token_throughput: not an AIPerf profile export, or the run "
                          f"completed no request (keys: {sorted(d)[:8] if isinstance(d, dict) else type(d)})")

    def ms(key: str) -> float | None:
        m = d.get(key)
        if not m or m.get("p50") is None:
            return None
        scale = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "ns": 1e-9, "us": 1e-6}.get(m.get("unit"))
        if scale is None:
            raise AiperfError(f"{path}: {key} is in {m.get('unit')!r}, expected ms")
        return m["p50"] * scale

    num = int((d.get("request_count") or {}).get("avg") or 0)
    errors = sum(int(e.get("count", 0)) for e in d.get("error_summary") or ())
    return Numbers(d["output_token_throughput"]["avg"], ms("time_to_first_token"), ms("inter_token_latency"),
                   num + errors, errors)


def aiperf_command(aiperf: str, url: str, model: str, tokenizer: str, concurrency: int, shape: Shape,
                   out: Path) -> list[str]:
    return [aiperf, "profile", "--model", model, "--tokenizer", tokenizer, "--url", url,
            "--endpoint-type", "completions", "--streaming", "--concurrency", str(concurrency),
            "--isl", str(shape.isl), "--isl-stddev", "0", "--osl", str(shape.osl), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--benchmark-duration", f"{shape.duration_s:g}", "--benchmark-grace-period", "120",
            "--warmup-request-count", str(concurrency), "--random-seed", str(shape.seed),
            "--artifact-dir", str(out), "--ui", "none", "--no-server-metrics"]


def run_aiperf(aiperf: str, url: str, model: str, tokenizer: str, concurrency: int, shape: Shape,
               out: Path) -> Numbers:
    cmd = aiperf_command(aiperf, url, model, tokenizer, concurrency, shape, out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "aiperf.out"
    limit = shape.duration_s + 300.0  # start-up, warm-up and the grace period, bounded
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # its workers are in its session: none may outlive a timeout or a Ctrl-C here
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
    tail = log.read_text(errors="replace")[-800:].strip()
    if rc is None:
        raise AiperfError(f"AIPerf against {url} did not finish within {limit:.0f} s; {log} ends: {tail}")
    result = out / "profile_export_aiperf.json"
    if rc != 0 or not result.is_file():
        raise AiperfError(f"AIPerf against {url} exited with status {rc}; {log} ends: {tail}")
    return parse_aiperf(result)


def _numbers(results: list, prompt_lens: dict[str, int]) -> Numbers:
    s = metrics.summarize(results, prompt_lens, {r.id: "short" for r in results},
                          metrics.SLO(math.inf, math.inf))["all"]
    return Numbers(s["output_tokens_per_s"], s["ttft_s"]["p50"], s["itl_s"]["p50"], s["num_requests"],
                   s["num_failed"])


def run_pdkv_client(url: str, model: str, vocab_size: int, concurrency: int, shape: Shape,
                    timeout: float) -> Numbers:
    """pdkv's own client, closed-loop at ``concurrency`` (after ``concurrency`` warm-up requests)."""
    synth = PromptSynth(3, vocab_size, shape.isl, shape.seed)

    def bodies(i: int) -> tuple[bytes, int]:
        return request_body(model, synth.prompt(shape.isl, (), i), shape.osl), shape.osl

    warm = [(f"w{i}", 0.0, *bodies(-1 - i)) for i in range(concurrency)]  # prompts the run does not reuse
    client.replay([url], warm, timeout)
    results, _ = client.closed_loop(url, bodies, concurrency, shape.duration_s, timeout)
    return _numbers(results, {r.id: shape.isl for r in results})


def run_trace(url: str, jobs: list, prompt_lens: dict[str, int], timeout: float) -> Numbers:
    """The A/B harness's open-loop replay of a prepared trace slice (pdkv.bench.ab.runner.prepare)."""
    results, _, _ = client.replay([url], jobs, timeout)
    return _numbers(results, prompt_lens)
