"""One copy of the model's weights for every role process on a host (``model.share_weights``).

The first process to load a model on this host (its *owner*) packs every parameter, as the model
computes with it (after the loader's transposes), into one sealed memfd and serves the descriptor
on an abstract Unix socket named by the user id and the model's fingerprint. Another process
loading the same model there connects, receives the descriptor (SCM_RIGHTS) with the tensor
index, checks the fingerprint, the sizes and the index's checksum, and builds its model on views
of the same memory: its parameters cost it page-table entries, not a second copy.

- The memfd is sealed (no write, no shrink, no grow) once filled: nobody can change the weights
  under a reader, and nobody can truncate it into a SIGBUS. Both sides map it MAP_PRIVATE: a
  stray write to a parameter would copy that one page, never reach the other process.
- The mapping outlives its creator: the owner may exit or be killed; every attached process
  keeps its mapping (the kernel frees the memory with the last one).
- The server only answers processes of the same user (SO_PEERCRED), and the receiver checks the
  owner's user too: the weights it maps are its own user's.

GPU (``model.share_weights: on`` with a CUDA device; ``auto`` shares host memory only until the
GPU path has run on a lent GPU): the owner packs the parameters into one cuMem allocation
(pdkv/gpu/weights_ipc.py over pdkv/gpu/cumem.py, as TP moves KV) and sends each attaching process
a fresh POSIX handle of it (``cuMemExportToShareableHandle``) with the same index; the importer
maps it on the same GPU (its bus id must be the importer's device, else refused naming both) and
builds its views the same way. The importer holds its own imported handle, so if the owner dies
the memory stays until the last process unmaps it: the importer keeps serving (the same answer as
the memfd's). GPU memory cannot be sealed: both map it read-write, and inference never writes a
parameter. The device memory is a strategy object (``DEVICE_MEMORY``, by the header's ``memory``
kind), so the serving and attaching code runs on the CPU against a host stand-in
(tests/models/test_shared_weights_device.py). Tensor-parallel ranks, FP8 and
models with weights derived after loading (MLA) also load privately (logged): the receiver
builds its model from the index alone and these need the loader's own steps.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import socket
import struct
import threading

import torch

from pdkv.errors import PdkvError

log = logging.getLogger("pdkv.shared_weights")

MAX_INDEX = 1 << 20  # bytes of index JSON one message may carry (a few hundred tensors: ~50 KB)
ALIGN = 64
_F_ADD_SEALS, _F_SEAL_SHRINK, _F_SEAL_GROW, _F_SEAL_WRITE = 1033, 0x0002, 0x0004, 0x0008
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                               torch.int32, torch.int64)}


class SharedWeightsError(PdkvError, RuntimeError):
    """The weights another process offered cannot be used here; the message says why."""


def socket_name(fingerprint: str) -> str:
    return f"\0pdkv-weights-{os.getuid()}-{fingerprint}"


def index_checksum(index: list) -> str:
    return hashlib.sha256(json.dumps(index, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _params(model: torch.nn.Module):
    """(module, attribute, qualified name) of every parameter, tied ones once per module slot."""
    for mname, mod in model.named_modules():
        for pname, p in mod._parameters.items():
            if p is not None:
                yield mod, pname, f"{mname}.{pname}" if mname else pname


def _rebind(model: torch.nn.Module, views: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for mod, pname, full in _params(model):
            mod._parameters[pname] = torch.nn.Parameter(views[full], requires_grad=False)


def _map(fd: int, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    m = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    return m, torch.frombuffer(m, dtype=torch.uint8)


DEVICE_MEMORY: dict[str, object] = {}  # header "memory" kind -> its class ("cumem" on first use)


def device_memory(kind: str):
    """The class that packs / exports / imports device memory of ``kind`` (imported on first use)."""
    if kind == "cumem" and kind not in DEVICE_MEMORY:
        from pdkv.gpu.weights_ipc import CuMemWeights  # noqa: PLC0415 - GPU hosts only

        DEVICE_MEMORY[kind] = CuMemWeights
    try:
        return DEVICE_MEMORY[kind]
    except KeyError:
        raise SharedWeightsError(f"shared weights in {kind!r} memory cannot be attached here "
                                 f"(known: memfd, {', '.join(DEVICE_MEMORY) or 'no device memory'})") from None


def _views(flat: torch.Tensor, index: list) -> dict[str, torch.Tensor]:
    """Each entry's tensor: its storage bytes at `offset`, viewed with its shape and strides."""
    out, typed = {}, {}
    for e in index:
        dt = _DTYPES[e["dtype"]]
        if dt not in typed:  # the whole mapping as dt (its size is a multiple of ALIGN)
            typed[dt] = flat.view(dt)
        size = typed[dt].element_size()
        # as_strided's offset counts from the mapping's start, in elements of dt
        out[e["name"]] = typed[dt].as_strided(e["shape"], e["stride"], e["offset"] // size + e["storage_offset"])
    return out


class WeightShare:
    """The owner's side: the sealed memfd, and the thread that hands it out."""

    def __init__(self, model: torch.nn.Module, fingerprint: str, kv_scales: dict | None = None,
                 memory: str = "memfd"):
        """``memory``: "memfd" (host parameters) or a DEVICE_MEMORY kind ("cumem": CUDA ones)."""
        self.fingerprint = fingerprint
        index, blobs, by_storage, size = [], [], {}, 0
        want = "cpu" if memory == "memfd" else None
        for _mod, _pname, full in _params(model):
            p = getattr(_mod, _pname)
            want = want or p.device.type
            if p.device.type != want or str(p.dtype) not in _DTYPES:
                raise SharedWeightsError(f"parameter {full}: {p.dtype} on {p.device} cannot be shared")
            st = p.untyped_storage()
            key = st.data_ptr()
            if key not in by_storage:  # tied weights: one storage, packed once
                by_storage[key] = size
                blobs.append((size, st))
                size += -(-st.nbytes() // ALIGN) * ALIGN
            index.append({"name": full, "dtype": str(p.dtype), "shape": list(p.shape), "stride": list(p.stride()),
                          "storage_offset": p.storage_offset(), "offset": by_storage[key], "nbytes": st.nbytes()})
        self.size, self.index = max(size, ALIGN), index
        self.memory, self.fd, self.device = memory, -1, None
        extra = {}
        if memory == "memfd":
            self._pack_memfd(blobs)
            flat = self._flat
        else:  # device memory: one allocation, exported afresh for each attaching process
            self.device = device_memory(memory).pack(blobs, self.size)
            flat, extra = self.device.tensor(), {"device": self.device.header()}
        _rebind(model, _views(flat, index))  # the owner computes from the shared copy too
        del flat
        if self.device is not None:
            self.device.settle()  # the private copy the parameters left is given back now
        self.header = json.dumps({"fingerprint": fingerprint, "size": self.size, "index": index,
                                  "index_sha256": index_checksum(index), "kv_scales": kv_scales or {},
                                  "memory": memory, **extra}).encode()
        if len(self.header) > MAX_INDEX:
            raise SharedWeightsError(f"the tensor index is {len(self.header)} bytes, at most {MAX_INDEX} fit")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(socket_name(fingerprint))
        self.sock.listen(16)
        self._closed = False
        self.thread = threading.Thread(target=self._serve, name="pdkv-weights", daemon=True)
        self.thread.start()
        log.info("shared weights: %d tensors, %d bytes of %s, served as @%s", len(index), self.size, memory,
                 socket_name(fingerprint)[1:])

    def _pack_memfd(self, blobs) -> None:
        self.fd = os.memfd_create("pdkv-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)
        with mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as w:
            flat = torch.frombuffer(w, dtype=torch.uint8)
            for off, st in blobs:
                flat[off:off + st.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(st))
            del flat
        fcntl.fcntl(self.fd, _F_ADD_SEALS, _F_SEAL_SHRINK | _F_SEAL_GROW | _F_SEAL_WRITE)
        self._map, self._flat = _map(self.fd, self.size)

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                if uid != os.getuid():
                    log.warning("shared weights: refused process %d of user %d (not ours)", pid, uid)
                    continue
                fd = self.fd if self.device is None else self.device.export_fd()
                try:
                    socket.send_fds(conn, [self.header], [fd])
                except OSError as e:
                    log.warning("shared weights: sending to process %d failed: %s", pid, e)
                finally:
                    if fd != self.fd:
                        os.close(fd)  # the message carried its own reference

    def close(self) -> None:
        """Stop serving; the memory lives on in every mapping (ours until the model goes)."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def fetch(fingerprint: str, timeout: float = 10.0) -> tuple[int, dict] | None:
    """The descriptor and header an owner of ``fingerprint`` on this host serves, or None (no owner)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    try:
        try:
            s.connect(socket_name(fingerprint))
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        _pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise SharedWeightsError(f"the weights socket is served by user {uid}, not {os.getuid()}")
        msg, fds, flags, _ = socket.recv_fds(s, MAX_INDEX + 1, 2)
    finally:
        s.close()
    if len(fds) != 1 or flags & socket.MSG_TRUNC or not msg:
        for f in fds:
            os.close(f)
        raise SharedWeightsError(f"the weights owner sent {len(fds)} descriptors and {len(msg)} bytes "
                                 "(expected one descriptor and its index)")
    try:
        return fds[0], json.loads(msg)
    except ValueError as e:
        os.close(fds[0])
        raise SharedWeightsError(f"the weights owner's index is not JSON: {e}") from None


def attach(model: torch.nn.Module, fingerprint: str, fd: int, header: dict, device: str = "cpu"):
    """Rebind ``model``'s parameters (built on the meta device or empty) to views of the owner's
    memory after every check; returns the mapping, or the imported device memory (it lives as
    long as the tensors use it). ``device``: where this process computes (device memory must be
    on that very device)."""
    theirs = header.get("fingerprint")
    if theirs != fingerprint:
        raise SharedWeightsError(f"shared weights are of model {theirs}, this process loads {fingerprint}: refused")
    index = header.get("index") or []
    if header.get("index_sha256") != index_checksum(index):
        raise SharedWeightsError("shared weights: the tensor index does not match its checksum: refused")
    memory = header.get("memory", "memfd")
    on_cpu = torch.device(device).type == "cpu"
    if (memory == "memfd" and not on_cpu) or (memory == "cumem" and on_cpu):
        raise SharedWeightsError(f"shared weights are in {memory} memory, this process computes on {device}: refused")
    imported = None
    if memory != "memfd":  # its size is the allocation's; the import checks the device
        try:
            imported = device_memory(memory).attach(fd, header.get("device") or {}, device)
        except (ValueError, RuntimeError) as e:  # CudaError too: a GPU this process cannot reach
            raise SharedWeightsError(str(e)) from None
        size = imported.size
        if size < (header.get("size") or 0):
            raise SharedWeightsError(f"shared weights: the device memory holds {size} bytes, the index needs "
                                     f"{header.get('size')}: refused")
        size = header["size"]
    else:
        size = os.fstat(fd).st_size
    if memory == "memfd" and (size != header.get("size") or fcntl.fcntl(fd, 1034) & _F_SEAL_WRITE == 0):
        raise SharedWeightsError(f"shared weights: the memory is {size} bytes (index says {header.get('size')}) "
                                 "or not sealed against writes: refused")  # 1034: F_GET_SEALS
    want = {full: getattr(mod, pname) for mod, pname, full in _params(model)}
    got = {e["name"]: e for e in index}
    if set(want) != set(got):
        diff = sorted(set(want) ^ set(got))
        raise SharedWeightsError(f"shared weights name other tensors than this model ({len(diff)} differ, "
                                 f"e.g. {', '.join(diff[:3])}): refused")
    for name, p in want.items():
        e = got[name]
        if e["dtype"] != str(p.dtype) or tuple(e["shape"]) != tuple(p.shape):
            raise SharedWeightsError(f"shared tensor {name} is {e['dtype']} {tuple(e['shape'])}, this model "
                                     f"needs {p.dtype} {tuple(p.shape)}: refused")
        need = e["storage_offset"] + sum((d - 1) * s for d, s in zip(e["shape"], e["stride"])) + 1
        if e["offset"] < 0 or e["offset"] + e["nbytes"] > size or need * p.element_size() > e["nbytes"]:
            raise SharedWeightsError(f"shared tensor {name} lies outside the shared memory: refused")
    m, flat = _map(fd, size) if imported is None else (imported, imported.tensor())
    _rebind(model, _views(flat, index))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise SharedWeightsError(f"shared weights left {len(left)} tensor(s) unset, e.g. {left[0]}: refused")
    return m


def load_shared(path, dtype: str, device: str, max_positions, progress, cpu_kernels: bool, fingerprint_of):
    """load_model through the host's shared copy: attach to an owner of this model if one serves it,
    else load privately and become its owner. ``fingerprint_of(loaded_or_config)``: the model's
    fingerprint (the engine's prefix-cache salt). Returns (LoadedModel, WeightShare or mapping)."""
    from pdkv.models.loader import LoadedModel, load_model, read_json, resolve_dtype  # noqa: PLC0415

    from pathlib import Path  # noqa: PLC0415

    folder = Path(path)
    hf_config = read_json(folder / "config.json")
    fp = fingerprint_of(LoadedModel(None, None, hf_config, None, folder))
    got = fetch(fp)
    if got is not None:
        fd, header = got
        try:
            loaded = _skeleton(folder, hf_config, dtype, max_positions, cpu_kernels, device)
            keep = attach(loaded.model, fp, fd, header, device)
        except SharedWeightsError as e:  # loud, and this process still serves: with its own copy
            log.warning("shared weights: %s; loading %s privately", e, folder)
            got = None
        finally:
            os.close(fd)
    if got is not None:
        loaded.kv_scales = {int(k): tuple(v) for k, v in header.get("kv_scales", {}).items()}
        log.info("shared weights: attached to this host's copy of %s (%d bytes, not loaded again)", folder,
                 header["size"])
        return loaded, keep
    loaded = load_model(path, dtype, device, max_positions, progress, cpu_kernels=cpu_kernels)
    try:
        share = WeightShare(loaded.model, fp, {str(k): list(v) for k, v in (loaded.kv_scales or {}).items()},
                            "memfd" if torch.device(device).type == "cpu" else "cumem")
    except OSError as e:  # another process became the owner first (the name is taken): keep ours
        log.info("shared weights: not serving %s (%s); this process keeps its own copy", folder, e)
        return loaded, None
    return loaded, share


def _skeleton(folder, hf_config, dtype: str, max_positions, cpu_kernels: bool, device: str = "cpu"):
    """The model load_model would build, with empty parameters (attach fills them)."""
    from pdkv.models.config import parse_arch_config  # noqa: PLC0415
    from pdkv.models.cpu_kernels import AVAILABLE as CPU_KERNELS_AVAILABLE  # noqa: PLC0415
    from pdkv.models.loader import LoadedModel, disable_cpu_kernels, resolve_dtype  # noqa: PLC0415
    from pdkv.models.registry import MODEL_REGISTRY  # noqa: PLC0415

    arch = parse_arch_config(hf_config, str(folder / "config.json"))
    torch_dtype = resolve_dtype(dtype, hf_config)
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch.architecture](arch, torch_dtype)
    if hasattr(model, "post_load"):
        raise SharedWeightsError(f"{arch.architecture} derives weights after loading: not shared")
    if not (cpu_kernels and CPU_KERNELS_AVAILABLE):
        disable_cpu_kernels(model)
    # parameters stay on the meta device until attach() replaces every one of them: nothing is
    # allocated for them here
    model.init_rope(max_positions or arch.max_position_embeddings, device)
    model.eval()
    return LoadedModel(model, arch, hf_config, torch_dtype, folder, arch, {})
