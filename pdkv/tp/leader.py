"""Rank 0's side of tensor parallelism: starts ranks 1..tp-1, joins their process group, gives
them their KV memory, announces every forward pass, and notices when one dies.

Rank 0 is the engine process: it runs the scheduler (and the server and the messenger); the
other ranks are ``python -m pdkv.tp.worker`` processes (pdkv/tp/followers.py). Startup:

  1 spawn the followers, send each its "init" (model path, dtype, device, store port), wait "hello"
  2 join the process group (gloo on the CPU, NCCL on GPUs) over a TCPStore rank 0 hosts
  3 every rank loads its slice of the weights, in parallel (rank 0 inside LLMEngine)
  4 ``setup_kv``: rank 0 sizes the cache; CPU: it creates one shared-memory file per rank, every
    rank maps its own; GPU: every rank allocates cuMem and sends the handle, rank 0 imports it.
    Rank 0 ends up with a view of every rank's cache: ``regions`` (addresses for the messenger).
  5 each step: ``run_step`` sends the step's metadata, then all ranks run the forward together.

A dead follower never hangs rank 0: waits poll the process, each step checks it first, and a
collective that fails is turned into a TPRankError naming the rank (see followers.py).
"""

from __future__ import annotations

import datetime
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdkv.tp.channel import Channel, ChannelClosed
from pdkv.tp.followers import Followers, TPRankError
from pdkv.tp.step import StepMeta


@dataclass(frozen=True)
class KVRegion:
    """One rank's KV cache memory as rank 0 sees it: what the messenger registers.

    ``address`` is valid in rank 0's process (CPU: its mapping of the rank's shared file; GPU:
    the rank's cuMem allocation imported and mapped into rank 0). ``cache`` is a KVCache over that
    same memory (per layer [num_pages, 2, heads, P, D] for HND), so page ``p`` of layer ``i`` is
    at ``address + cache.page_offset(i, p)``.
    """

    rank: int
    address: int
    nbytes: int
    device: str
    kv_heads: tuple[int, ...]  # the global KV heads this rank holds (pdkv/shard/spec.py order)
    cache: object = field(compare=False, repr=False)


def _check_split(path: str, tp: int, expert_parallel: bool = False, dp: int = 1) -> None:
    """A model that cannot be split ``tp`` ways fails here, before any process starts."""
    from pdkv.models.config import parse_arch_config  # noqa: PLC0415
    from pdkv.models.loader import read_json  # noqa: PLC0415
    from pdkv.models.parallel import TPLayout  # noqa: PLC0415
    from pdkv.errors import ModelLoadError  # noqa: PLC0415

    config_path = Path(path) / "config.json"
    try:
        TPLayout(0, tp, parse_arch_config(read_json(config_path), str(config_path)), expert_parallel, dp)
    except ModelLoadError:
        raise
    except ValueError as e:
        raise ModelLoadError(f"{config_path}: {e}") from None


class TPLeader:
    def __init__(self, path: str, dtype: str, device: str, tp: int, max_positions: int,
                 num_threads: int, timeout_s: float = 120.0, startup_timeout_s: float = 600.0,
                 cpu_kernels: bool = True, expert_parallel: bool = False, lanes: dict | None = None):
        """``lanes``: this engine is one rank of a data-parallel group (tp x dp): the followers
        are ``python -m pdkv.dp.lane`` processes, each also joining its lane's dispatch group
        (pdkv/dp/expert.py ``lane_init``: the group's store, this DP rank and the DP size)."""
        import torch.distributed as dist  # noqa: PLC0415

        from pdkv.models.parallel import TensorParallel  # noqa: PLC0415

        if tp < 2:
            raise ValueError(f"TPLeader: parallel.tp must be >= 2, got {tp}")
        _check_split(path, tp, expert_parallel, lanes["dp"] if lanes else 1)
        self.size, self.timeout_s, self.startup_timeout_s = tp, timeout_s, startup_timeout_s
        self.device = torch.device(device)
        # GPU: rank r on cuda:(N + r) for model.device cuda:N.
        self.devices = [self.device if self.device.type != "cuda"
                        else torch.device("cuda", (self.device.index or 0) + r) for r in range(tp)]
        self.followers = f = Followers()
        self._finalizer = weakref.finalize(self, Followers.shutdown, f.procs, f.chans, f.fd_socks, f.state)
        self._shared: list = []  # rank 0's keepalives for every rank's KV memory
        self.regions: list[KVRegion] = []
        self.shard_spec = None  # this node's pdkv.shard.ShardSpec, set by setup_kv (for the handshake)
        self.parallel = None
        self._store = dist.TCPStore("127.0.0.1", 0, tp, True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=startup_timeout_s))
        try:
            for _ in range(1, tp):
                f.spawn(with_fd_socket=self.device.type == "cuda",
                        module="pdkv.dp.lane" if lanes else "pdkv.tp.worker")
            init = {"tp": tp, "path": path, "dtype": dtype, "max_positions": max_positions,
                    "num_threads": num_threads, "timeout_s": timeout_s, "host": "127.0.0.1",
                    "cpu_kernels": cpu_kernels, "expert_parallel": expert_parallel,
                    "port": self._store.port, **(lanes or {})}
            for r in f.ranks:
                f.chans[r].send("init", {**init, "rank": r, "device": str(self.devices[r])})
            f.wait_all("hello", startup_timeout_s)
            self.parallel = TensorParallel(0, tp, self._store, self.device, timeout_s)
            self.parallel.on_error = self._collective_failed
            self.parallel.expert_parallel = expert_parallel
        except BaseException:
            self.close()
            raise

    def check(self) -> None:
        """Raises TPRankError if any follower is gone (or was found gone before)."""
        self.followers.check()

    def _collective_failed(self, exc: Exception) -> None:
        # A peer's connection closed: its process is on its way out. Give it a moment to be
        # reaped so the error can name it.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.check()
            except TPRankError as e:
                raise self.followers.mark_broken(e) from exc
            time.sleep(0.05)
        # Every rank lives but the collective failed (timed out: a rank is stuck, or slower than
        # parallel.timeout_s). NOTE: the ranks are now out of step: a later all-reduce could pair
        # with a stale one and sum the wrong tensors, so the group is never used again.
        raise self.followers.mark_broken(TPRankError(
            f"tensor-parallel all-reduce failed with every rank alive ({exc}); the ranks are out of "
            f"step (parallel.timeout_s={self.timeout_s:g}) and this engine cannot run further steps")) from exc

    def wait_loaded(self) -> None:
        """Blocks until every follower has loaded its weights (they load while rank 0 does)."""
        self.followers.wait_all("loaded", self.startup_timeout_s)

    # ---- KV memory ---------------------------------------------------------------------------
    def setup_kv(self, arch, full_arch, dtype: torch.dtype, num_pages: int, page_size: int, layout: str,
                 attention_backend: str, kv_scales: list | None = None) -> torch.Tensor:
        """Creates every rank's KV memory and returns rank 0's (a flat uint8 tensor for
        ``KVCache(buffer=...)``). ``arch``: a rank's share (every rank holds the same number of
        heads); ``full_arch``: the checkpoint's. Sets ``regions`` and ``shard_spec``."""
        from pdkv.models.kv_layout import kv_geometry, kv_layout  # noqa: PLC0415
        from pdkv.models.parallel import TPLayout  # noqa: PLC0415
        from pdkv.shard.spec import ShardSpec  # noqa: PLC0415

        self.shard_spec = ShardSpec(self.size, kv_geometry(full_arch, page_size, str(dtype).removeprefix("torch."),
                                                           layout))
        lay = kv_layout(arch)  # K/V heads or an MLA latent (replicated: every rank the whole cache)
        nbytes = lay.page_bytes(page_size, dtype) * num_pages * arch.num_layers
        msg = {"nbytes": nbytes, "num_pages": num_pages, "page_size": page_size, "layout": layout,
               "attention_backend": attention_backend, "dtype": str(dtype).removeprefix("torch."),
               "kv_scales": [list(s) for s in kv_scales or []]}
        if self.device.type == "cuda":
            flats = self._setup_cumem(nbytes, msg)
        else:
            from pdkv.kv.shm import SharedBuffer  # noqa: PLC0415

            bufs = [SharedBuffer.create(nbytes, f"kv-r{r}") for r in range(self.size)]
            self._shared = bufs
            self.followers.send_all("kv", {**msg, "paths": [str(b.path) for b in bufs]})
            self.followers.wait_all("ready", self.startup_timeout_s)
            for b in bufs:
                b.unlink()  # NOTE: every rank has mapped it; the name is no longer needed
            flats = [b.tensor() for b in bufs]
        for r, flat in enumerate(flats):
            cache = lay.make_cache(arch.num_layers, num_pages, page_size, dtype, layout, flat.device, buffer=flat)
            if kv_scales:
                cache.kv_scales = list(kv_scales)
            self.regions.append(KVRegion(r, flat.data_ptr(), nbytes, str(flat.device),
                                         tuple(TPLayout(r, self.size, full_arch).kv_heads), cache))
        return flats[0]

    def _setup_cumem(self, nbytes: int, msg: dict) -> list:
        """GPU: every rank's cache is a cuMem allocation; followers export theirs (POSIX fd over
        SCM_RIGHTS) and rank 0 imports and maps each one (pdkv/gpu/cumem.py)."""
        from pdkv.gpu.cumem import CuMemAllocation  # noqa: PLC0415 - GPU only

        allocs = [CuMemAllocation.allocate(nbytes, self.devices[0].index)] + [None] * (self.size - 1)
        self._shared = allocs
        self.followers.send_all("kv", msg)
        deadline = time.monotonic() + self.startup_timeout_s
        for r in self.followers.ranks:
            sock = self.followers.fd_socks[r]
            while not Channel(sock).readable(0.2):
                self.followers.alive(r)
                if time.monotonic() > deadline:
                    raise TPRankError(f"tensor-parallel rank {r} sent no cuMem handle within "
                                      f"{self.startup_timeout_s:g} s")
            sent_rank, alloc = CuMemAllocation.receive(sock)
            allocs[r] = alloc
            if sent_rank != r:
                raise TPRankError(f"cuMem handle on rank {r}'s socket says rank {sent_rank}")
        self.followers.wait_all("ready", self.startup_timeout_s)
        return [a.tensor() for a in allocs]

    # ---- steps -------------------------------------------------------------------------------
    def run_step(self, input_ids: list[int], positions: list[int], batch) -> None:
        """Announces one forward pass; rank 0 then runs its own, meeting the others in the
        all-reduces. Raises TPRankError (nothing announced) if a follower is gone."""
        self._announce("step", StepMeta(input_ids, positions, batch))

    def run_dummy(self) -> None:
        """tp x dp: this DP rank has no tokens this step; every follower joins its lane's
        all-to-alls with none (pdkv/dp/expert.py ``dummy_forward``)."""
        self._announce("dummy")

    def _announce(self, kind: str, payload=None) -> None:
        self.check()
        try:
            self.followers.send_all(kind, payload)
        except ChannelClosed:
            self.check()
            raise

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the followers (waits for them, kills a stuck one) and drops the process group.
        Idempotent; also runs when the leader is garbage collected or the process exits."""
        self._finalizer()
        for b in self._shared:
            if hasattr(b, "unlink"):
                b.unlink()
        self.parallel = None
        self._store = None

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..tp-1."""
        return self.followers.pids
