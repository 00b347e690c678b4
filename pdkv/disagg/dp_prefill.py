"""The prefill connector of a node whose engine is a data-parallel group (pdkv/dp/group.py): the
group's front calls it in the engine thread while the ranks compute; the node's one messenger,
links and job table stay here, each rank's own connector (pdkv/dp/remote.py
RankPrefillConnector) only computes and counts.

- a PREFILL becomes an AddRequest as on a TP1 node; the group places it on a rank by load and
  prefix affinity (the endpoint's rule), and that rank computes its prompt into its own pool
  (a shared-memory file mapped here, registered as that rank's region, pdkv/disagg/sharded.py);
- ``note(rank, RankChunks)``: before each forward of that rank, its prefill chunks; their
  complete pages are queued exactly as a TP1 node queues its own (PrefillConnector.queue_writes,
  the same per-layer targets and immediates), on the layer counter of that rank, which the rank
  bumps in shared memory after each layer: the C poller posts layer l once that rank passed it;
- ``note(rank, RankHidden)``: after the forward, each finished prompt's last hidden row, sent
  from one of the node's staging rows (taken now; none free fails the job);
- ``group_failed``: a rank died, so its counter never moves again: every rank's counter is
  unwatched, which ends the writes still queued on it (batch_done -ECANCELED), and the jobs
  end with FAIL once the group's final outputs reach the coordinator; nothing waits forever.
"""

from __future__ import annotations

from pdkv.engine.connector import ForwardBatch


class DPPrefillConnector:
    def __init__(self, connector, messenger, group):
        """``connector``: the node's PrefillConnector (job table, staging rows, plan of writes)."""
        self.connector, self.m = connector, messenger
        # rank r's pool is, to its writes, a TP1 node's one region: the plan's prefill rank 0
        self.lkeys = [[keys] for keys in connector.kv.nic_keys]
        self.watches = [messenger.watch_address(address) for address in group.pools.counters]

    def route(self, num_prompt_tokens: int) -> bool:
        return False  # the rank's own connector makes every request prefill-only

    def note(self, rank: int, note) -> None:
        from pdkv.dp.remote import RankChunks  # noqa: PLC0415

        c = self.connector
        if isinstance(note, RankChunks):
            c.queue_writes(ForwardBatch(note.entries, 0), note.base, self.watches[rank], self.lkeys[rank])
        else:  # RankHidden
            c.t_forward_end = note.t_end
            c.send_hidden((rid, row, None) for rid, row in note.rows)

    def finished(self, rid: str, reason: str) -> None:
        pass  # the coordinator cancels the job (AbortRequest came from it)

    def group_failed(self, error) -> None:
        for w in self.watches:
            self.m.unwatch(w)
        self.watches = []
