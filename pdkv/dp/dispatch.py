"""Expert-parallel dispatch and combine: each rank's tokens go to the ranks holding their top-k
routed experts, and the experts' outputs come back to be weighted and summed where the tokens
live (data-parallel attention with expert-parallel MoE, pdkv/dp/group.py).

The seam is ``Dispatcher``: ``dispatcher(layer, x, ids, weights, experts) -> routed output`` is
what a MoE block calls instead of running its experts on its own tokens (models/moe.py
``SparseMoE.dispatch``), and ``empty(layer, ...)`` is a rank with no tokens taking part anyway.
``AllToAllDispatcher`` does it with two ``torch.distributed`` all-to-alls per direction step
(gloo on the CPU, NCCL on GPUs); DeepEP's or pplx's kernels would be other implementations of
the same call.

Per MoE layer, on every rank of the group (all ranks call it for every layer of every forward,
a rank with no work with zero tokens: the lock step):

1. *Header* (all-to-all of int64, ``per + 2`` values to each rank): for each destination rank,
   how many (token, expert) pairs go to each of its ``per = E / N`` experts, then this forward's
   sequence number and the layer index. Every rank thus knows exactly how many rows it will
   receive from whom (buffers sized exactly, no padding to a worst case), and a rank that is not
   where the others are (a different forward or layer: the group is out of step) is caught and
   named instead of silently mixing rows of two layers.
2. *Dispatch*: the pairs sorted by expert id (stable), so the rows for rank d are contiguous and
   grouped by d's local expert: one all-to-all of [pairs, H] rows with those split sizes.
3. The receiving rank regroups the rows of all sources by local expert and runs each expert once
   over all of them (``Experts.run_sorted``, the grouped path's kernels).
4. *Combine*: the outputs go back by the reverse split; the source weights each pair's row by its
   router weight and sums them per token in ascending expert order, the same products and the
   same summation order as one rank's grouped path (``Experts.forward``), which is why DP-EP
   gives the greedy tokens of a one-rank engine.

A collective that fails (a rank died, or one waited longer than ``parallel.timeout_s``) leaves
the ranks out of step: the dispatcher is then broken and every later call fails at once.
"""

from __future__ import annotations

import time

import torch

from pdkv.errors import PdkvError


class DispatchError(PdkvError, RuntimeError):
    """An expert-parallel all-to-all failed or the ranks were out of step; the message says which."""


class Dispatcher:
    """What a MoE block calls to have its tokens' routed experts run wherever they live."""

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 experts) -> torch.Tensor:
        """x: [T, H]; ids, weights: [T, k] (global expert ids) → routed output [T, H]."""
        raise NotImplementedError

    def empty(self, layer: int, hidden: int, top_k: int, dtype: torch.dtype, experts) -> None:
        """This rank has no tokens in this forward but must take part (the others may send it rows)."""
        x = torch.empty(0, hidden, dtype=dtype, device=self.device)
        self(layer, x, torch.empty(0, top_k, dtype=torch.long, device=self.device),
             torch.empty(0, top_k, dtype=dtype, device=self.device), experts)


class AllToAllDispatcher(Dispatcher):
    """All-to-all over a torch.distributed process group (gloo or NCCL) of ``size`` ranks, rank
    r holding routed experts [r * E / size, (r + 1) * E / size)."""

    def __init__(self, pg, rank: int, size: int, num_experts: int, device: torch.device,
                 timeout_s: float):
        if num_experts % size:
            raise ValueError(f"parallel.dp={size} must divide the {num_experts} routed experts")
        self.pg, self.rank, self.size, self.device = pg, rank, size, device
        self.num_experts, self.per = num_experts, num_experts // size
        self.timeout_s = timeout_s
        self.seq = 0  # forwards this rank began (real or dummy); every rank must agree per layer
        self.broken: DispatchError | None = None
        # Measurements: seconds in the collectives and in the whole dispatch, pairs moved.
        self.comm_s = 0.0
        self.total_s = 0.0
        self.pairs_sent = 0
        self.pairs_received = 0
        # When set to a list, every call appends (seq, layer, [pairs sent to each (rank, local
        # expert)] flattened by global expert id, [rows received from each rank]) for tests.
        self.record: list | None = None

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, what: str, layer: int) -> None:
        t0 = time.perf_counter()
        try:
            self.pg.alltoall_base(out, inp, list(out_splits), list(in_splits)).wait()
        except Exception as e:
            self.broken = DispatchError(
                f"expert-parallel all-to-all ({what}, layer {layer}, forward {self.seq}) failed on dp rank "
                f"{self.rank}: {e}; the ranks are out of step (parallel.timeout_s={self.timeout_s:g}) and "
                "this group cannot run further steps")
            raise self.broken from e
        self.comm_s += time.perf_counter() - t0

    def __call__(self, layer, x, ids, weights, experts):
        if self.broken is not None:
            raise self.broken
        t0 = time.perf_counter()
        T, k = ids.shape
        N, per = self.size, self.per
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # pairs by expert: contiguous per rank, per local expert
        tok = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).view(N, per)
        header = torch.empty(N, per + 2, dtype=torch.long)
        header[:, :per] = counts.cpu()
        header[:, per] = self.seq
        header[:, per + 1] = layer
        got = torch.empty_like(header)
        hdr_dev = header.to(self.device)  # NCCL needs device tensors; gloo takes these as they are
        got_dev = got.to(self.device)
        self._a2a(got_dev, hdr_dev, [1] * N, [1] * N, "header", layer)  # one row of per + 2 each
        got = got_dev.cpu()
        bad = [r for r in range(N) if int(got[r, per]) != self.seq or int(got[r, per + 1]) != layer]
        if bad:
            where = ", ".join(f"rank {r} at forward {int(got[r, per])} layer {int(got[r, per + 1])}" for r in bad)
            self.broken = DispatchError(f"expert-parallel ranks out of step: dp rank {self.rank} is at forward "
                                        f"{self.seq} layer {layer}, {where}; this group cannot run further steps")
            raise self.broken
        recv_counts = got[:, :per]  # [source rank, local expert] rows coming here
        send_splits = counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        if self.record is not None:
            self.record.append((self.seq, layer, counts.reshape(-1).tolist(), recv_splits))
        H = x.shape[1]
        rows = x[tok]  # [T * k, H], grouped by destination rank, then by its local expert
        recv = torch.empty(sum(recv_splits), H, dtype=x.dtype, device=x.device)
        self._a2a(recv, rows, recv_splits, send_splits, "dispatch", layer)
        # Regroup the sources' rows by local expert (each source's rows are already by expert).
        local = torch.arange(per).repeat(N)
        expert_of = torch.repeat_interleave(local, recv_counts.reshape(-1)).to(x.device)
        perm = expert_of.argsort(stable=True)
        done = torch.empty_like(recv)
        if recv.shape[0]:
            done[perm] = experts.run_sorted(recv[perm], recv_counts.sum(0).tolist())
        back = torch.empty_like(rows)
        self._a2a(back, done, send_splits, recv_splits, "combine", layer)
        back *= weights.reshape(-1)[order, None]
        self.pairs_sent += T * k
        self.pairs_received += recv.shape[0]
        out = torch.zeros_like(x).index_add_(0, tok, back)
        self.total_s += time.perf_counter() - t0
        return out
