"""Every control message between a decode node and a prefill node, one frozen dataclass each.

A message is built by its sender as an object and leaves as ``to_wire()`` (the msgpack map the
control channel carries: ``type`` plus the fields, optional ones only when set); the receiver
turns a map back into the object with ``parse`` (or ``parse_any`` for whatever one side may
receive), which checks every field once and raises :class:`MessageError` (a ValueError) naming
the first bad one. A peer's map is never read field by field anywhere else.

    decode -> prefill  Connect, Prefill, Cancel
    prefill -> decode  Connected, Refuse, CancelAck, Fail, PromptLogprobs, DoneAt, Draining;
                       every heartbeat carries a PrefillLoad (``load``)

Before these, the handshake's own (AUTH, PROOF, HELLO, REFUSE) and the heartbeat are
pdkv/control_wire.py's ``Auth``, ``Proof``, ``Hello``, ``Refuse`` (re-exported here: a prefill
node answers CONNECT with it too) and ``Heartbeat``, built and checked the same way.

What each field means is in pdkv/disagg/protocol.py's docstring. Fields a receiver can check only
against its link (page counts, the page size, the shard plan, the hand-off) come as ``limits``:
``Prefill.parse(msg, PrefillLimits(...))``. Adding a field: give it a default (an older peer
does not send it), write it in ``to_wire`` only when set, check it in ``parse``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from pdkv.control_wire import Refuse  # noqa: F401 - the handshake's REFUSE, also the answer to CONNECT
from pdkv.disagg.range_keys import RangeKeys

CONNECT, CONNECTED, REFUSE = "CONNECT", "CONNECTED", "REFUSE"
PREFILL, CANCEL, CANCEL_ACK, FAIL, DONE_AT = "PREFILL", "CANCEL", "CANCEL_ACK", "FAIL", "DONE_AT"
PROMPT_LOGPROBS, DRAINING = "PROMPT_LOGPROBS", "DRAINING"

MAX_REQ_ID = 256  # characters of a request id
_TOKEN_TOP = 2**31
_U64 = 2**64
_COUNT_TOP = 2**62  # anything larger is not a count a node could hold
PRIORITY_TOP = 2**31  # PREFILL's priority: a signed 32-bit value (senders clamp a larger one)


class MessageError(ValueError):
    """A control message that is not what its type says; the text names the field."""


# ---- field checks: each returns the value or raises MessageError naming ``name`` ------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v, name: str, lo: int, hi: int, what: str = "") -> int:
    if not _is_int(v) or not lo <= v < hi:
        raise MessageError(f"{name} must be {what or f'an integer in [{lo}, {hi})'}, got {v!r}"[:200])
    return v


def _req(v, name: str = "req") -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_REQ_ID:
        raise MessageError(f"{name} must be a non-empty string of at most {MAX_REQ_ID} characters")
    return v


def _text(v, name: str) -> str:
    if not isinstance(v, str):
        raise MessageError(f"{name} must be a string, got {type(v).__name__}")
    return v


def _bytes(v, name: str) -> bytes:
    if not isinstance(v, bytes):
        raise MessageError(f"{name} must be bytes")
    return v


def _ids(v, name: str, top: int, what: str, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list) or (not v and not allow_empty) or not all(_is_int(p) and 0 <= p < top for p in v):
        raise MessageError(f"{name} must be {what}")
    return tuple(v)


def _key(v) -> bool:
    return _is_int(v) and 0 <= v < _U64


class Message:
    """What every message has: its wire ``type`` and the two conversions."""

    TYPE: ClassVar[str]

    def to_wire(self) -> dict:
        raise NotImplementedError

    @classmethod
    def parse(cls, msg: dict):
        raise NotImplementedError


def _type_of(msg) -> str:
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise MessageError("a control message must be a map with a string 'type'")
    return msg["type"]


# ---- data-path set-up ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Connect(Message):
    """decode -> prefill, after HELLO: the data-path info and the regions' keys (one KV region
    key per decode rank: the prefill node checks their number against the shard plan,
    pdkv/disagg/sharded.py check_keys)."""

    TYPE: ClassVar[str] = CONNECT
    info: bytes
    kv_keys: tuple[int, ...]
    hidden_key: int
    spec_key: int | None = None  # the proposer cache's region with a speculative hand-off

    def to_wire(self) -> dict:
        out = {"type": CONNECT, "info": self.info, "kv_key": self.kv_keys[0], "kv_keys": list(self.kv_keys),
               "hidden_key": self.hidden_key}
        if self.spec_key is not None:
            out["spec_key"] = self.spec_key
        return out

    @classmethod
    def parse(cls, msg: dict, handoff: bool = False) -> "Connect":
        """``handoff``: this node streams a speculative hand-off, so spec_key is required."""
        keys = msg.get("kv_keys", [msg.get("kv_key")])  # an older decode node sent kv_key alone
        if not isinstance(keys, list) or not keys or not all(_key(k) for k in keys):
            raise MessageError(f"CONNECT kv_keys must be a non-empty list of non-negative integer keys, "
                               f"got {keys!r}"[:200])
        hidden_key = msg.get("hidden_key")
        if not _key(hidden_key):
            raise MessageError(f"CONNECT hidden_key must be a non-negative integer, got {hidden_key!r}"[:200])
        info = msg.get("info")
        if not isinstance(info, bytes):
            raise MessageError("CONNECT info must be bytes")
        spec_key = msg.get("spec_key")
        if (handoff or spec_key is not None) and not _key(spec_key):
            raise MessageError("CONNECT spec_key must be a non-negative integer"
                               + (" with a speculative hand-off" if handoff else "") + f", got {spec_key!r}"[:200])
        return cls(info, tuple(keys), hidden_key, spec_key)


@dataclass(frozen=True)
class Connected(Message):
    """prefill -> decode: the prefill side's data-path info (set-up complete there)."""

    TYPE: ClassVar[str] = CONNECTED
    info: bytes

    def to_wire(self) -> dict:
        return {"type": CONNECTED, "info": self.info}

    @classmethod
    def parse(cls, msg: dict) -> "Connected":
        return cls(_bytes(msg.get("info"), "CONNECTED info"))


# ---- requests -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GrantKeys:
    """The write keys of one request's granted ranges: the runs of pages, one key per (decode
    rank, layer, run) in that order, and the hidden row's key (None: no row, the proposer's).
    On the receiver, ``RangeKeys`` (pdkv/disagg/range_keys.py) is the same, checked and indexed."""

    runs: tuple[tuple[int, int], ...]
    keys: tuple[int, ...]
    hidden: int | None = None

    def wire(self, runs_field: str = "runs", keys_field: str = "kv_rkeys",
             hidden_field: str | None = "hidden_rkey") -> dict:
        """PREFILL's fields for these keys (the target's names by default; the proposer's are
        spec_runs / spec_rkeys, no hidden row)."""
        out = {runs_field: [list(r) for r in self.runs], keys_field: list(self.keys)}
        if hidden_field is not None:
            out[hidden_field] = self.hidden
        return out


@dataclass(frozen=True)
class PrefillLimits:
    """What a prefill node checks a PREFILL against: its link's and its own bounds."""

    num_pages: int | None = None  # the decode node's KV pages (HELLO extra.num_pages); None: 2**31
    page_size: int | None = None
    kv_ranks: int = 1  # the decode node's TP degree (one key per rank and layer and run)
    kv_layers: int = 1
    max_prompt_logprobs_tokens: int = 0
    handoff: str | None = None  # the speculative hand-off's method (mtp, draft), None: none
    spec_num_pages: int = 0  # the decode node's proposer cache's pages
    spec_layers: int = 0
    dp: int = 1  # the decode node's DP ranks (HELLO extra.dp): dp_rank must be below it


@dataclass(frozen=True)
class Prefill(Message):
    """decode -> prefill: compute ``tokens`` (the prompt less its last token) and write the KV
    of ``tokens[cached:]`` into ``pages``, the hidden row at ``hidden_off``; ``imm`` counts them.
    ``keys`` / ``spec_keys``: the granted ranges' write keys (None: CONNECT's region keys);
    ``spec_pages`` / ``next_token``: the speculative hand-off; ``prompt_logprobs`` /
    ``last_token``: echo + logprobs; ``priority``: the request's scheduler.policy priority (lower
    first), which a prefill node running the priority policy schedules by. Parsed, ``dst_keys`` /
    ``spec_dst_keys`` hold the checked RangeKeys of ``keys`` / ``spec_keys`` (not part of the
    message's value)."""

    TYPE: ClassVar[str] = PREFILL
    req: str
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    imm: int
    hidden_off: int
    seed: int
    cached: int = 0
    expected: int | None = None
    keys: GrantKeys | None = None
    spec_pages: tuple[int, ...] | None = None
    next_token: int | None = None
    spec_keys: GrantKeys | None = None
    prompt_logprobs: int | None = None
    last_token: int | None = None
    priority: int = 0
    dp_rank: int | None = None  # a decode DP group's rank whose pool the pages are in
    dst_keys: RangeKeys | None = field(default=None, compare=False, repr=False)
    spec_dst_keys: RangeKeys | None = field(default=None, compare=False, repr=False)

    def to_wire(self) -> dict:
        out = {"type": PREFILL, "req": self.req, "tokens": list(self.tokens), "cached": self.cached,
               "pages": list(self.pages), "imm": self.imm, "hidden_off": self.hidden_off, "seed": self.seed}
        if self.expected is not None:
            out["expected"] = self.expected
        if self.keys is not None:
            out.update(self.keys.wire("runs", "kv_rkeys", "hidden_rkey"))
        if self.spec_pages is not None:
            out["spec_pages"] = list(self.spec_pages)
        if self.next_token is not None:
            out["next_token"] = self.next_token
        if self.spec_keys is not None:
            out.update(self.spec_keys.wire("spec_runs", "spec_rkeys", None))
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"], out["last_token"] = self.prompt_logprobs, self.last_token
        if self.priority:
            out["priority"] = self.priority
        if self.dp_rank is not None:
            out["dp_rank"] = self.dp_rank
        return out

    @staticmethod
    def request_id(msg: dict) -> str:
        """The id a FAIL for a malformed PREFILL names (whatever was sent, as a bounded string)."""
        req = msg.get("req")
        return req if isinstance(req, str) else repr(req)[:64]

    @classmethod
    def parse(cls, msg: dict, limits: PrefillLimits | None = None) -> "Prefill":
        """Every field checked, in the order a refusal names the first bad one; ``limits``: the
        link's bounds (None: only the types and the generic ranges). ``page_size`` given,
        ``cached`` must be whole pages and ``pages`` exactly one page per page of
        ``tokens[cached:]`` (a short list would send writes past it)."""
        from pdkv.disagg.prompt_logprobs import MAX_LOGPROBS  # noqa: PLC0415
        from pdkv.shard import request_seed  # noqa: PLC0415

        lim = limits or PrefillLimits()
        req = _req(msg.get("req"))
        tokens = _ids(msg.get("tokens"), "tokens", _TOKEN_TOP, "a non-empty list of non-negative token ids")
        top = lim.num_pages if _is_int(lim.num_pages) and lim.num_pages > 0 else 2**31
        pages = _ids(msg.get("pages"), "pages", top, f"a non-empty list of page numbers in [0, {top})")
        if len(set(pages)) != len(pages):
            raise MessageError("pages must be distinct")
        imm = _int(msg.get("imm"), "imm", 0, 2**32)
        hidden_off = _int(msg.get("hidden_off"), "hidden_off", 0, 2**62)
        seed = msg.get("seed", request_seed(req))
        if not _is_int(seed):
            raise MessageError(f"seed must be an integer, got {seed!r}"[:200])
        cached = _int(msg.get("cached", 0), "cached", 0, len(tokens),
                      f"an integer in [0, {len(tokens)}) (the tokens sent)")
        if lim.page_size:
            if cached % lim.page_size:
                raise MessageError(f"cached must be a multiple of the page size {lim.page_size}, got {cached}")
            want = -(-len(tokens) // lim.page_size) - cached // lim.page_size
            if len(pages) != want:
                raise MessageError(f"pages must name {want} page(s) for tokens[{cached}:] of {len(tokens)} "
                                   f"tokens (page size {lim.page_size}), got {len(pages)}")
        expected = msg.get("expected")
        if expected is not None:
            _int(expected, "expected", 0, _COUNT_TOP)
        dst_keys = _range_keys(msg, pages, lim.kv_ranks, lim.kv_layers, "runs", "kv_rkeys", "hidden_rkey")
        dp_rank = msg.get("dp_rank")
        if dp_rank is not None:  # the keys name that rank's pool: without them nothing would
            dp_rank = _int(dp_rank, "dp_rank", 0, max(1, lim.dp),
                           f"an integer in [0, {max(1, lim.dp)}) (the decode node's DP ranks)")
            if dst_keys is None:
                raise MessageError("a PREFILL naming dp_rank must carry its ranges' write keys (runs, kv_rkeys)")
        lps = last = None
        if msg.get("prompt_logprobs") is not None:
            lps = _int(msg["prompt_logprobs"], "prompt_logprobs", 0, MAX_LOGPROBS + 1,
                       f"an integer in [0, {MAX_LOGPROBS}]")
            if len(tokens) + 1 > lim.max_prompt_logprobs_tokens:
                raise MessageError(f"prompt_logprobs: the prompt's {len(tokens) + 1} tokens exceed this prefill "
                                   f"node's server.max_prompt_logprobs_tokens {lim.max_prompt_logprobs_tokens}")
            last = _int(msg.get("last_token"), "last_token", 0, _TOKEN_TOP,
                        "a non-negative token id (with prompt_logprobs)")
        spec_pages = next_token = spec_dst = None
        if lim.handoff is not None:  # without a hand-off on this node its fields mean nothing
            if lim.handoff == "mtp":
                next_token = _int(msg.get("next_token"), "next_token", 0, _TOKEN_TOP,
                                  "a token id (the held-back last prompt token)")
            spec_pages = _ids(msg.get("spec_pages"), "spec_pages", lim.spec_num_pages,
                              f"{len(pages)} page numbers in [0, {lim.spec_num_pages})", allow_empty=True)
            if len(spec_pages) != len(pages):
                raise MessageError(f"spec_pages must be {len(pages)} page numbers in [0, {lim.spec_num_pages})")
            if len(set(spec_pages)) != len(spec_pages):
                raise MessageError("spec_pages must be distinct")
            # the proposer ranges' write keys (verbs: one MR each; tcp: the region's key)
            spec_dst = _range_keys(msg, spec_pages, 1, lim.spec_layers, "spec_runs", "spec_rkeys", None)
        priority = _int(msg.get("priority", 0), "priority", -PRIORITY_TOP, PRIORITY_TOP)
        return cls(req, tokens, pages, imm, hidden_off, seed, cached, expected,
                   _grant_keys(msg, dst_keys, "runs", "kv_rkeys", "hidden_rkey"), spec_pages, next_token,
                   _grant_keys(msg, spec_dst, "spec_runs", "spec_rkeys", None), lps, last, priority,
                   dp_rank, dst_keys=dst_keys, spec_dst_keys=spec_dst)


def _range_keys(msg, pages, ranks, layers, runs_field, keys_field, hidden_field) -> RangeKeys | None:
    import numpy as np  # noqa: PLC0415

    try:
        return RangeKeys.parse(msg, np.asarray(pages, dtype=np.int64), ranks, layers, runs_field=runs_field,
                               keys_field=keys_field, hidden_field=hidden_field)
    except MessageError:
        raise
    except ValueError as e:
        raise MessageError(str(e)) from None


def _grant_keys(msg, parsed: RangeKeys | None, runs_field, keys_field, hidden_field) -> GrantKeys | None:
    if parsed is None:
        return None
    return GrantKeys(tuple((r[0], r[1]) for r in msg[runs_field]), tuple(msg[keys_field]),
                     msg[hidden_field] if hidden_field is not None else None)


@dataclass(frozen=True)
class Cancel(Message):
    """decode -> prefill: stop ``req`` (the answer is CANCEL_ACK, FAIL or DONE_AT)."""

    TYPE: ClassVar[str] = CANCEL
    req: str

    def to_wire(self) -> dict:
        return {"type": CANCEL, "req": self.req}

    @classmethod
    def parse(cls, msg: dict) -> "Cancel":
        return cls(_req(msg.get("req")))


def _posted(msg: dict) -> int:
    return _int(msg.get("posted", 0), "posted", 0, _COUNT_TOP, "a non-negative count")


@dataclass(frozen=True)
class CancelAck(Message):
    """prefill -> decode: no write of ``req`` is in flight any more; ``posted`` of them went out
    (they landed or will)."""

    TYPE: ClassVar[str] = CANCEL_ACK
    req: str
    posted: int = 0

    def to_wire(self) -> dict:
        return {"type": CANCEL_ACK, "req": self.req, "posted": self.posted}

    @classmethod
    def parse(cls, msg: dict) -> "CancelAck":
        return cls(_req(msg.get("req")), _posted(msg))


@dataclass(frozen=True)
class Fail(Message):
    """prefill -> decode: the prefill node gave ``req`` up (its writes quiesced: ``posted`` went
    out). ``duplicate``: it refused a second PREFILL of ``req`` and kept the first job."""

    TYPE: ClassVar[str] = FAIL
    req: str
    reason: str
    posted: int = 0
    duplicate: bool = False

    def to_wire(self) -> dict:
        out = {"type": FAIL, "req": self.req, "reason": self.reason, "posted": self.posted}
        if self.duplicate:
            out["duplicate"] = True
        return out

    @classmethod
    def parse(cls, msg: dict) -> "Fail":
        return cls(_req(msg.get("req")), _text(msg.get("reason", ""), "reason")[:1000], _posted(msg),
                   msg.get("duplicate") is True)


@dataclass(frozen=True)
class DoneAt(Message):
    """prefill -> decode, metrics only: ``req``'s last forward pass ended at ``t_end`` (time.time);
    ``posted`` writes carrying ``bytes`` went out. The KV is ready when the decode side's count
    says so, never because of this message."""

    TYPE: ClassVar[str] = DONE_AT
    req: str
    t_end: float | None
    posted: int = 0
    bytes: int = 0

    def to_wire(self) -> dict:
        return {"type": DONE_AT, "req": self.req, "t_end": self.t_end, "posted": self.posted, "bytes": self.bytes}

    @classmethod
    def parse(cls, msg: dict) -> "DoneAt":
        t = msg.get("t_end")
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t)):
            raise MessageError(f"t_end must be a time in seconds, got {t!r}"[:200])
        nbytes = _int(msg.get("bytes", 0), "bytes", 0, _COUNT_TOP, "a non-negative count")
        return cls(_req(msg.get("req")), None if t is None else float(t), _posted(msg), nbytes)


@dataclass(frozen=True)
class PromptLogprobs(Message):
    """prefill -> decode, before DONE_AT when PREFILL asked: one TokenLogprob per prompt token
    after the first (pdkv/disagg/prompt_logprobs.py). ``parse`` checks them against what the
    decode node asked (the prompt, the alternatives)."""

    TYPE: ClassVar[str] = PROMPT_LOGPROBS
    req: str
    logprobs: tuple

    def to_wire(self) -> dict:
        return {"type": PROMPT_LOGPROBS, "req": self.req,
                "logprobs": [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in self.logprobs]}

    @classmethod
    def parse(cls, msg: dict, prompt: list[int], num_top: int) -> "PromptLogprobs":
        from pdkv.disagg.prompt_logprobs import check_entries  # noqa: PLC0415

        try:
            return cls(_req(msg.get("req")), tuple(check_entries(msg.get("logprobs"), prompt, num_top)))
        except MessageError:
            raise
        except ValueError as e:
            raise MessageError(str(e)) from None


@dataclass(frozen=True)
class Draining(Message):
    """prefill -> decode, about the link, not a request: the prefill node is draining (POST
    /admin/drain, SIGTERM) and takes no new PREFILL: choose another node (or prefill here). Sent
    to every connected decode node when the drain begins and on every link made after, so a
    fleet of static peers (no etcd to watch) hears it too. ``draining`` false: ready again."""

    TYPE: ClassVar[str] = DRAINING
    draining: bool = True

    def to_wire(self) -> dict:
        return {"type": DRAINING, "draining": self.draining}

    @classmethod
    def parse(cls, msg: dict) -> "Draining":
        v = msg.get("draining", True)
        if not isinstance(v, bool):
            raise MessageError(f"draining must be true or false, got {v!r}"[:200])
        return cls(v)


# ---- heartbeats ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillLoad:
    """What each of a prefill node's heartbeats carries (``load``, pdkv/disagg/load.py)."""

    queued_tokens: int = 0
    running: int = 0
    waiting: int = 0
    free_pages: int = 0
    seen: int = 0

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, raw) -> "PrefillLoad | None":
        """A heartbeat's ``load`` (None: it carries none, an older prefill node); unknown
        fields are ignored, missing ones are 0."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise MessageError(f"HEARTBEAT load must be a map, got {type(raw).__name__}")
        vals = {}
        for name in cls.__dataclass_fields__:
            vals[name] = _int(raw.get(name, 0), f"HEARTBEAT load.{name}", 0, _COUNT_TOP, "a non-negative integer")
        return cls(**vals)


def heartbeat_fields(load: PrefillLoad) -> dict:
    """What a prefill node adds to each heartbeat (pdkv.control ControlChannel.start_heartbeat
    ``payload``): its load."""
    return {"load": load.to_wire()}


# ---- receiving ------------------------------------------------------------------------------------
TO_PREFILL = {CONNECT: Connect, PREFILL: Prefill, CANCEL: Cancel}
TO_DECODE = {CONNECTED: Connected, REFUSE: Refuse, CANCEL_ACK: CancelAck, FAIL: Fail, DONE_AT: DoneAt,
             PROMPT_LOGPROBS: PromptLogprobs, DRAINING: Draining}


def request_id(msg: dict) -> str:
    """The request a message is about (``req``), checked: for a message whose other fields are
    checked later, against what its request asked (PROMPT_LOGPROBS)."""
    return _req(msg.get("req"))


def message_class(msg, table: dict) -> type:
    """The class of ``msg`` among ``table``'s (TO_PREFILL / TO_DECODE); MessageError naming the
    type otherwise."""
    kind = _type_of(msg)
    cls = table.get(kind)
    if cls is None:
        raise MessageError(f"unexpected control message type {kind[:40]!r}")
    return cls


def parse_any(msg, table: dict) -> Message:
    """``msg`` as its message object, for the messages that need no context to check (all but
    PREFILL and PROMPT_LOGPROBS, whose ``parse`` takes what they are checked against)."""
    return message_class(msg, table).parse(msg)
