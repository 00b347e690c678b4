"""The sparse mixture-of-experts MLP of Qwen3-MoE and DeepSeek-V3: a router, the routed experts
(grouped per expert, never looped per token) and DeepSeek's shared experts.

Routing, as transformers computes it:
- ``softmax`` (Qwen3-MoE): top-k of softmax(logits); ``norm_topk_prob`` renormalises the k weights.
- ``sigmoid`` (DeepSeek-V3, "noaux_tc"): scores = sigmoid(logits) in float32; selection uses
  scores + e_score_correction_bias, first keeping the ``topk_group`` best of ``n_group`` groups
  (a group scores the sum of its two best experts), then the top-k experts inside them; the
  weights are the *uncorrected* scores of the chosen experts, renormalised if ``norm_topk_prob``,
  times ``routed_scaling_factor``.

Experts are stored fused as in transformers 5.x: ``gate_up_proj`` [E_local, 2 * I, H] and
``down_proj`` [E_local, H, I]; the checkpoint's per-expert tensors
(``mlp.experts.{e}.gate_proj.weight`` ...) load into their rows (``param_for``).
Shapes: T tokens, H hidden, E experts, k experts per token, I an expert's intermediate size.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pdkv.models.config import ArchConfig
from pdkv.models.cpu_kernels import gated_mlp, linear, moe_one_token, route
from pdkv.models.fp8_load import expert_views
from pdkv.models.layers import MLP

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Router(nn.Module):
    """``mlp.gate``: weight [E, H] (float32 for sigmoid routing, as transformers keeps it)."""

    TRANSPOSED_PARAMS = ("weight",)  # a Linear's weight in all but name (models/loader.py)
    cpu_kernel = True  # False: torch's ops (the loader's model.cpu_kernels: false)

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype):
        super().__init__()
        m = cfg.moe
        self.moe = m
        wdtype = torch.float32 if m.scoring == "sigmoid" else dtype
        self.weight = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size, dtype=wdtype))
        if m.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(m.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] → (expert ids [T, k] long, weights [T, k] in x's dtype)."""
        m = self.moe
        if self.cpu_kernel and x.dtype == torch.float32:  # the ~15 ops below in one kernel call
            routed = route(linear(x, self.weight), m, self.e_score_correction_bias if m.correction_bias else None)
            if routed is not None:
                return routed
        if m.scoring == "softmax":
            probs = linear(x, self.weight).softmax(-1, dtype=torch.float32)  # [T, E]
            weights, ids = probs.topk(m.top_k, dim=-1)
            if m.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return ids, weights.to(x.dtype)
        scores = linear(x.float(), self.weight).sigmoid()  # [T, E] float32
        choice = scores + self.e_score_correction_bias if m.correction_bias else scores
        if m.num_groups > 1 and m.topk_groups < m.num_groups:
            T, G = x.shape[0], m.num_groups
            grouped = choice.view(T, G, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_scores.topk(m.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask[:, :, None], float("-inf")).view(T, -1)
        ids = choice.topk(m.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, (weights * m.routed_scaling_factor).to(x.dtype)


class Experts(nn.Module):
    # On the CPU the loader stores these [in, out] in memory (a transposed view of the [out, in]
    # shape, like every Linear: models/loader.py transpose_linear_weights).
    TRANSPOSED_PARAMS = ("gate_up_proj", "down_proj")
    FP8_PARAMS = TRANSPOSED_PARAMS  # block-quantized checkpoints: FP8 + scales (models/fp8_load.py)

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype):
        super().__init__()
        m = cfg.moe
        self.local = m.local_experts  # global ids of the experts this rank holds
        self.inter = m.intermediate_size  # this rank's share of it
        n = len(self.local)
        self.holds_all = n == m.num_experts  # no expert parallelism: no pair to filter out
        self.num_experts = m.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * self.inter, cfg.hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(n, cfg.hidden_size, self.inter, dtype=dtype))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; ids, weights: [T, k] → sum of weight * expert(x) over this rank's experts [T, H].

        The T * k (token, expert) pairs are sorted by expert, so each expert runs one GEMM over
        all of its tokens; the loop is over the experts that got tokens (at most E), never tokens."""
        if x.shape[0] == 1 and not self.force_grouped:
            return self._one_token(x, ids, weights)
        k = ids.shape[1]
        flat = ids.reshape(-1) - self.local.start  # [T * k] local expert id
        pairs = None
        if not self.holds_all:  # expert parallelism: drop the pairs routed to other ranks' experts
            pairs = ((flat >= 0) & (flat < len(self.local))).nonzero().squeeze(1)
            flat = flat[pairs]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.local)).tolist()
        pair = order if pairs is None else pairs[order]  # index into the T * k pairs
        tok = pair // k
        rows = x[tok]  # [N, H] grouped by expert
        out = torch.empty_like(rows)
        start, I = 0, self.inter
        gate_up, down = self._expert_views()
        for e, n in enumerate(counts):
            if n:  # up to 16 rows in one kernel call, the same per-row arithmetic as _one_token's
                out[start:start + n] = gated_mlp(rows[start:start + n], gate_up[e], down[e], I)
                start += n
        out *= weights.reshape(-1)[pair, None]
        return torch.zeros_like(x).index_add_(0, tok, out)

    # A one-token step (a batch-1 decode) reads k experts: there the grouping above (argsort,
    # bincount, a gather of rows, a scatter back, ~15 small ops and a .tolist() per layer) costs
    # more than the k GEMV pairs' launches. It runs the k experts straight from one .tolist(),
    # in ascending expert order and with the same float32 products and sums as the grouped
    # path's index_add_, so both give the same numbers (tests/models/test_moe_fast_path.py).
    # True: always group (the tests compare the two).
    force_grouped = False
    cpu_kernel = True  # False: the loop below (the loader's model.cpu_kernels: false)

    def _one_token(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [1, H]; ids, weights: [1, k] → [1, H]."""
        out, first = None, self.local.start
        if self.cpu_kernel:  # all k experts in one kernel call (models/cpu_kernels.py)
            out = moe_one_token(x, self.gate_up_proj.detach(), self.down_proj.detach(), ids, weights,
                                self.num_experts, first)
            if out is not None:
                return out
        gate_up, down = self._expert_views()
        for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist())):
            e -= first
            if 0 <= e < len(self.local):  # expert parallelism: other ranks add theirs
                y = gated_mlp(x, gate_up[e], down[e], self.inter).mul_(w)
                out = y if out is None else out.add_(y)  # the first: what 0 + y gives
        return torch.zeros_like(x) if out is None else out

    def run_sorted(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows: [N, H] grouped by local expert, ``counts[e]`` rows for local expert e → each
        row through its expert [N, H], unweighted (expert parallelism: the rows of every rank's
        tokens routed here; the caller weights and sums them where the tokens live)."""
        out = torch.empty_like(rows)
        start, I = 0, self.inter
        gate_up, down = self._expert_views()
        for e, n in enumerate(counts):
            if n:  # the grouped path's kernel calls, on the same rows
                out[start:start + n] = gated_mlp(rows[start:start + n], gate_up[e], down[e], I)
                start += n
        return out

    _views: tuple = (None, None, None)  # ((both storages), [gate_up_proj's E views], [down_proj's])

    def _expert_views(self) -> tuple[list, list]:
        """Each expert's two weights as views (a Python list index instead of a select per
        GEMV), rebuilt if the loader replaced the parameters' storage."""
        where = (self.gate_up_proj.data_ptr(), self.down_proj.data_ptr())
        if self._views[0] != where:
            self._views = (where, expert_views(self.gate_up_proj), expert_views(self.down_proj))
        return self._views[1], self._views[2]


class SparseMoE(nn.Module):
    """``mlp`` of a sparse layer: router, routed experts, optional shared experts."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, shared_intermediate: int | None = None):
        super().__init__()
        self.gate = Router(cfg, dtype)
        self.experts = Experts(cfg, dtype)
        shared = cfg.moe.shared_intermediate_size if shared_intermediate is None else shared_intermediate
        self.shared_experts = MLP(cfg, dtype, shared) if shared else None

    # Data parallelism with expert parallelism (pdkv/dp): ``dispatch(layer, x, ids, weights,
    # experts)`` sends each token to the ranks holding its top-k experts and returns the combined
    # routed output [T, H]; None: this rank's experts see only its own tokens (one rank, or TP).
    dispatch = None
    layer_index = -1  # this block's decoder layer (the dispatcher checks ranks agree on it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] → [T, H] (a partial sum under tensor parallelism, reduced by the layer)."""
        ids, weights = self.gate.forward(x)
        if self.dispatch is not None:
            out = self.dispatch(self.layer_index, x, ids, weights, self.experts)
        else:
            out = self.experts.forward(x, ids, weights)
        if self.shared_experts is not None:
            out += self.shared_experts.forward(x)
        return out


def expert_param_for(cfg: ArchConfig, name: str) -> tuple[str, tuple | None] | None:
    """``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` → (fused parameter, its index
    for expert E's rows), or None for any other name. Experts held by other ranks never get here
    (the loader skips them: ``is_remote_expert``)."""
    m = _EXPERT.search(name)
    if m is None:
        return None
    e = int(m.group(1)) - cfg.moe.local_experts.start
    if not 0 <= e < len(cfg.moe.local_experts):
        return name, None  # no such expert: the loader reports the unexpected tensor
    base = name[:m.start()] + ".mlp.experts."
    I = cfg.moe.intermediate_size
    part = m.group(2)
    if part == "down_proj":
        return base + "down_proj", (e,)
    return base + "gate_up_proj", (e, slice(0, I) if part == "gate_proj" else slice(I, 2 * I))


def is_remote_expert(cfg: ArchConfig, name: str) -> bool:
    """A routed expert of a layer this model has, held by another rank (expert parallelism)."""
    m = _EXPERT.search(name)
    return m is not None and int(m.group(1)) < cfg.moe.num_experts and int(m.group(1)) not in cfg.moe.local_experts


def expected_expert_tensors(cfg: ArchConfig, layer_prefix: str) -> set[str]:
    """The checkpoint names of every expert this rank holds in one layer (``model.layers.L``)."""
    return {f"{layer_prefix}.mlp.experts.{e}.{p}.weight" for e in cfg.moe.local_experts
            for p in ("gate_proj", "up_proj", "down_proj")}
