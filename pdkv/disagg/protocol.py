"""The disaggregation control messages and the handshake each node offers.

HELLO (pdkv.control.Hello, from make_hello) carries, besides model / dtype / layout / page size,
the speculative hand-off (spec_handoff: what the prefill node prepares for the decode node's
proposer), which both sides compare field by field, and this host's identity (host_identity:
where both name one host, messenger.transport auto offers shm to the link: same_host).

Messages (msgpack maps over pdkv.control, after HELLO; each is a frozen dataclass of
pdkv/disagg/messages.py, which builds and checks them):

  decode -> prefill  CONNECT{info, kv_key, kv_keys, hidden_key[, spec_key]}  data-path set-up
                     (prepare/complete); kv_keys: one region key per decode rank (kv_key =
                     kv_keys[0]); spec_key: the proposer cache with a speculative hand-off
  prefill -> decode  CONNECTED{info} | REFUSE{reason[, busy]}  (REFUSE: the shard plan cannot serve the pair;
                                     busy: the node is full, redial later)
  decode -> prefill  PREFILL{req, tokens, cached, pages, imm, hidden_off, expected, seed,
                             runs, kv_rkeys, hidden_rkey[, spec_pages, next_token, spec_runs, spec_rkeys]
                             [, prompt_logprobs, last_token]}
                     tokens: the prompt minus its last token (the decode node computes that one);
                     cached: how many leading tokens the decode node's prefix cache already holds
                     (whole pages, < len(tokens), default 0): the prefill node writes only the
                     pages after them, and ``pages`` names exactly those (one decode page per
                     page of tokens[cached:]); expected = the writes those pages make, from the
                     link's shard plan (pdkv/disagg/writes.py), + 1 for the hidden-state row;
                     seed: the request's replica-assignment seed (pdkv.shard.request_seed(req));
                     runs/kv_rkeys/hidden_rkey: the keys of the ranges granted for it, one per
                     (decode rank, layer, run of pages) (pdkv/disagg/grants.py, range_keys.py);
                     without them the writes name CONNECT's region keys;
                     spec_pages / next_token: the speculative hand-off (pdkv/disagg/spec_handoff.py;
                     with it, cached is 0: the proposer's cache holds no prefix); spec_runs /
                     spec_rkeys: the proposer ranges' write keys, one per (proposer layer, run of
                     spec_pages); without them the proposer writes name CONNECT's spec_key
                     prompt_logprobs / last_token: echo + logprobs (pdkv/disagg/prompt_logprobs.py)
  decode -> prefill  CANCEL{req}
  prefill -> decode  CANCEL_ACK{req, posted}   no write of req is in flight any more
  prefill -> decode  FAIL{req, reason, posted} prefill gave up on req (its writes quiesced)
  prefill -> decode  PROMPT_LOGPROBS{req, logprobs}  asked for by PREFILL, before its DONE_AT
  prefill -> decode  DONE_AT{req, t_end, posted, bytes}  metrics only: the KV is ready when the
                     decode side's immediate count says so, never because of this message

``posted``: how many immediate-carrying writes of req completed locally without error (those
landed or will land), so the decode node can wait until exactly those landed before reusing the
pages (on tcp a write completes locally once it is in the kernel, before it lands).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from pdkv.control import Hello, model_fingerprint
from pdkv.disagg import messages as M
from pdkv.shard import KVGeometry

log = logging.getLogger(__name__)

# the messages' type names (their classes, fields and checks: pdkv/disagg/messages.py)
CONNECT, CONNECTED, REFUSE = M.CONNECT, M.CONNECTED, M.REFUSE
PREFILL, CANCEL, CANCEL_ACK, FAIL, DONE_AT = M.PREFILL, M.CANCEL, M.CANCEL_ACK, M.FAIL, M.DONE_AT


def dtype_name(engine) -> str:
    return str(engine.loaded.dtype).removeprefix("torch.")


def kv_geometry(engine) -> KVGeometry:
    return engine.kv.geometry()  # K/V heads, or an MLA latent (kv_parts=1, replicated)


# What ``parallel`` must equal on both sides: the TP degrees may differ (the shard plan bridges
# them, pdkv/disagg/sharded.py), the way KV moves between them may not.
PARALLEL = {"kv_transfer": "pdkv.shard/1"}


def checkpoint_shapes(engine) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's full shape (safetensors headers only), whatever this node's TP
    degree: rank 0's parameters are its slice, so they cannot identify the model across TP."""
    return folder_shapes(Path(engine.loaded.path))


def folder_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's full shape in the checkpoint folder ``path`` (safetensors headers only)."""
    from safetensors import safe_open  # noqa: PLC0415

    from pdkv.models.loader import weight_files  # noqa: PLC0415

    shapes = {}
    for f in weight_files(path):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


# Speculative methods whose proposer needs prefill-side work (its KV streamed with the target's):
# ngram needs nothing from the prefill node, so it is no part of the hand-off.
HANDOFF_METHODS = ("mtp", "draft")


def spec_handoff(sc, engine) -> dict:
    """What the prefill node prepares for the decode node's proposer, as both sides must agree
    on it (Hello.speculative, compared field by field): {} for none (no speculation, or ngram).
    ``sc``: the node's pdkv.config.SpeculativeConfig (None: off)."""
    if sc is None or sc.method not in HANDOFF_METHODS:
        return {}
    out = {"method": sc.method, "num_tokens": int(sc.num_tokens)}
    if sc.method == "mtp":
        from pdkv.engine.spec.mtp import NUM_MTP_LAYERS  # noqa: PLC0415

        # the checkpoint's MTP weights are in the target's fingerprint already; this is how many
        # of its MTP layers' KV the hand-off carries
        out["mtp_layers"] = min(NUM_MTP_LAYERS, int(engine.loaded.arch.num_nextn_predict_layers))
    else:
        out["draft_model"] = draft_fingerprint(Path(sc.draft_model.path))
    return out


def draft_fingerprint(path: Path) -> str:
    """The draft model's identity across nodes (its config and every tensor's shape), as the
    target's model_fingerprint; the folder's path may differ between the nodes."""
    from pdkv.models.loader import read_json  # noqa: PLC0415

    return model_fingerprint(read_json(path / "config.json"), folder_shapes(path))


def make_hello(engine, node_id: int, role: str, transport: str, speculative=None, extra=None,
               tls_data: bool = False) -> Hello:
    """What this node tells its peer. Model, dtype, layout and page size must match
    (pdkv.control refuses naming every difference), and so must the speculative hand-off
    (``speculative``: this node's SpeculativeConfig, see spec_handoff); ``extra`` carries this side's KV byte
    layout, which may differ (each side sizes its own pool), and its ShardSpec (``shard``: the
    TP degree; the two sides' specs make the link's plan, pdkv/disagg/sharded.py); ``extra``: more
    of it (e.g. sharded.hello_rank_nics)."""
    from pdkv.disagg.sharded import dp_layout  # noqa: PLC0415
    from pdkv.tp import shard_spec  # noqa: PLC0415

    kv = engine.kv
    handoff = spec_handoff(speculative, engine)
    spec_extra = {}
    if handoff:  # the byte layout of the proposer cache the hand-off writes
        from pdkv.disagg.spec_handoff import handoff_proposer, spec_wire  # noqa: PLC0415

        spec_extra["spec_kv"] = spec_wire(handoff_proposer(engine, handoff))
    return Hello(node_id=node_id, role=role,
                 model_fingerprint=model_fingerprint(engine.config, checkpoint_shapes(engine)),
                 dtype=dtype_name(engine), kv_dtype=str(kv.dtype).removeprefix("torch."),
                 kv_layout=kv.layout, page_size=kv.page_size,
                 parallel=dict(PARALLEL), transport={"name": transport, **({"tls_data": True} if tls_data else {})},
                 extra={"num_layers": kv.num_layers, "page_nbytes": kv.page_nbytes,
                        "layer_nbytes": kv.layer_nbytes, "num_pages": kv.num_pages,
                        "hidden_size": int(engine.loaded.arch.hidden_size),
                        "model_name": engine.model_name, "shard": shard_spec(engine).to_wire(), **spec_extra,
                        **({"dp": dp_layout(engine)} if dp_layout(engine) else {}),
                        **(extra or {})},
                 speculative=handoff, host=host_identity())


def host_identity() -> str:
    """This host, as the kernel knows it: machine id, boot id and network namespace (the shm
    transport's abstract sockets reach only processes of one namespace), hashed: a peer learns
    whether it shares them, not what they are. "" when none can be read."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(str(Path("/proc/self/ns/net").stat().st_ino))
    except OSError:
        parts.append("")
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:32] if any(parts[1:]) else ""


def same_host(mine: Hello, peer: Hello) -> bool:
    """Whether the HELLOs name one host (both said which): what ``Messenger.prepare(same_host=)``
    takes, so that auto offers shm to this peer. Only a hint: the shm connection checks the boot
    id itself and auto falls back to tcp when it fails."""
    return bool(mine.host) and mine.host == peer.host


def log_route(messenger, conn: int, peer_id: int, hinted: bool, who: str) -> None:
    """Which transport carries ``conn`` (auto), logged; a fallback from shm where the HELLOs
    named one host is a warning naming why."""
    if getattr(messenger, "transport", None) != "auto":
        return
    via, why = messenger.route(conn)
    _, note = messenger.route(0)
    if hinted and via != "shm":
        log.warning("%s: peer %#x said it is on this host, but its data path falls back to %s: %s", who,
                    peer_id, via, why)
    else:
        log.info("%s: peer %#x's data path: %s%s", who, peer_id, via, f" ({why})" if why else "")
    if note:
        log.warning("%s: a region could not be shared, its pages go through tcp: %s", who, note)
