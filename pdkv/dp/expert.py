"""One rank's membership of a data-parallel group with expert parallelism: the process group,
the dispatcher every MoE block calls, and the forward count that keeps the ranks in lock step.

Built in each rank process (pdkv/dp/rank.py) before its model loads; the loader makes the
rank's ``ExpertLayout`` from ``rank`` / ``size`` and calls ``attach`` (models/loader.py), and the
model runner calls ``run_step`` before every forward pass (its ``followers`` hook), so each real
forward and each dummy one (``dummy_forward``) advances the same sequence number the
dispatcher's header carries.
"""

from __future__ import annotations

import torch

from pdkv.dp.dispatch import AllToAllDispatcher
from pdkv.models.parallel import process_group


class ExpertGroup:
    def __init__(self, rank: int, size: int, store, device: torch.device, timeout_s: float):
        import torch.distributed as dist  # noqa: PLC0415

        if not dist.is_available():
            raise RuntimeError("parallel.dp > 1 needs torch.distributed, which this torch build lacks")
        self.rank, self.size, self.device, self.timeout_s = rank, size, device, timeout_s
        self.pg = process_group(store, "pdkv-dp", rank, size, device, timeout_s)  # as a TP group's
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

    def run_step(self, input_ids, positions, batch) -> None:
        """The model runner begins a forward pass (ModelRunner.followers)."""
        self.dispatcher.seq += 1
        self.forwards += 1

    def dummy_forward(self) -> None:
        """A forward with no tokens: this rank joins every MoE layer's all-to-all (the others'
        tokens may be routed to its experts) and computes nothing else."""
        d = self.dispatcher
        if d.broken is not None:
            raise d.broken
        d.seq += 1
        self.dummies += 1
        with torch.inference_mode():
            for i, mlp in self.sparse:
                d.empty(i, self.hidden, self.top_k, self.dtype, mlp.experts)
