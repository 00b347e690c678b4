"""What prefill nodes may write on a decode node, and the grants that let them.

- **KV**: every rank's KV region registered with the transport (``NodeKV``), or with staging
  (``messenger.staging``, pdkv/disagg/staged.py) the landing ring the writes land in instead;
  the KV itself is then not registered and each request's slots are copied into its pages.
- **Hidden rows**: one row per remote request in flight, the hidden state of the prompt's
  next-to-last token (and, with a speculative hand-off, what the proposer needs of it).
- **Grants**: per request, the ranges one prefill node may write (pdkv/disagg/grants.py, or
  LandingGrants for the ring), revoked when the request's slot ends; with a hand-off, the
  proposer's pages too.

Built once at start by the decode coordinator, which owns everything here from then on. Each
remote request's share of it is a Reservation (pdkv/disagg/reservation.py), live in ``live``
from its PREFILL's sending until its ``release``; ``held`` counts the ranges granted per prefill
node (messenger.max_grants_per_peer).
"""

from __future__ import annotations

import torch

from pdkv.config import ConfigError
from pdkv.disagg import protocol as P
from pdkv.disagg.decode_connector import HiddenRows
from pdkv.disagg.grants import RequestGrants
from pdkv.disagg.reservation import Reservation
from pdkv.disagg.sharded import NodeKV
from pdkv.disagg.spec_handoff import DecodeHandoff, handoff_proposer, row_parts
from pdkv.disagg.staged import staging_mode
from pdkv.disagg.staged_decode import Landing, LandingGrants, build_landing
from pdkv.engine.loop import Wake
from pdkv.messenger import rank_keys


class DecodeMemory:
    def __init__(self, cfg, engine, messenger, metrics, commands):
        """``commands``: the engine loop's EngineLoop.put (Wake when a hidden row goes back: a
        waiting request may fit now; ReleasePages when a reservation ends)."""
        self.commands = commands
        self.later = None  # the event loop's call_later (set at start: revocations retried)
        self.live: dict[str, Reservation] = {}  # rid -> its reservation, from PREFILL until released
        self.held: dict[int, int] = {}  # prefill node id -> ranges granted to it now
        self.mode = staging_mode(cfg)  # ConfigError for a combination that cannot work here
        self.landing: Landing | None = None
        if self.mode.staged:  # writes land in the staging ring; the KV memory is not registered
            self.landing = self.kv = build_landing(cfg, self.mode, messenger, NodeKV(engine, messenger, register=False),
                                                   metrics)
        else:
            self.kv = NodeKV(engine, messenger)  # every rank's KV region, registered (one per rank)
        num_rows = max(64, 2 * cfg.scheduler.max_num_seqs * max(1, cfg.parallel.dp))  # a DP group: every rank's
        # what the prefill node prepares for this node's proposer (pdkv/disagg/spec_handoff.py)
        self.handoff = P.spec_handoff(cfg.speculative, engine)
        self.hidden_size = hidden = int(engine.loaded.arch.hidden_size)
        # [slots, hidden_size x parts]: h_{n-2}, and o_{n-2} of the MTP layer with its hand-off
        self.hidden = torch.zeros(num_rows, hidden * row_parts(self.handoff), dtype=engine.loaded.dtype)
        self.hidden_nbytes = self.hidden.shape[1] * self.hidden.element_size()
        self.hidden_key = messenger.register_address(self.hidden.data_ptr(), num_rows * self.hidden_nbytes)
        self.rows = HiddenRows(num_rows, on_free=lambda: commands(Wake()))
        if self.landing is not None:
            self.grants = LandingGrants(messenger, self.landing, rank_keys(messenger, self.hidden_key, 0),
                                        self.hidden_nbytes)
        else:
            # each rank's key on each of its NICs: a request's ranges are granted on the NIC its
            # seed picks, so landings spread over a rank's NICs (one NIC, tcp: its one key)
            self.grants = RequestGrants(messenger, self.kv.nic_keys, self.kv.geometry,
                                        rank_keys(messenger, self.hidden_key, 0), self.hidden_nbytes)
        # A DP group (pdkv/dp/remote.py): its regions are its ranks' pools, not TP shards of one
        # cache; a request's ranges are granted on its own rank's region only.
        self.dp = None
        if getattr(engine, "dp_regions", None) is not None:
            if self.landing is not None or P.spec_handoff(cfg.speculative, engine):
                raise ConfigError(f"{cfg.source}: a decode DP-EP group (parallel.dp={cfg.parallel.dp}) lands "
                                  "pages straight in its ranks' pools: no staging ring (messenger.staging) and "
                                  "no speculative hand-off")
            self.dp = [RequestGrants(messenger, [keys], self.kv.geometry, rank_keys(messenger, self.hidden_key, 0),
                                     self.hidden_nbytes) for keys in self.kv.nic_keys]
            self.grants = self.dp[0]  # counts, write keys and revokes are the same for every rank
        self.spec = self.spec_grants = None
        proposer = handoff_proposer(engine, self.handoff)
        if proposer is not None:
            self.spec = DecodeHandoff(proposer, messenger)
            self.spec_grants = RequestGrants(messenger, [self.spec.key], self.spec.geometry, self.hidden_key,
                                             self.hidden_nbytes)

    def reserve(self, rid: str, row: int) -> Reservation:
        """A request's reservation around its hidden row ``row`` (engine thread, at admit)."""
        return Reservation(rid, row, self)

    def hold(self, grantee: int, n: int) -> None:
        """``n`` more (or fewer) ranges granted to ``grantee`` (messenger.max_grants_per_peer)."""
        held = self.held.get(grantee, 0) + n
        if held > 0:
            self.held[grantee] = held
        else:
            self.held.pop(grantee, None)

    def _grants(self, dp_rank: int | None) -> RequestGrants:
        return self.grants if dp_rank is None else self.dp[dp_rank]

    def grants_needed(self, dst: list[int], spec_pages: list[int] | None, dp_rank: int | None = None) -> int:
        """How many ranges writing ``dst`` (and the proposer's ``spec_pages``) takes."""
        need = self._grants(dp_rank).count(dst)
        if spec_pages is not None:  # the proposer's ranges count too (no hidden row of their own)
            need += self.spec_grants.count(spec_pages) - 1
        return need

    def grant(self, grantee: int, dst: list[int], row: int, seed: int,
              spec_pages: list[int] | None, dp_rank: int | None = None) -> tuple[list, list]:
        """Grant ``grantee`` the request's pages and hidden row (and the proposer's pages): all
        or none (what was granted is revoked when a later grant fails, then the error raised).
        ``dp_rank``: a DP group's rank, whose pool alone holds the pages."""
        granted = self._grants(dp_rank).grant(grantee, dst, row, seed)
        spec_granted = []
        if spec_pages is not None:
            try:
                spec_granted = self.spec_grants.grant(grantee, spec_pages, None, seed)
            except BaseException:
                self.grants.revoke(grantee, granted)
                raise
        return granted, spec_granted
