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

A rank's model is built from ``local_arch`` (its head and intermediate counts), so the layers,
the attention backend and the KV cache need no TP knowledge; ``shard_tensor`` slices each
checkpoint tensor before the loader copies it in.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch

from models.config import ArchConfig
from pdkv.shard.spec import KVGeometry, ShardSpec


class TensorParallelError(ValueError):
    """A model that cannot be split ``tp`` ways; the message names the count that does not divide."""


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """Where rank ``rank`` of ``tp`` sits in the full model (all counts global unless *_local)."""

    rank: int
    tp: int
    arch: ArchConfig  # the checkpoint's full config

    def __post_init__(self) -> None:
        a, tp = self.arch, self.tp
        if not 0 <= self.rank < tp:
            raise TensorParallelError(f"parallel.tp={tp}: rank {self.rank} is out of range")
        if a.num_heads % tp:
            raise TensorParallelError(f"parallel.tp={tp} must divide num_attention_heads={a.num_heads}")
        if a.intermediate_size % tp:
            raise TensorParallelError(f"parallel.tp={tp} must divide intermediate_size={a.intermediate_size}")
        try:
            self.spec  # noqa: B018 - validates the KV head split (divides, or is a multiple of, Hkv)
        except ValueError as e:
            raise TensorParallelError(f"parallel.tp={tp}: {e}") from None

    @property
    def spec(self) -> ShardSpec:
        """The KV sharding (geometry fields other than heads do not matter for head ownership)."""
        g = KVGeometry(self.arch.num_kv_heads, self.arch.head_dim, 1, "float32")
        return ShardSpec(self.tp, g, role="model")

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

    def local_arch(self) -> ArchConfig:
        """The config this rank's modules are built from: its share of heads and MLP width."""
        return dataclasses.replace(self.arch, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.inter))

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor ``name`` (full, Hugging Face layout: Linear weights [out, in]) →
        this rank's slice. Raises ValueError when the dimension being split has the wrong size."""
        a, D = self.arch, self.arch.head_dim
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


def _rows(name: str, tensor: torch.Tensor, full: int, part: range, unit: int) -> torch.Tensor:
    if tensor.shape[0] != full:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                         f"{full} rows to split across tensor-parallel ranks")
    return tensor[part.start * unit:part.stop * unit]


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
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("pdkv-tp", store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            # Loopback: every rank is on this host, and the hostname may not resolve in a container.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, opts)
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
