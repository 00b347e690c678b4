"""Tensor parallelism for the GQA families: which slice of every checkpoint tensor a rank holds,
and the all-reduce that sums the row-parallel outputs.

Megatron-style split, the same as vLLM's for Llama-shaped models:

- ``qkv_proj`` (column parallel): rank r holds query heads [r * Hq/tp, (r + 1) * Hq/tp) and the KV
  heads ``ShardSpec.heads_of(r)`` (pdkv/shard/spec.py: with fewer KV heads than ranks a head is
  replicated on tp / Hkv ranks, rank r holding head r // (tp / Hkv)). Query head j reads KV head
  j // (Hq / Hkv), so a rank's query heads always read KV heads it holds.
- ``o_proj`` (row parallel): the input columns of the rank's query heads; the partial outputs
  [T, H] are summed across ranks (all-reduce), and only rank 0 adds the bias.
- ``gate_up_proj`` (column parallel) / ``down_proj`` (row parallel): intermediate rows
  [r * I/tp, (r + 1) * I/tp), all-reduce after ``down_proj``.
- Embeddings, norms, q/k norms (Qwen3, per head_dim) and ``lm_head`` are replicated. The LM head
  is replicated rather than vocab-parallel because only rank 0 samples: the other ranks never
  compute logits, so a vocab split would add a gather and save nothing.

MoE and MLA (Qwen3-MoE, DeepSeek-V3; docs/TP.md says why):

- Routed and shared experts split like the dense MLP, each expert's intermediate rows
  [r * I/tp, (r + 1) * I/tp) on rank r (vLLM's default for these models): every rank runs every
  selected expert on a slice, so the work per token is even whatever the router picks, and the
  one all-reduce after the MLP is the dense one. The router is replicated: every rank sees the
  same all-reduced hidden state and picks the same experts. ``expert_parallel=True`` instead
  gives rank r whole experts [r * E/tp, (r + 1) * E/tp) (E must divide by tp).
- Inside a data-parallel rank (``dp`` > 1, ``dp_rank``: tp x dp, pdkv/dp/lane.py): the routed
  experts are first split whole across the DP ranks (``ExpertLayout``), and the DP rank's experts
  are then sliced across its TP ranks as above; attention and shared experts split as without DP.
- MLA: q_proj / q_b_proj rows and kv_b_proj rows split by head (each rank decompresses its own
  heads from the same latent), o_proj columns by head; q_a_proj, kv_a_proj_with_mqa and their
  norms are replicated, so every rank computes and caches the whole latent (the shard spec says
  "replicated": every rank is a replica set of its own).

A rank's model is built from ``local_arch`` (its head and intermediate counts), so the layers,
the attention backend and the KV cache need no TP knowledge; ``shard_tensor`` slices each
checkpoint tensor before the loader copies it in.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch

from pdkv.models.config import ArchConfig
from pdkv.shard.spec import ShardSpec


class TensorParallelError(ValueError):
    """A model that cannot be split ``tp`` ways; the message names the count that does not divide."""


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """Where rank ``rank`` of ``tp`` sits in the full model (all counts global unless *_local)."""

    rank: int
    tp: int
    arch: ArchConfig  # the checkpoint's full config
    expert_parallel: bool = False  # MoE: whole experts per rank instead of a slice of each
    dp: int = 1  # the data-parallel group this TP group is one rank of (its experts: ExpertLayout's)
    dp_rank: int = 0

    def __post_init__(self) -> None:
        a, tp, m = self.arch, self.tp, self.arch.moe
        if not 0 <= self.rank < tp:
            raise TensorParallelError(f"parallel.tp={tp}: rank {self.rank} is out of range")
        if self.dp > 1:
            if self.expert_parallel:
                raise TensorParallelError(f"parallel.expert_parallel with parallel.dp={self.dp}: the routed "
                                          "experts are split whole across the DP ranks (parallel.ep) and each "
                                          "DP rank's are sliced across its TP ranks; set expert_parallel: false")
            ExpertLayout(self.dp_rank, self.dp, a)  # raises DataParallelError naming parallel.dp
        if a.num_heads % tp:
            raise TensorParallelError(f"parallel.tp={tp} must divide num_attention_heads={a.num_heads}")
        has_dense = m is None or len(m.sparse_layers) < a.num_layers
        if has_dense and a.intermediate_size % tp:
            raise TensorParallelError(f"parallel.tp={tp} must divide intermediate_size={a.intermediate_size}")
        if m is not None:
            if self.expert_parallel and m.num_experts % tp:
                raise TensorParallelError(f"parallel.tp={tp}: expert parallelism needs the {m.num_experts} "
                                          f"routed experts (num_experts / n_routed_experts) to divide by {tp}")
            if not self.expert_parallel and m.intermediate_size % tp:
                raise TensorParallelError(f"parallel.tp={tp} must divide moe_intermediate_size={m.intermediate_size}")
            if m.shared_intermediate_size % tp:
                raise TensorParallelError(f"parallel.tp={tp} must divide the shared experts' width "
                                          f"n_shared_experts * moe_intermediate_size={m.shared_intermediate_size}")
        try:
            self.spec  # noqa: B018 - validates the KV head split (divides, or is a multiple of, Hkv)
        except ValueError as e:
            raise TensorParallelError(f"parallel.tp={tp}: {e}") from None

    @property
    def spec(self) -> ShardSpec:
        """The KV sharding (geometry fields other than heads do not matter for head ownership)."""
        from pdkv.models.kv_layout import kv_geometry  # noqa: PLC0415

        return ShardSpec(self.tp, kv_geometry(self.arch, 1, "float32", "HND"), role="model")

    @property
    def q_heads(self) -> range:
        n = self.arch.num_heads // self.tp
        return range(self.rank * n, self.rank * n + n)

    @property
    def kv_heads(self) -> range:
        return self.spec.heads_of(self.rank)

    @property
    def inter(self) -> range:
        n = self.arch.intermediate_size // self.tp
        return range(self.rank * n, self.rank * n + n)

    @property
    def experts(self) -> range:
        """Routed experts this rank holds (all of them unless expert parallel or data parallel)."""
        n = self.arch.moe.num_experts
        if self.dp > 1:
            return ExpertLayout(self.dp_rank, self.dp, self.arch).experts
        if not self.expert_parallel:
            return range(n)
        return range(self.rank * n // self.tp, (self.rank + 1) * n // self.tp)

    def _part(self, full: int) -> range:
        n = full // self.tp
        return range(self.rank * n, self.rank * n + n)

    def local_arch(self) -> ArchConfig:
        """The config this rank's modules are built from: its share of heads and MLP width."""
        a, m = self.arch, self.arch.moe
        inter = len(self.inter) if a.intermediate_size % self.tp == 0 else a.intermediate_size
        if m is not None:
            e = self.experts
            m = dataclasses.replace(
                m, expert_start=e.start, num_local_experts=len(e),
                intermediate_size=m.intermediate_size if self.expert_parallel else m.intermediate_size // self.tp,
                # The shared MLP is sliced whatever the routed experts do.
                shared_size=m.shared_intermediate_size // self.tp)
        return dataclasses.replace(a, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=inter, moe=m)

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor ``name`` (full, Hugging Face layout: Linear weights [out, in]) →
        this rank's slice. Raises ValueError when the dimension being split has the wrong size."""
        a, D = self.arch, self.arch.head_dim
        special = self._shard_moe_mla(name, tensor)
        if special is not None:
            return special
        if ".q_proj." in name:
            return _rows(name, tensor, a.num_heads * D, self.q_heads, D)
        if ".k_proj." in name or ".v_proj." in name:
            return _rows(name, tensor, a.num_kv_heads * D, self.kv_heads, D)
        if ".gate_proj." in name or ".up_proj." in name:
            return _rows(name, tensor, a.intermediate_size, self.inter, 1)
        if ".o_proj." in name or ".down_proj." in name:
            if name.endswith(".bias"):
                # NOTE: the all-reduce sums every rank's output: the bias is added once, by rank 0.
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            full = a.num_heads * D if ".o_proj." in name else a.intermediate_size
            part = self.q_heads if ".o_proj." in name else self.inter
            unit = D if ".o_proj." in name else 1
            if tensor.dim() != 2 or tensor.shape[1] != full:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                                 f"{full} input columns to split {self.tp} ways")
            return tensor[:, part.start * unit:part.stop * unit]
        return tensor


    def _shard_moe_mla(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """MLA's and the MoE blocks' tensors (module docstring); None for the dense ones."""
        a, m, mla = self.arch, self.arch.moe, self.arch.mla
        if m is not None and (".mlp.experts." in name or ".mlp.shared_experts." in name):
            if ".mlp.experts." in name:
                if self.expert_parallel:
                    return tensor  # a whole expert this rank holds (the others are never loaded)
                full = m.intermediate_size
            else:
                full = m.shared_intermediate_size
            if ".down_proj." in name:
                return _cols(name, tensor, full, self._part(full), 1, self.tp)
            return _rows(name, tensor, full, self._part(full), 1)
        if m is not None and ".mlp.gate." in name:
            return tensor  # the router: replicated
        if mla is None:
            return None
        q = self.q_heads
        if ".q_proj." in name or ".q_b_proj." in name:
            return _rows(name, tensor, a.num_heads * mla.qk_head_dim, q, mla.qk_head_dim)
        if ".kv_b_proj." in name:
            unit = mla.qk_nope_head_dim + mla.v_head_dim
            return _rows(name, tensor, a.num_heads * unit, q, unit)
        if ".o_proj." in name:
            if name.endswith(".bias"):
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            return _cols(name, tensor, a.num_heads * mla.v_head_dim, q, mla.v_head_dim, self.tp)
        if ".self_attn." in name:
            return tensor  # q_a_proj, kv_a_proj_with_mqa and their norms: the latent, replicated
        return None


def _cols(name: str, tensor: torch.Tensor, full: int, part: range, unit: int, tp: int) -> torch.Tensor:
    if tensor.dim() != 2 or tensor.shape[1] != full:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                         f"{full} input columns to split {tp} ways")
    return tensor[:, part.start * unit:part.stop * unit]


def _rows(name: str, tensor: torch.Tensor, full: int, part: range, unit: int) -> torch.Tensor:
    if tensor.shape[0] != full:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                         f"{full} rows to split across tensor-parallel ranks")
    return tensor[part.start * unit:part.stop * unit]


class DataParallelError(ValueError):
    """A data-parallel expert-parallel layout that cannot be built; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Rank ``rank`` of a data-parallel group of ``size`` with expert parallelism (DP attention
    + EP MoE, as SGLang's --enable-dp-attention with EP and vLLM's --data-parallel-size with
    --enable-expert-parallel): attention, dense MLPs, shared experts, embeddings and the LM head
    are whole on every rank (each rank runs its own requests through them); the routed experts
    are split whole, rank r holding [r * E / size, (r + 1) * E / size). Tokens reach the ranks of
    their experts through a dispatcher (pdkv/dp/dispatch.py), never through an all-reduce."""

    rank: int
    size: int
    arch: ArchConfig
    expert_parallel = True  # read by the loader's FP8 messages like TPLayout's field
    tp = 1  # attention is not split

    def __post_init__(self) -> None:
        m = self.arch.moe
        if not 0 <= self.rank < self.size:
            raise DataParallelError(f"parallel.dp={self.size}: rank {self.rank} is out of range")
        if m is None:
            raise DataParallelError(f"parallel.ep: true needs a mixture-of-experts model; "
                                    f"{self.arch.architecture} is dense (set parallel.ep: false, or dp: 1)")
        if m.num_experts % self.size:
            raise DataParallelError(f"parallel.dp={self.size} must divide the {m.num_experts} routed experts "
                                    f"(num_experts / n_routed_experts) for expert parallelism")

    @property
    def experts(self) -> range:
        n = self.arch.moe.num_experts // self.size
        return range(self.rank * n, self.rank * n + n)

    def owner(self, expert: int) -> int:
        """The rank that holds routed expert ``expert``."""
        return expert // (self.arch.moe.num_experts // self.size)

    def local_arch(self) -> ArchConfig:
        e = self.experts
        return dataclasses.replace(self.arch, moe=dataclasses.replace(self.arch.moe, expert_start=e.start,
                                                                     num_local_experts=len(e)))

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Every tensor a rank loads is whole (other ranks' experts are skipped at load)."""
        return tensor



def process_group(store, prefix: str, rank: int, size: int, device: torch.device, timeout_s: float):
    """A torch.distributed process group of its own (not the default group) over ``store``:
    NCCL on CUDA, gloo on loopback otherwise; every collective bounded by ``timeout_s``."""
    import torch.distributed as dist  # noqa: PLC0415

    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix, store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Loopback: every rank is on this host, and the hostname may not resolve in a container.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)

class TensorParallel:
    """One rank's membership of a TP group: ``all_reduce`` sums in place across ranks.

    Built on a process group object used directly (not torch.distributed's default group), so
    one process can hold several engines one after another, and tests can build and drop them.
    ``on_error`` (set by the rank-0 leader) turns a failed collective into an error that names
    the rank that died instead of gloo's "connection closed by peer".
    """

    def __init__(self, rank: int, size: int, store, device: torch.device, timeout_s: float):
        import torch.distributed as dist  # noqa: PLC0415

        if not dist.is_available():
            raise RuntimeError("parallel.tp > 1 needs torch.distributed, which this torch build lacks")
        self.rank, self.size, self.device = rank, size, device
        self.expert_parallel = False  # parallel.expert_parallel: whole experts per rank (TPLayout)
        self.pg = process_group(store, "pdkv-tp", rank, size, device, timeout_s)
        self.on_error = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] partial sums → the sum over ranks, in place."""
        try:
            self.pg.allreduce([x]).wait()
        except Exception as e:
            if self.on_error is not None:
                self.on_error(e)  # raises a clearer error when it can name the cause
            raise
        return x


def attach(model: torch.nn.Module, tp: TensorParallel) -> None:
    """Makes every decoder layer all-reduce its o_proj and down_proj outputs (models/layers.py)."""
    for layer in model.model.layers:
        layer.reduce = tp.all_reduce
