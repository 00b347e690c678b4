"""A follower rank (1..tp-1): loads its slice of the model, maps its KV cache, then runs every
forward pass rank 0 announces, until rank 0 says stop or goes away.

Started by pdkv/tp/leader.py as ``python -m pdkv.tp.worker CONTROL_FD [FD_SOCKET]``: CONTROL_FD
is this end of the control channel (pdkv/tp/channel.py); FD_SOCKET (GPU only) is a SOCK_SEQPACKET
socket that carries the cuMem handle of this rank's KV memory to rank 0.

Exit: "stop" → 0; rank 0's end closed (its process died) → 0, quietly; any error → the
traceback goes to rank 0 as ("error", text), then exit 1 (rank 0 names the rank in its error).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import traceback

log = logging.getLogger("pdkv.tp.worker")


def _kv_buffer(kv: dict, rank: int, device, fd_sock):
    """This rank's KV memory: the shared file rank 0 made (CPU) or a cuMem allocation whose
    handle goes to rank 0 (GPU). Returns (keepalive object, flat uint8 tensor, address)."""
    if device.type == "cuda":
        from pdkv.gpu.cumem import CuMemAllocation  # noqa: PLC0415 - GPU only

        alloc = CuMemAllocation.allocate(kv["nbytes"], device.index)
        alloc.send(fd_sock, rank)
        t = alloc.tensor()
        return alloc, t, t.data_ptr()
    from pdkv.kv.shm import SharedBuffer  # noqa: PLC0415

    buf = SharedBuffer.attach(kv["paths"][rank], kv["nbytes"])
    return buf, buf.tensor(), buf.address


def serve(ch, fd_sock, join_lane=None) -> None:
    """``join_lane(init, device)``: tp x dp (pdkv/dp/lane.py), this rank's pdkv.dp.ExpertGroup
    for its lane; its MoE blocks dispatch through it and "dummy" runs a forward with no tokens."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from pdkv.models.kv_layout import kv_layout  # noqa: PLC0415
    from pdkv.models.loader import load_model  # noqa: PLC0415
    from pdkv.models.parallel import TensorParallel  # noqa: PLC0415

    kind, init = ch.recv()
    if kind != "init":
        raise RuntimeError(f"expected an 'init' message first, got {kind!r}")
    rank, tp = init["rank"], init["tp"]
    device = torch.device(init["device"])
    if device.type == "cpu":
        torch.set_num_threads(init["num_threads"])
    else:
        torch.cuda.set_device(device)
    ch.send("hello", os.getpid())
    store = dist.TCPStore(init["host"], init["port"], tp, False,
                          timeout=datetime.timedelta(seconds=init["timeout_s"]))
    par = TensorParallel(rank, tp, store, device, init["timeout_s"])
    par.expert_parallel = bool(init.get("expert_parallel", False))
    lane = join_lane(init, device) if join_lane is not None else None
    loaded = load_model(init["path"], init["dtype"], str(device), init["max_positions"], tp=par,
                        cpu_kernels=init["cpu_kernels"], ep=lane)
    ch.send("loaded")
    kind, kv = ch.recv()
    if kind == "stop":
        return
    arch = loaded.arch  # this rank's share
    keep, flat, address = _kv_buffer(kv, rank, device, fd_sock)
    lay = kv_layout(arch)  # K/V heads or an MLA latent
    kv_dtype = getattr(torch, kv["dtype"]) if "dtype" in kv else loaded.dtype  # an FP8 cache, or the model's
    cache = lay.make_cache(arch.num_layers, kv["num_pages"], kv["page_size"], kv_dtype, kv["layout"], device,
                           buffer=flat)
    if kv.get("kv_scales"):
        cache.kv_scales = [tuple(s) for s in kv["kv_scales"]]
    backend = lay.make_backend(kv["attention_backend"], cache)
    if getattr(backend, "fp8", False):
        backend.q_dtype = loaded.dtype  # FlashInfer over an FP8 cache: the queries' dtype
    backend.use_cpu_kernel &= init["cpu_kernels"]
    ch.send("ready", {"address": address, "nbytes": cache.nbytes, "pid": os.getpid()})
    with torch.inference_mode():
        while True:
            kind, payload = ch.recv()
            if kind == "stop":
                break
            if kind == "dummy" and lane is not None:
                lane.dummy_forward()
                continue
            if kind != "step":
                raise RuntimeError(f"unexpected control message {kind!r}")
            if lane is not None:
                lane.run_step(payload.input_ids, payload.positions, payload.batch)
            payload.run(loaded.model, backend, device)
    del cache, backend, flat, keep


def main(argv: list[str], join_lane=None, name: str = "tp-worker") -> int:
    from pdkv.tp.channel import Channel, ChannelClosed  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    ch = Channel(socket.socket(fileno=int(argv[0])))
    fd_sock = socket.socket(fileno=int(argv[1])) if len(argv) > 1 else None
    try:
        serve(ch, fd_sock, join_lane)
        return 0
    except ChannelClosed:
        return 0  # rank 0 is gone: nothing to report to, nothing to clean up but ourselves
    except BaseException:  # noqa: BLE001 - every failure is reported to rank 0, then we exit
        text = traceback.format_exc()
        try:
            ch.send("error", text)
        except Exception:  # noqa: BLE001
            print(text, file=sys.stderr, flush=True)
        return 1
    finally:
        ch.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
