"""A decode node as a child process (``pdkv serve``'s steps) that records, TEST-ONLY, each
request's first verification: the output tokens it had then and the drafts it verified, one
JSON line per request appended to argv[2] — what a verbs test compares with a colocated
engine's first drafts (the loopback verbs device lives only in child processes)."""
from __future__ import annotations

import json
import sys


def main(config_path: str, out_path: str) -> None:
    from pdkv.cli import load_engine
    from pdkv.config import load_config
    from pdkv.disagg.node import build_node
    from pdkv.server import serve

    cfg = load_config(config_path, [])
    engine = load_engine(cfg)
    real, seen = engine.runner.verify, set()

    def verify(logits, req, drafts):
        if req.request_id not in seen:
            seen.add(req.request_id)
            with open(out_path, "a") as f:
                f.write(json.dumps({"prompt": list(req.prompt_token_ids), "num_output": len(req.output_token_ids),
                                    "drafts": [int(d) for d in drafts]}) + "\n")
        return real(logits, req, drafts)
    engine.runner.verify = verify
    serve(cfg, engine, build_node(cfg, engine))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
