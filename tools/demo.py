"""``make demo``: start a local disaggregated cluster (``pdkv up -c configs/local-disagg.yaml``:
one prefill node + one decode node on loopback), stream the answers, stop the cluster.

The cluster runs as real subprocesses (``python -m pdkv up``) and the request is real HTTP to
the decode node, whose prompt KV is computed by the prefill node and streamed over tcp;
tokens are printed the moment their Server-Sent Event arrives. The default model is the tiny
code model shipped in pdkv/data/pdkv-stdlib-coder (trained on the Python standard library), so
the requests are ones it can answer: complete a function from its header, once ending where
the line ends and once after the newline, as most code prompts end (the completions API, which
heals the prompt's last token by default: see README "Token healing"; ``--chat`` sends the
prompt as a user message through the chat template).
Serve a real folder with another question:
``python tools/demo.py --set model.path=/models/Qwen2.5-0.5B-Instruct --chat --prompt "Hello!"``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdkv.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
# tests/default_model checks that the model ends both (EOS) within the default max tokens and
# that the results parse
DEFAULT_PROMPTS = ("def read_lines(path):", "class Stack:\n    def __init__(self):\n")
DEFAULT_MAX_TOKENS = 96


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False




def wait_healthy(proc: subprocess.Popen, host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"demo: the server exited with status {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"demo: the server was not healthy after {timeout:.0f} s")


def stream_completion(host: str, port: int, endpoint: str, body: dict) -> dict:
    """POST a streamed (chat) completion and print each piece of text as it arrives; returns the
    usage."""
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.connect()
    # NOTE: timed from the request, not from the response headers: the server sends those with
    # the first token, so timing from them would miss the whole time to first token.
    t0 = time.perf_counter()
    conn.request("POST", endpoint, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"demo: HTTP {resp.status}: {resp.read().decode()}")
    usage, first, finish = {}, None, None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            finish = choice.get("finish_reason") or finish
            text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
            if text:
                first = first or time.perf_counter()
                print(text, end="", flush=True)
    print()
    elapsed = time.perf_counter() - t0
    if first is not None:
        usage["time_to_first_token_s"] = round(first - t0, 4)
    usage["total_s"] = round(elapsed, 4)
    usage["finish_reason"] = finish  # "stop": the model ended the text (EOS)
    return usage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", default=str(ROOT / "configs" / "local-disagg.yaml"),
                    help="a `pdkv up` cluster file (default: configs/local-disagg.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompt", action="append", default=None, help="the text to complete; repeat it "
                    "for several (default: two function headers, which the default model continues)")
    ap.add_argument("--chat", action="store_true", help="send the prompt as a user message to "
                    "/v1/chat/completions (the chat template) instead of completing it")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    args = ap.parse_args(argv)
    prompts = args.prompt or list(DEFAULT_PROMPTS)

    import tempfile

    from pdkv.disagg.launcher import role_configs

    overrides = list(args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        roles = role_configs(args.config, overrides, Path(tmp))  # config errors before anything starts
    cfg = roles["decode"][2]
    host, port = cfg.server.host, cfg.server.port
    if not port_is_free(host, port):
        port = free_port(host)
        print(f"demo: port {cfg.server.port} is taken; using {port}", flush=True)
        overrides.append(f"server.port={port}")
    p = roles["prefill"][2]
    if not port_is_free(p.server.host, p.server.port):
        overrides.append(f"prefill.server.port={free_port(p.server.host)}")
    if not port_is_free(p.messenger.control_host, p.messenger.control_port):
        overrides.append(f"prefill.messenger.control_port={free_port(p.messenger.control_host)}")
    cmd = [sys.executable, "-m", "pdkv", "up", "-c", args.config] + [a for o in overrides for a in ("--set", o)]
    print("demo: starting", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The cluster's own output is passed through; its "serving" line comes before our tokens
    # (the decode node answers /health a moment before `pdkv up` has seen both nodes ready).
    ready = threading.Event()

    def forward() -> None:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.startswith("pdkv up: serving"):
                ready.set()
    threading.Thread(target=forward, daemon=True).start()
    try:
        wait_healthy(proc, host, port, timeout=300)
        ready.wait(30)
        for prompt in prompts:
            body = {"max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            if args.chat:
                endpoint, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
                print(f"demo: POST http://{host}:{port}{endpoint} (stream), the user says:\n{prompt}", flush=True)
                print("-" * 72, flush=True)
            else:  # the answer continues the prompt: print the prompt, then the tokens as they come
                endpoint, body["prompt"] = "/v1/completions", prompt
                print(f"demo: POST http://{host}:{port}{endpoint} (stream), greedy, {args.max_tokens} tokens "
                      f"at most", flush=True)
                print("-" * 72, flush=True)
                print(prompt, end="", flush=True)
            usage = stream_completion(host, port, endpoint, body)
            print("-" * 72)
            print("demo: usage", json.dumps(usage))
        return 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(f"demo: cluster stopped (status {proc.returncode})")


if __name__ == "__main__":
    sys.exit(main())
