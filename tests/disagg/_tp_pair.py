"""A prefill node at TP2 and a decode node at TP1 on loopback (tcp), in-process ServerThreads."""
from __future__ import annotations

from _cluster import make_engine, node_config
from pdkv.engine import LLMEngine
from pdkv.server.app import NODE


class TP2ToTP1:
    """``prefill_over`` / ``decode_over``: node_config overrides; ``.url`` is the decode node's API."""

    def __init__(self, model_dir, prefill_over: dict, decode_over: dict):
        from pdkv.disagg.node import DecodeNode, PrefillNode
        from pdkv.server.runner import ServerThread

        pcfg = node_config(model_dir, "prefill", parallel__tp=2, parallel__timeout_s=30.0, **prefill_over)
        self.prefill_engine = LLMEngine.from_config(pcfg, num_threads=1)  # pdkv.tp makes every rank's KV memory
        self.prefill = ServerThread(pcfg, self.prefill_engine, PrefillNode(pcfg, self.prefill_engine)).start()
        self.decode = None
        try:
            port = self.prefill.app[NODE].control_port
            dcfg = node_config(model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{port}"], **decode_over)
            self.decode_engine = make_engine(dcfg)
            self.decode = ServerThread(dcfg, self.decode_engine, DecodeNode(dcfg, self.decode_engine)).start()
        except BaseException:
            self.stop()
            raise
        self.url = self.decode.url
        self.coordinator = self.decode.app[NODE].coordinator
        assert [(q.plan.prefill.tp, q.plan.decode.tp) for q in self.coordinator.peers] == [(2, 1)]

    def pools_full(self) -> bool:
        return all(e.allocator.num_free == e.allocator.num_total for e in (self.prefill_engine, self.decode_engine))

    def model_name(self) -> str:
        import json
        import urllib.request

        return json.loads(urllib.request.urlopen(self.url + "/v1/models").read())["data"][0]["id"]

    def stop(self) -> None:
        if self.decode is not None:
            self.decode.stop()
        self.prefill.stop()
        self.prefill_engine.close()
