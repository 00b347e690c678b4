"""The HTTP path of `python -m pdkv.bench interference --http`: issue 20's probe, as a user runs it.

Per configuration it starts ``pdkv serve -c configs/colocated.yaml`` (the embedded default model)
with ``scheduler.chunk_size`` / ``scheduler.max_num_batched_tokens`` set, opens ``streams``
streaming /v1/completions (24-token prompts, 160 tokens, ``ignore_eos``), sends ``num_long``
long prompts ``gap_s`` seconds apart while they run, and takes ITL from the arrival times of the
streams' SSE chunks and TTFT from each long prompt's first chunk. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdkv serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"pdkv serve on port {port} not healthy after {timeout:.0f} s")


async def _stream(session, port: int, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """Sends one streaming completion; returns (send time, arrival time of each token chunk)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}  # a chunk per token even when its text is still incomplete UTF-8
    sent, times = time.perf_counter(), []
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("token_ids"):
                    times.append(time.perf_counter())
    return sent, times


async def _probe(port: int, streams: list[list[int]], prompts: list[list[int]], gap_s: float,
                 stream_tokens: int, long_tokens: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(_stream(session, port, s, stream_tokens)) for s in streams]
        longs = []
        for i, p in enumerate(prompts):
            if i:
                await asyncio.sleep(gap_s)
            longs.append(asyncio.create_task(_stream(session, port, p, long_tokens)))
        done = await asyncio.gather(*tasks, *longs)
    itl = [(b - a) * 1e3 for _, ts in done[:len(streams)] for a, b in zip(ts, ts[1:])]
    ttft = [(ts[0] - sent) * 1e3 for sent, ts in done[len(streams):] if ts]
    return {"itl": itl, "ttft": ttft}


def run_http(chunk: int, budget: int, streams, prompts, gap_s: float, stream_tokens: int,
             long_tokens: int, threads: int) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "pdkv", "serve", "-c", "configs/colocated.yaml", "--log-level", "warning",
           "--set", f"server.port={port}", "--set", f"scheduler.chunk_size={chunk}",
           "--set", f"scheduler.max_num_batched_tokens={budget}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(port, proc)
        return asyncio.run(_probe(port, streams, prompts, gap_s, stream_tokens, long_tokens))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
