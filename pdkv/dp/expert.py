"""One rank's membership of a data-parallel group with expert parallelism: the process group,
the dispatcher every MoE block calls, and the forward count that keeps the ranks in lock step.

Built in each rank process (pdkv/dp/rank.py) before its model loads; the loader makes the
rank's ``ExpertLayout`` from ``rank`` / ``size`` and calls ``attach`` (models/loader.py), and the
model runner calls ``run_step`` before every forward pass (its ``followers`` hook), so each real
forward and each dummy one (``dummy_forward``) advances the same sequence number the
dispatcher's header carries.

tp x dp (``parallel: {dp: N, tp: M, ep: true}``): each DP rank is a TP-M engine whose followers
are ``python -m pdkv.dp.lane`` processes. TP rank t of every DP rank is rank ``dp_rank`` of
*lane* t, a dispatch group of its own (process-group prefix "pdkv-dp-lane{t}"; lane 0, the DP
rank processes, keeps "pdkv-dp"): lane t runs the all-to-all of its DP rank's tokens for the
t-th slice of every expert, and the layer's TP all-reduce then sums the slices (and the shared
experts' slices) once, as it does without DP. The DP rank's ``ExpertGroup`` leads its followers
(``lead``): every forward it announces, real or dummy, they run too, so every lane stays in step.
"""

from __future__ import annotations

import torch

from pdkv.dp.dispatch import AllToAllDispatcher
from pdkv.models.parallel import process_group


class ExpertGroup:
    def __init__(self, rank: int, size: int, store, device: torch.device, timeout_s: float, lane: int = 0,
                 store_addr: tuple[str, int, float] | None = None):
        """``lane``: this process's TP rank inside its DP rank (tp x dp); ``store_addr``: where
        ``store`` listens and its timeout, for the lanes' processes this rank's TP leader starts
        (``lane_init``)."""
        import torch.distributed as dist  # noqa: PLC0415

        if not dist.is_available():
            raise RuntimeError("parallel.dp > 1 needs torch.distributed, which this torch build lacks")
        self.rank, self.size, self.device, self.timeout_s = rank, size, device, timeout_s
        self.lane, self.store_addr = lane, store_addr
        prefix = "pdkv-dp" if lane == 0 else f"pdkv-dp-lane{lane}"
        self.pg = process_group(store, prefix, rank, size, device, timeout_s)  # as a TP group's
        self.leader = None  # tp x dp, on lane 0: this DP rank's pdkv.tp.TPLeader (``lead``)
        self.dispatcher: AllToAllDispatcher | None = None
        self.sparse: list = []  # (layer index, SparseMoE) of the attached model
        self.forwards = 0  # real forward passes
        self.dummies = 0  # forwards with no tokens of this rank's (the others had work)

    def attach(self, model) -> None:
        """Makes every MoE block of ``model`` route its tokens through the group's dispatcher."""
        from pdkv.models.moe import SparseMoE  # noqa: PLC0415

        moe = model.cfg.moe
        self.dispatcher = AllToAllDispatcher(self.pg, self.rank, self.size, moe.num_experts, self.device,
                                             self.timeout_s)
        self.hidden, self.top_k = model.cfg.hidden_size, moe.top_k
        self.dtype = model.model.embed_tokens.weight.dtype
        self.sparse = [(i, layer.mlp) for i, layer in enumerate(model.model.layers)
                       if isinstance(layer.mlp, SparseMoE)]
        for i, mlp in self.sparse:
            mlp.dispatch, mlp.layer_index = self.dispatcher, i

    def lane_init(self) -> dict:
        """What a lane follower needs to join its lane (pdkv/dp/lane.py), sent in its "init"."""
        host, port, timeout_s = self.store_addr
        return {"dp_rank": self.rank, "dp": self.size, "dp_host": host, "dp_port": port,
                "dp_store_timeout_s": timeout_s}

    def lead(self, leader) -> None:
        """tp x dp: ``leader`` (this DP rank's TPLeader) announces every forward to the lanes."""
        self.leader = leader

    @property
    def broken(self) -> Exception | None:
        """Why this rank cannot step again: its all-to-all failed, or one of its TP ranks did."""
        d = self.dispatcher.broken if self.dispatcher is not None else None
        return d or (self.leader.followers.error if self.leader is not None else None)

    def run_step(self, input_ids, positions, batch) -> None:
        """The model runner begins a forward pass (ModelRunner.followers)."""
        if self.leader is not None:
            self.leader.run_step(input_ids, positions, batch)
        self.dispatcher.seq += 1
        self.forwards += 1

    def dummy_forward(self) -> None:
        """A forward with no tokens: this rank joins every MoE layer's all-to-all (the others'
        tokens may be routed to its experts) and computes nothing else."""
        if self.broken is not None:
            raise self.broken
        if self.leader is not None:
            self.leader.run_dummy()
        d = self.dispatcher
        d.seq += 1
        self.dummies += 1
        with torch.inference_mode():
            for i, mlp in self.sparse:
                d.empty(i, self.hidden, self.top_k, self.dtype, mlp.experts)
