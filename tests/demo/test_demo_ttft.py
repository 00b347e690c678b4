"""tools/demo.py times the first token from the request: a server that answers (headers with
the first token, as pdkv's does) only after 0.3 s must show a time to first token of 0.3 s+."""

from __future__ import annotations

import http.server
import importlib.util
import json
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class SlowFirstToken(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(0.3)  # the "prefill": nothing, not even headers, before the first token
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in ("a", "b"):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a):
        pass


def test_time_to_first_token_is_measured_from_the_request(capsys):
    spec = importlib.util.spec_from_file_location("pdkv_demo", ROOT / "tools" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    srv = http.server.HTTPServer(("127.0.0.1", 0), SlowFirstToken)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        usage = demo.stream_completion("127.0.0.1", srv.server_address[1], "/v1/completions", {"prompt": "x"})
    finally:
        srv.shutdown()
    assert usage["time_to_first_token_s"] >= 0.29
    assert "ab" in capsys.readouterr().out
