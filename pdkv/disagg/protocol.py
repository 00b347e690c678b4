"""The disaggregation control messages and the handshake each node offers.

Messages (msgpack maps over pdkv.control, after HELLO):

  decode -> prefill  CONNECT{info, kv_key, hidden_key}     data-path set-up (prepare/complete)
  prefill -> decode  CONNECTED{info}
  decode -> prefill  PREFILL{req, tokens, pages, imm, hidden_off, expected}
  decode -> prefill  CANCEL{req}
  prefill -> decode  CANCEL_ACK{req, posted}   no write of req is in flight any more
  prefill -> decode  FAIL{req, reason, posted} prefill gave up on req (its writes quiesced)
  prefill -> decode  DONE_AT{req, t_end, posted, bytes}  metrics only: the KV is ready when the
                     decode side's immediate count says so, never because of this message

``posted``: how many immediate-carrying writes of req completed locally without error (those
landed or will land), so the decode node can wait until exactly those landed before reusing the
pages (on tcp a write completes locally once it is in the kernel, before it lands).
"""

from __future__ import annotations

from pdkv.control import Hello, model_fingerprint
from pdkv.shard import KVGeometry

CONNECT, CONNECTED = "CONNECT", "CONNECTED"
PREFILL, CANCEL, CANCEL_ACK, FAIL, DONE_AT = "PREFILL", "CANCEL", "CANCEL_ACK", "FAIL", "DONE_AT"


def dtype_name(engine) -> str:
    return str(engine.loaded.dtype).removeprefix("torch.")


def kv_geometry(engine) -> KVGeometry:
    kv = engine.kv
    return KVGeometry(num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim, page_size=kv.page_size,
                      dtype=dtype_name(engine), layout=kv.layout)


def make_hello(engine, node_id: int, role: str, transport: str) -> Hello:
    """What this node tells its peer. Model, dtype, layout, page size and TP plan must match
    (pdkv.control refuses naming every difference); ``extra`` carries this side's KV byte
    layout, which may differ (each side sizes its own pool)."""
    shapes = {n: tuple(p.shape) for n, p in engine.loaded.model.named_parameters()}
    kv = engine.kv
    return Hello(node_id=node_id, role=role, model_fingerprint=model_fingerprint(engine.config, shapes),
                 dtype=dtype_name(engine), kv_layout=kv.layout, page_size=kv.page_size,
                 parallel={"tp": 1}, transport={"name": transport},
                 extra={"num_layers": kv.num_layers, "page_nbytes": kv.page_nbytes,
                        "layer_nbytes": kv.layer_nbytes, "num_pages": kv.num_pages,
                        "hidden_size": int(engine.loaded.arch.hidden_size),
                        "model_name": engine.model_name})
