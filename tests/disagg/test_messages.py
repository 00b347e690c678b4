"""The control messages (pdkv/disagg/messages.py): each one survives its wire form unchanged,
each bad field is refused naming that field, and an unknown type is refused naming the type.
(A hostile peer against a real node: tests/security/test_hostile_*.py.)"""

from __future__ import annotations

import math

import msgpack
import pytest

from pdkv.control import Auth, ControlError, Heartbeat, Hello, Proof, Refuse
from pdkv.disagg import messages as M
from pdkv.engine.request import TokenLogprob

LIMITS = M.PrefillLimits(num_pages=64, page_size=4, kv_ranks=2, kv_layers=2, max_prompt_logprobs_tokens=32)
SPEC_LIMITS = M.PrefillLimits(num_pages=64, page_size=4, kv_ranks=1, kv_layers=1, handoff="mtp", spec_num_pages=16,
                              spec_layers=1)
DP_LIMITS = M.PrefillLimits(num_pages=64, page_size=4, kv_ranks=2, kv_layers=2, dp=2)  # a decode DP2 group
PROMPT = [5, 6, 7, 8, 9]
LPS = (TokenLogprob(6, -1.0, ((6, -1.0), (2, -2.0))), TokenLogprob(7, -0.5, ()),
       TokenLogprob(8, -math.inf, ((3, -0.25),)), TokenLogprob(9, 0.0, ()))


def _prefill(**over) -> M.Prefill:
    base = dict(req="r1", tokens=(1, 2, 3, 4, 5, 6), pages=(7, 8), imm=3, hidden_off=512, seed=11, cached=0,
                expected=9, keys=M.GrantKeys(((7, 2),), (21, 22, 23, 24), 25))
    return M.Prefill(**{**base, **over})


def _wire(msg) -> dict:
    """What the control channel delivers: the map through msgpack and back (tuples become lists)."""
    return msgpack.unpackb(msgpack.packb(msg.to_wire(), use_bin_type=True), raw=False)


SAMPLES = [
    (M.Connect(b"info", (1, 2), 3), {}),
    (M.Connect(b"info", (1,), 3, spec_key=4), {"handoff": True}),
    (M.Connected(b"\x00\x01"), {}),
    (M.Refuse("no room"), {}),
    (M.Refuse("full", busy=True), {}),
    (_prefill(), {"limits": LIMITS}),
    (_prefill(cached=4, pages=(8,), keys=None, expected=None), {"limits": LIMITS}),
    (_prefill(prompt_logprobs=2, last_token=9), {"limits": LIMITS}),
    (_prefill(priority=-3), {"limits": LIMITS}),
    (_prefill(tokens=(1, 2, 3), pages=(7,), keys=None, spec_pages=(3,), next_token=4,
              spec_keys=M.GrantKeys(((3, 1),), (40,))), {"limits": SPEC_LIMITS}),
    (_prefill(dp_rank=1), {"limits": DP_LIMITS}),
    (M.Cancel("r1"), {}),
    (M.CancelAck("r1", 5), {}),
    (M.Fail("r1", "boom", 2), {}),
    (M.Fail("r1", "twice", 0, duplicate=True), {}),
    (M.DoneAt("r1", 12.5, 7, 1024), {}),
    (M.DoneAt("r1", None), {}),
    (M.PromptLogprobs("r1", LPS), {"prompt": PROMPT, "num_top": 2}),
    (M.Draining(), {}),
    (M.Draining(False), {}),
]


@pytest.mark.parametrize("msg,ctx", SAMPLES, ids=[f"{type(m).__name__}-{i}" for i, (m, _) in enumerate(SAMPLES)])
def test_round_trip(msg, ctx):
    wire = _wire(msg)
    assert wire["type"] == msg.TYPE
    cls = type(msg)
    assert cls.parse(wire, *ctx.values()) == msg
    if cls not in (M.Prefill, M.PromptLogprobs, M.Connect):  # those take what they are checked against
        table = M.TO_PREFILL if cls in M.TO_PREFILL.values() else M.TO_DECODE
        assert M.parse_any(wire, table) == msg


def test_parsed_prefill_holds_its_checked_keys():
    p = M.Prefill.parse(_wire(_prefill()), LIMITS)
    assert p.dst_keys is not None and p.dst_keys.keys == [[[21], [22]], [[23], [24]]] and p.dst_keys.hidden == 25
    assert M.Prefill.parse(_wire(_prefill(keys=None)), LIMITS).dst_keys is None  # the link's region keys


def test_prefill_dp_rank_is_below_the_decode_nodes_dp_and_comes_with_its_keys():
    wire = _wire(_prefill(dp_rank=2))
    with pytest.raises(M.MessageError, match=r"dp_rank must be an integer in \[0, 2\)"):
        M.Prefill.parse(wire, DP_LIMITS)
    with pytest.raises(M.MessageError, match=r"dp_rank must be an integer in \[0, 1\)"):
        M.Prefill.parse(_wire(_prefill(dp_rank=1)), LIMITS)  # a decode node that announced no DP layout
    no_keys = {k: v for k, v in _wire(_prefill(dp_rank=1)).items() if k not in ("runs", "kv_rkeys", "hidden_rkey")}
    with pytest.raises(M.MessageError, match="dp_rank must carry its ranges' write keys"):
        M.Prefill.parse(no_keys, DP_LIMITS)


def test_prefill_defaults_of_an_older_decode_node():
    from pdkv.shard import request_seed

    wire = {"type": "PREFILL", "req": "old", "tokens": [1, 2, 3], "pages": [0], "imm": 1, "hidden_off": 0}
    p = M.Prefill.parse(wire, LIMITS)
    assert (p.seed, p.cached, p.expected, p.keys, p.spec_pages, p.prompt_logprobs, p.priority,
            p.dp_rank) == (request_seed("old"), 0, None, None, None, None, 0, None)
    assert "priority" not in _prefill().to_wire()  # the common priority costs nothing on the wire


def test_priority_beyond_32_bits_is_clamped_in_order():
    from pdkv.disagg.decode_send import _wire_priority

    values = [-(2**40), -(2**31), -5, 0, 7, 2**31 - 1, 2**31, 2**50]
    clamped = [_wire_priority(v) for v in values]
    assert clamped == sorted(clamped) and clamped[1:6] == values[1:6]
    for v in clamped:  # each one a PREFILL the prefill node accepts
        assert M.Prefill.parse(_wire(_prefill(priority=v)), LIMITS).priority == v


# (message, field, bad value, words the error must hold); each row changes exactly one field
BAD = [
    (M.Connect(b"i", (1,), 2), "kv_keys", "1", "kv_keys"),
    (M.Connect(b"i", (1,), 2), "kv_keys", [-1], "kv_keys"),
    (M.Connect(b"i", (1,), 2), "hidden_key", True, "hidden_key"),
    (M.Connect(b"i", (1,), 2), "info", "text", "info"),
    (M.Connect(b"i", (1,), 2), "spec_key", -3, "spec_key"),
    (M.Connected(b"i"), "info", None, "info"),
    (_prefill(), "req", None, "req must be"),
    (_prefill(), "req", "x" * 300, "req must be"),
    (_prefill(), "tokens", [1, "x"], "tokens must be"),
    (_prefill(), "tokens", [], "tokens must be"),
    (_prefill(), "pages", [7, 64], "pages must be"),
    (_prefill(), "pages", [7, 7], "pages must be distinct"),
    (_prefill(), "pages", [7], "pages must name 2 page(s)"),
    (_prefill(), "imm", 2**32, "imm must be"),
    (_prefill(), "hidden_off", 1.5, "hidden_off must be"),
    (_prefill(), "seed", "7", "seed must be"),
    (_prefill(), "cached", 2, "cached must be a multiple of the page size 4"),
    (_prefill(), "cached", 6, "cached must be an integer in [0, 6)"),
    (_prefill(), "expected", -1, "expected must be"),
    (_prefill(), "runs", [[8, 1]], "page 7 is in no granted run"),
    (_prefill(), "kv_rkeys", [1], "kv_rkeys must be 4 keys"),
    (_prefill(), "hidden_rkey", "k", "hidden_rkey must be"),
    (_prefill(prompt_logprobs=1, last_token=9), "prompt_logprobs", 21, "prompt_logprobs must be"),
    (_prefill(prompt_logprobs=1, last_token=9), "last_token", -1, "last_token must be"),
    (_prefill(), "priority", 2**31, "priority must be"),
    (_prefill(), "priority", "high", "priority must be"),
    (M.Cancel("r"), "req", 5, "req must be"),
    (M.CancelAck("r", 1), "req", "", "req must be"),
    (M.CancelAck("r", 1), "posted", -1, "posted must be"),
    (M.Fail("r", "x"), "posted", "1", "posted must be"),
    (M.Fail("r", "x"), "reason", 5, "reason must be"),
    (M.DoneAt("r", 1.0), "t_end", "soon", "t_end must be"),
    (M.DoneAt("r", 1.0), "t_end", math.nan, "t_end must be"),
    (M.DoneAt("r", 1.0), "bytes", -5, "bytes must be"),
    (M.DoneAt("r", 1.0), "posted", True, "posted must be"),
    (M.Draining(), "draining", "yes", "draining must be"),
]


@pytest.mark.parametrize("msg,name,value,words", BAD, ids=[f"{type(m).__name__}.{n}-{i}"
                                                           for i, (m, n, _, _) in enumerate(BAD)])
def test_each_bad_field_is_named(msg, name, value, words):
    wire = {**_wire(msg), name: value}
    args = (LIMITS,) if isinstance(msg, M.Prefill) else ()
    with pytest.raises(M.MessageError) as e:
        type(msg).parse(wire, *args)
    assert words in str(e.value), e.value


SPEC_BAD = [
    ("next_token", 2**31, "next_token must be a token id"),
    ("next_token", None, "next_token must be a token id"),
    ("spec_pages", [16], "spec_pages must be 1 page numbers in [0, 16)"),
    ("spec_pages", [], "spec_pages must be 1 page numbers"),
    ("spec_runs", [[4, 1]], "spec_runs: page 3 is in no granted run"),
    ("spec_rkeys", [1, 2], "spec_rkeys must be 1 keys"),
]


@pytest.mark.parametrize("name,value,words", SPEC_BAD)
def test_each_bad_handoff_field_is_named(name, value, words):
    msg = _prefill(tokens=(1, 2, 3), pages=(7,), keys=None, spec_pages=(3,), next_token=4,
                   spec_keys=M.GrantKeys(((3, 1),), (40,)))
    with pytest.raises(M.MessageError) as e:
        M.Prefill.parse({**_wire(msg), name: value}, SPEC_LIMITS)
    assert words in str(e.value), e.value
    # a node without the hand-off reads none of its fields
    assert M.Prefill.parse({**_wire(msg), name: value}, LIMITS).spec_pages is None


def test_prompt_logprobs_are_checked_against_what_was_asked():
    wire = _wire(M.PromptLogprobs("r1", LPS))
    with pytest.raises(M.MessageError, match="must hold 3 entries"):
        M.PromptLogprobs.parse(wire, PROMPT[:4], 2)
    with pytest.raises(M.MessageError, match=r"top must hold at most 1 alternatives"):
        M.PromptLogprobs.parse(wire, PROMPT, 1)
    with pytest.raises(M.MessageError, match="req must be"):
        M.PromptLogprobs.parse({**wire, "req": None}, PROMPT, 2)


def test_load_round_trip_and_bad_field():
    load = M.PrefillLoad(queued_tokens=7, running=1, waiting=2, free_pages=30, seen=4)
    hb = Heartbeat.parse(msgpack.unpackb(msgpack.packb(Heartbeat(3.5, M.heartbeat_fields(load)).to_wire())))
    assert hb.t == 3.5 and M.PrefillLoad.parse(hb.fields["load"]) == load
    assert M.PrefillLoad.parse(None) is None  # a plain heartbeat (an older prefill node)
    with pytest.raises(M.MessageError, match=r"HEARTBEAT load\.running must be a non-negative integer"):
        M.PrefillLoad.parse({**load.to_wire(), "running": -1})
    with pytest.raises(M.MessageError, match="HEARTBEAT load must be a map"):
        M.PrefillLoad.parse([1])
    with pytest.raises(ValueError, match="HEARTBEAT t must be"):
        Heartbeat.parse({"type": "HEARTBEAT", "t": "noon"})


@pytest.mark.parametrize("table", [M.TO_PREFILL, M.TO_DECODE], ids=["to-prefill", "to-decode"])
def test_unknown_or_missing_type_is_refused(table):
    with pytest.raises(M.MessageError, match="unexpected control message type 'GOSSIP'"):
        M.parse_any({"type": "GOSSIP", "req": "r"}, table)
    with pytest.raises(M.MessageError, match="string 'type'"):
        M.parse_any({"req": "r"}, table)
    other = M.DONE_AT if table is M.TO_PREFILL else M.PREFILL  # the other direction's message
    with pytest.raises(M.MessageError, match=f"unexpected control message type '{other}'"):
        M.message_class({"type": other}, table)


def test_every_message_class_is_received_by_one_side():
    classes = {c for c in vars(M).values()
               if isinstance(c, type) and issubclass(c, M.Message) and c is not M.Message}
    received = set(M.TO_PREFILL.values()) | set(M.TO_DECODE.values())
    assert classes | {M.Refuse} == received  # REFUSE is the handshake's (pdkv.control_wire)
    assert all(cls.TYPE == kind for table in (M.TO_PREFILL, M.TO_DECODE) for kind, cls in table.items())


@pytest.mark.parametrize("msg", [Auth(b"n" * 32, True), Proof(b"mac"), Refuse("different models"),
                                 Refuse("full", busy=True)])
def test_handshake_messages_round_trip(msg):
    assert type(msg).parse(msgpack.unpackb(msgpack.packb(msg.to_wire()))) == msg


def test_handshake_messages_name_what_is_wrong():
    with pytest.raises(ControlError, match="no valid nonce"):
        Auth.parse({"type": "AUTH", "nonce": b"short", "secret": True})
    assert Refuse.parse({"type": "REFUSE", "reason": 5}).reason == "5"  # shown as sent, never a second error
    hello = Hello(node_id=3, role="decode", model_fingerprint="f", dtype="float32", kv_layout="HND", page_size=4)
    assert Hello.parse(msgpack.unpackb(msgpack.packb(hello.to_wire()))) == hello
    with pytest.raises(ControlError, match="invalid node_id"):
        Hello.parse({**hello.to_wire(), "node_id": 0})
    with pytest.raises(ControlError, match="lacks page_size"):
        Hello.parse({k: v for k, v in hello.to_wire().items() if k != "page_size"})
