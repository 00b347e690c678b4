"""What a prefill node's writes read from, and what tells the transport when to post them.

- **KV**: every rank's KV region registered with the transport (``NodeKV``), or with staging
  (``messenger.staging``, pdkv/disagg/staged.py) not registered: the pages are copied into the
  staging ring first (the coordinator's StagedSender) and written from there;
- **Hidden rows**: one staging row per admitted request, the hidden state of the prompt's
  next-to-last token (and, with a speculative hand-off, what the decode node's proposer needs
  of it), registered once; a request waiting for a row is woken when one goes back;
- **The layer counter**: bumped after each layer's o_proj; the transport posts a layer's page
  writes once it passes that layer (``watch``);
- **The speculative hand-off**: the proposer whose KV streams with the target's
  (pdkv/disagg/spec_handoff.py), or None.

The prefill counterpart of DecodeMemory (pdkv/disagg/decode_memory.py); built once at start
by the prefill coordinator, which owns everything here from then on.
"""

from __future__ import annotations

import torch

from pdkv.disagg import protocol as P
from pdkv.config import ConfigError
from pdkv.disagg.rows import StagingRows
from pdkv.disagg.sharded import NodeKV
from pdkv.disagg.spec_handoff import PrefillHandoff, handoff_proposer, row_parts
from pdkv.disagg.staged import staging_mode
from pdkv.messenger import rank_keys

NUM_HIDDEN_STAGING = 256  # hidden-state rows in flight at once (one per admitted request)


class PrefillMemory:
    def __init__(self, cfg, engine, messenger):
        from pdkv.gpu.layer_counter import make_layer_counter  # noqa: PLC0415 - GPU or CPU counter

        self.mode = staging_mode(cfg)  # ConfigError for a combination that cannot work here
        # every rank's KV region, registered (one per rank) unless the pages go through the ring
        # a write source only (never granted): on shm the pool then costs only the pages prefill
        # touches (with the shared hand-off hardly any), not a shared file of its whole size
        self.kv = NodeKV(engine, messenger, register=not self.mode.staged, source_only=True)
        # what this node prepares for its decode nodes' proposers (pdkv/disagg/spec_handoff.py)
        self.handoff = P.spec_handoff(cfg.speculative, engine)
        if self.kv.dp is not None and (self.mode.staged or cfg.disagg.kv_handoff == "share" or self.handoff):
            raise ConfigError(f"{cfg.source}: a prefill DP-EP group (parallel.dp={cfg.parallel.dp}) writes "
                              "pages straight from its ranks' pools: no staging ring (messenger.staging), "
                              "no shared hand-off (disagg.kv_handoff) and no speculative hand-off")
        hidden = int(engine.loaded.arch.hidden_size)
        self.staging = StagingRows(NUM_HIDDEN_STAGING, hidden * row_parts(self.handoff), engine.loaded.dtype)
        self.hidden_nbytes = self.staging.row_nbytes
        buf = self.staging.buffer
        self.staging_key = messenger.register_address(buf.data_ptr(), buf.numel() * buf.element_size(),
                                                      source_only=True)
        # the hidden row leaves through rank 0's NIC the seed picks, as rank 0's pages do
        self.staging_keys = rank_keys(messenger, self.staging_key, 0)
        self.counter = make_layer_counter(torch.device(cfg.model.device))
        self.watch = messenger.watch_address(self.counter.host_address)
        proposer = handoff_proposer(engine, self.handoff)
        self.spec = (PrefillHandoff(proposer, self.handoff, messenger, self.watch, engine.kv.page_size)
                     if proposer is not None else None)
