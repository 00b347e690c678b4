"""An authenticated but hostile prefill node on the loopback verbs device (or on tcp), as a
child process (the device is on LD_LIBRARY_PATH only there): it holds the cluster secret and the
real prefill node's HELLO, so a decode node connects to it and sends it PREFILLs.

    python _verbs_impostor.py MODEL_DIR SECRET_FILE MODE OUT_JSON PORT [TRANSPORT]

TRANSPORT: verbs (the default) or tcp. On verbs the NIC refuses a write outside the writer's
MRs; on tcp the decode node's receiver refuses a frame outside the writer's granted ranges
before a byte lands; either way the write completes with an error.

listens on 127.0.0.1:PORT and serves until killed. OUT_JSON is rewritten after every PREFILL
with what it saw and did.

MODE attack: each control connection's first PREFILL gets one attack (later ones are only
counted), then the impostor closes the connection (the decode node fails its requests, tears
the data path down and redials):
  1. foreign — its request's own range key, into the page right after that range (another
     request's page, or a free one): outside the MR;
  2. stale — it answers FAIL{posted 0} (the decode node revokes: deregisters the MRs and frees
     the pages), then writes with the old key into those pages;
  3. region — CONNECT's region key (no MR of it in this peer's protection domain).
  Each write is recorded with whether it was refused (a completion with an error).
MODE silent: accepts every PREFILL and never writes nor answers (it holds its grants).
MODE spec: an mtp prefill node (MODEL_DIR has an MTP layer; num_tokens SPEC_TOKENS) attacking
the decode node's proposer cache (pdkv/disagg/spec_handoff.py) the same way, one attack per
connection:
  1. spec_foreign — its request's own proposer range key, into the proposer page right after
     that range: outside the MR;
  2. spec_region — CONNECT's spec_key (no MR of it in this peer's protection domain).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "disagg"))

from _cluster import make_engine, node_config  # noqa: E402

from pdkv._messenger import Messenger  # noqa: E402
from pdkv.transports import TcpOptions, VerbsOptions  # noqa: E402
from pdkv.auth import load_secret  # noqa: E402
from pdkv.control import ControlChannel  # noqa: E402
from pdkv.disagg import protocol as P  # noqa: E402

ATTACKS = ("foreign", "stale", "region")
SPEC_ATTACKS = ("spec_foreign", "spec_region")
SPEC_TOKENS = 3
NODE_ID = 0xBAD


class Impostor:
    def __init__(self, model_dir: str, secret: bytes, mode: str, out: Path, transport: str = "verbs"):
        spec = {"speculative__method": "mtp", "speculative__num_tokens": SPEC_TOKENS} if mode == "spec" else {}
        nics = {"messenger__nics": ["lo_verbs0"]} if transport == "verbs" else {}
        cfg = node_config(model_dir, "prefill", messenger__transport=transport, **nics, **spec)
        engine = make_engine(cfg)
        self.hello = P.make_hello(engine, NODE_ID, "prefill", transport, cfg.speculative)
        self.secret, self.mode, self.out = secret, mode, out
        self.m = Messenger("verbs", NODE_ID, VerbsOptions(nics=("lo_verbs0",))) if transport == "verbs" else \
            Messenger("tcp", NODE_ID, TcpOptions(host="127.0.0.1"))
        self.src = bytearray(b"\xcd\xab" * (1 << 19))  # what a landed attack would leave behind
        self.lkey = self.m.register(self.src)
        self.record = {"prefills": 0, "attacks": []}
        self.tags = iter(range(1000, 10**6))

    def save(self):
        self.out.write_text(json.dumps(self.record))

    async def accept(self, reader, writer):
        ch = await ControlChannel.accept(reader, writer, self.hello, 5, secret=self.secret)
        msg = await ch.recv()
        conn, info = self.m.prepare(ch.peer.node_id, ch.token)
        await asyncio.get_running_loop().run_in_executor(None, self.m.complete, conn, msg["info"])
        await ch.send({"type": P.CONNECTED, "info": info})
        ch.start_heartbeat(0.2, 5.0, lambda reason: None)  # alive as far as the decode node can tell
        geo = ch.peer.extra
        got: asyncio.Queue = asyncio.Queue()

        async def read():  # every PREFILL is counted, also those that arrive during an attack
            try:
                while True:
                    m = await ch.recv()
                    if m["type"] == P.PREFILL:
                        self.record["prefills"] += 1
                        self.save()
                        got.put_nowait(m)
            except Exception:  # noqa: BLE001 - closed
                return
        reader = asyncio.get_running_loop().create_task(read())
        m = await got.get()
        if self.mode == "silent":
            await reader
            return
        attacks = SPEC_ATTACKS if self.mode == "spec" else ATTACKS
        kind = attacks[len(self.record["attacks"]) % len(attacks)]
        runs, pages = (m["spec_runs"], m["spec_pages"]) if self.mode == "spec" else (m["runs"], m["pages"])
        if self.mode == "spec":
            geo = geo["spec_kv"]
        first, count = runs[0]
        after = first + count
        foreign = after if after < geo["num_pages"] and after not in pages else \
            next(p for p in range(geo["num_pages"]) if p not in pages)
        if kind == "spec_foreign":
            key, off = m["spec_rkeys"][0], foreign * geo["page_nbytes"]
        elif kind == "spec_region":
            key, off = msg["spec_key"], foreign * geo["page_nbytes"]
        elif kind == "foreign":
            key, off = m["kv_rkeys"][0], foreign * geo["page_nbytes"]
        elif kind == "stale":
            await ch.send({"type": P.FAIL, "req": m["req"], "reason": "impostor", "posted": 0})
            await asyncio.sleep(1.0)  # the decode node has revoked by now; its pages may be another's
            key, off = m["kv_rkeys"][0], first * geo["page_nbytes"]
        else:
            key, off = msg["kv_keys"][0], foreign * geo["page_nbytes"]
        refused = await self.write(conn, key, off, geo["page_nbytes"], m["imm"])
        await asyncio.sleep(0.3)
        ch.close()
        reader.cancel()
        self.record["attacks"].append({"kind": kind, "req": m["req"], "offset": off, "refused": refused})
        self.save()

    async def write(self, conn: int, key: int, off: int, length: int, imm: int) -> bool | str:
        """One write; True if it was refused, False if it completed cleanly. verbs: the write's
        completion carries the NIC's access error. tcp: a write completes once its bytes are in
        the kernel, and the receiver's refusal (an ERROR frame) arrives after it as an "error"
        event: a clean completion counts only if no such event follows within 3 s."""
        tag = next(self.tags)
        self.m.drain()  # an earlier attack's late events are not this write's
        try:
            self.m.write(conn, self.lkey, 0, key, off, length, imm=imm, tag=tag)
        except Exception as e:  # noqa: BLE001 - refused before it left (e.g. the QP already broke)
            return f"raised: {e}"
        end, done = time.monotonic() + 10, None
        while time.monotonic() < end:
            for ev in self.m.drain():
                if ev.kind == "error":
                    return True
                if ev.kind == "batch_done" and ev.tag == tag:
                    if ev.num_errors > 0 or ev.status < 0:
                        return True
                    if self.m.transport != "tcp":
                        return False
                    done, end = True, time.monotonic() + 3.0
            await asyncio.sleep(0.01)
        return False if done else "no completion"


async def main() -> None:
    model_dir, secret_file, mode, out, port = sys.argv[1:6]
    transport = sys.argv[6] if len(sys.argv) > 6 else "verbs"
    imp = Impostor(model_dir, load_secret(secret_file), mode, Path(out), transport)
    imp.save()
    await asyncio.start_server(imp.accept, "127.0.0.1", int(port))
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
