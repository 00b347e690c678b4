"""Tensor-parallel nodes on the data path: every rank's KV region registered in rank 0's
messenger, and the shard plan a link agrees on in its handshake.

A node of any TP degree (pdkv/tp) offers, in its HELLO's ``extra``, its ShardSpec
(``shard``: TP degree + KV geometry). After the HELLO each side builds the same ShardPlan from the
two specs (``pdkv.shard.plan_specs``, prefill spec first); a combination the planner cannot serve
is refused, naming both sides' TP degrees and the reason (the prefill side answers REFUSE instead
of CONNECTED; the decode side raises HandshakeRefused before it sets anything up).

Regions: one per rank, by rank (``pdkv.tp.kv_regions``); rank r's memory is registered as key
``keys[r]``. The decode node sends its keys in CONNECT (``kv_keys``), so the prefill node posts
the writes of pair (p, d) from its ``keys[p]`` to the peer's ``kv_keys[d]``.

Queue pairs (verbs over several NICs): each HELLO also says which NICs carry each rank's pages
(``rank_nics``: per rank, indices into the node's NIC list); both sides derive from the plan the
(local NIC, peer NIC) pairs a write can use (``link_pairs``) and make QPs for those only. TP8 ->
TP8 with a NIC per rank: 8 pairs, not 64; TP8 -> TP1 replicated: every prefill NIC x the decode
rank's NICs (the seeded choice may pick any).
"""

from __future__ import annotations

from pdkv.control import HandshakeRefused
from pdkv.disagg.writes import Geometry
from pdkv.messenger import rank_key, rank_keys
from pdkv.shard import ShardPlan, ShardPlanError, ShardSpec, plan_specs
from pdkv.tp import kv_regions, shard_spec


class NodeKV:
    """This node's KV memory as the messenger sees it: every rank's region, registered (a DP
    group: every DP rank's pool, ``dp`` its layout; else ``dp`` is None)."""

    def __init__(self, engine, messenger, register: bool = True, source_only: bool = False):
        """``register``: False when the pages travel through a staging ring (pdkv/disagg/staged.py):
        then no write may name the KV memory itself (``keys`` is empty). ``source_only``: the
        regions are only written from, never granted (a prefill node's pool when its pages are
        copied): the shm transport then leaves them private memory that is allocated as it is
        touched, instead of a shared file of the whole pool."""
        self.regions = kv_regions(engine)
        self.spec: ShardSpec = shard_spec(engine)
        self.dp = dp_layout(engine)
        # NOTE: every rank has the same pages and shapes, so one Geometry describes each region.
        self.geometry = Geometry.of(self.regions[0].cache)
        # rank r's key names the NIC that carries rank r's pages (verbs over several NICs; the
        # region itself is registered on every NIC): the decode node's keys pick where pages land.
        # Staged (register False): no write may name the KV memory itself, no keys.
        regs = [_register(messenger, r, source_only) for r in self.regions] if register else []
        self.keys = [rank_key(messenger, k, rank) for rank, k in enumerate(regs)]
        # a rank near several NICs has a key on each (an int when one), and the request's seed
        # picks one per request (pdkv.shard.pick_nic): as a source (prefill) the NIC its writes
        # leave through; as a destination (decode) the NIC its ranges are granted on, so the
        # request lands there (pdkv/disagg/grants.py)
        self.nic_keys = [rank_keys(messenger, k, rank) for rank, k in enumerate(regs)]


def _register(messenger, region, source_only: bool = False) -> int:
    """Host memory as it is; GPU memory (pdkv.disagg.staged.StagingMode.GPUDIRECT) through the
    messenger's GPUDirect registration (dma-buf, else nvidia-peermem: pdkv.gpu.gpudirect)."""
    if str(region.device).startswith("cuda"):
        from pdkv.gpu.gpudirect import register_on_messenger  # noqa: PLC0415 - GPU hosts only

        index = int(str(region.device).split(":", 1)[1]) if ":" in str(region.device) else 0
        return register_on_messenger(messenger, region.address, region.nbytes, index).key
    return messenger.register_address(region.address, region.nbytes, source_only=source_only)


def dp_layout(engine) -> dict | None:
    """A data-parallel group's layout as HELLO's ``extra.dp`` carries it (None: not a DP group)."""
    regions = getattr(engine, "dp_regions", None)
    return None if regions is None else {"size": len(regions), "ep": True}


def dp_size(extra) -> int:
    """The DP ranks a peer's HELLO ``extra`` announces (1: none); HandshakeRefused if malformed."""
    dp = extra.get("dp") if isinstance(extra, dict) else None
    if dp is None:
        return 1
    size = dp.get("size") if isinstance(dp, dict) else None
    if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 1024) or dp.get("ep") is not True:
        raise HandshakeRefused(f"the peer's HELLO dp must be {{'size': 1..1024, 'ep': true}}, got {dp!r:.200}")
    return size


def _layout(tp, dp: int) -> str:
    return f"dp={dp} ep (tp={tp} per rank)" if dp > 1 else f"tp={tp}"


def _dp_sides(local_dp: dict | None, local_role: str, peer_extra: dict) -> tuple[int, int]:
    """(prefill DP ranks, decode DP ranks) of a link; 1: that side is not a DP group."""
    mine, theirs = (int(local_dp["size"]) if local_dp else 1), dp_size(peer_extra)
    return (mine, theirs) if local_role == "prefill" else (theirs, mine)


def check_dp(local_tp: int, local_dp: dict | None, local_role: str, peer_extra: dict) -> None:
    """A pair's DP layouts. Every DP rank is a TP1 engine holding its own requests' whole KV (the
    MLA latent), so a DP side pairs with any layout the way one TP1 node would: a prefill rank
    writes the pages of the requests placed on it (the plan's prefill rank 0, from its own
    pool), a decode rank takes those of the requests it decodes (PREFILL names it). A DP side
    whose ranks are not tp=1 is refused, naming both layouts (HandshakeRefused)."""
    wire = peer_extra.get("shard") if isinstance(peer_extra, dict) else None
    peer_tp = wire.get("tp") if isinstance(wire, dict) else "?"
    pre_dp, dec_dp = _dp_sides(local_dp, local_role, peer_extra)
    pre_tp, dec_tp = (local_tp, peer_tp) if local_role == "prefill" else (peer_tp, local_tp)
    pre, dec = (pre_dp, pre_tp), (dec_dp, dec_tp)
    for side, (dp, tp) in (("prefill", pre), ("decode", dec)):
        if dp > 1 and tp != 1:
            raise HandshakeRefused(f"cannot transfer KV from prefill {_layout(pre[1], pre[0])} to decode "
                                   f"{_layout(dec[1], dec[0])}: a {side} DP rank must be tp=1")


def plan_link(local: ShardSpec, local_role: str, peer_extra: dict, local_dp: dict | None = None) -> ShardPlan:
    """The link's plan from this node's spec and the peer's HELLO ``extra``; HandshakeRefused
    naming both TP degrees and the reason if the planner cannot serve the pair, or both DP
    layouts if those cannot pair (``local_dp``: this node's, dp_layout)."""
    check_dp(local.tp, local_dp, local_role, peer_extra)
    peer_role = "decode" if local_role == "prefill" else "prefill"
    wire = peer_extra.get("shard") if isinstance(peer_extra, dict) else None
    peer_tp = wire.get("tp") if isinstance(wire, dict) else None
    tps = {local_role: local.tp, peer_role: peer_tp}
    try:
        if wire is None:
            raise ShardPlanError(f"the {peer_role} node sent no shard spec in its HELLO")
        peer = ShardSpec.from_wire(wire, role=peer_role)
        return plan_specs(local, peer) if local_role == "prefill" else plan_specs(peer, local)
    except ShardPlanError as e:
        raise HandshakeRefused(f"cannot transfer KV from prefill tp={tps['prefill']} to decode "
                               f"tp={tps['decode']}: {e}") from None


MAX_NICS = 16  # a verbs transport's NIC limit (pdkv/csrc/transport.h PDKV_MAX_NICS)


def hello_rank_nics(messenger) -> dict:
    """The HELLO ``extra`` field that tells the peer where this node's ranks' pages travel
    (verbs over several NICs: the messenger's placement; nothing on tcp/fake)."""
    per_rank = getattr(messenger, "rank_nics", ()) or ()
    return {"rank_nics": [list(r) for r in per_rank]} if per_rank else {}


def link_pairs(plan: ShardPlan, local_role: str, messenger, peer_extra: dict,
               local_dp: dict | None = None) -> list[tuple[int, int]] | None:
    """The (local NIC, peer NIC) index pairs this link's writes can use: for every pair of
    ranks (p, d) the plan may use (any seed), each NIC of prefill rank p x each NIC of decode
    rank d (the seed picks one of each), and (0, 0) (keys named as registered: NIC 0 is rank 0's
    first). A DP side (``local_dp``, the peer's HELLO dp) is the plan's rank 0 on each of its
    ranks' NICs: a request leaves from (or lands on) the NICs of the rank it was placed on.
    None (QPs for every pair) when either side has no rank placement (tcp, a single path).
    HandshakeRefused when the peer's ``rank_nics`` is malformed."""
    local = getattr(messenger, "rank_nics", ()) or ()
    wire = peer_extra.get("rank_nics") if isinstance(peer_extra, dict) else None
    if not local or wire is None:
        return None
    ok = (isinstance(wire, list) and 0 < len(wire) <= 1024 and all(
        isinstance(r, list) and 0 < len(r) <= MAX_NICS and all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_NICS for n in r) for r in wire))
    if not ok:
        raise HandshakeRefused(f"the peer's HELLO rank_nics must be a list of per-rank lists of NIC indices "
                               f"0..{MAX_NICS - 1}, got {wire!r:.200}")
    pre, dec = (local, wire) if local_role == "prefill" else (wire, local)
    pre_dp, dec_dp = _dp_sides(local_dp, local_role, peer_extra)

    def nics(side: list, rank: int, dp: int) -> set[int]:
        ranks = range(dp) if dp > 1 else (rank,)
        return {n for r in ranks for n in side[r % len(side)]}
    used = {(0, 0)}
    for p, d in {(pp.prefill_rank, pp.decode_rank) for pp in plan.pairs} | {(0, 0)}:  # + the hidden row
        used |= {(i, j) for i in nics(pre, p, pre_dp) for j in nics(dec, d, dec_dp)}
    return sorted(used if local_role == "prefill" else {(j, i) for i, j in used})


def check_keys(plan: ShardPlan, keys, dp: int = 1) -> list[int]:
    """The decode node's region keys from CONNECT: one int per decode rank (a DP group: per DP
    rank, each rank's pool; its PREFILLs name the rank and carry their ranges' keys)."""
    want = plan.decode.tp * dp
    if not isinstance(keys, list) or len(keys) != want or not all(isinstance(k, int) for k in keys):
        raise HandshakeRefused(f"decode node sent kv_keys {keys!r}; expected {want} integer key(s), "
                               f"one per decode rank")
    return keys
