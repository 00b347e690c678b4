"""End-to-end checks of the GPU building blocks, shared by tests/gpu and tools/gpu_check.py.

Each check runs the real thing and raises AssertionError (or GPUUnavailable / CudaError) with
what went wrong; on success it returns a one-line description of what it verified.

- :func:`check_cumem_two_process`: a child process (the "rank 1" role) allocates with cuMem,
  fills the memory, exports it and sends the descriptor over a Unix socket; this process (the
  "rank 0" role) imports it, checks the bytes, overwrites half of them; the child then checks it
  sees rank 0's writes in its own mapping. Both sides unmap and release.
- :func:`check_counter_graph`: a CUDA graph of L "layers" (a spin kernel standing in for the
  layer's compute, then ``counter.bump()``) is captured once and replayed R times, while a host
  thread watches ``host_address``; it must see the counter climb layer by layer and reach R*L
  before the host ever synchronises with the GPU. ``bump`` picks the kernel ("triton": the
  system-scope release; "torch": the fallback add).

The child side is ``python tools/gpu_check_selftest.py export SOCKET NBYTES DEVICE``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])


def _pattern(torch, n: int, mul: int, add: int, mod: int, device: int):
    """[n] uint8: (i * mul + add) % mod, built on the GPU."""
    return torch.arange(n, device=f"cuda:{device}", dtype=torch.int64).mul_(mul).add_(add).remainder_(mod).to(torch.uint8)


def check_cumem_two_process(nbytes: int = 32 << 20, device: int = 0, timeout: float = 120.0) -> str:
    from pdkv.gpu.cumem import CuMemAllocation
    from pdkv.gpu.guard import cuda_driver, require_torch_cuda

    cuda_driver("check_cumem_two_process", device)
    torch = require_torch_cuda("check_cumem_two_process", device)
    with tempfile.TemporaryDirectory(prefix="pdkv-gpu-") as tmp:
        path = os.path.join(tmp, "handles.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(path)
        server.listen(1)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "export", path,
                                  str(nbytes), str(device)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            conn = _accept(server, child, timeout)
            with conn:
                conn.settimeout(timeout)
                rank, alloc = CuMemAllocation.receive(conn)
                assert rank == 1, f"rank {rank} in the handle message, expected 1"
                assert alloc.size == nbytes and alloc.imported, repr(alloc)
                t = alloc.tensor()
                want = _pattern(torch, nbytes, 7, 3, 251, alloc.device)
                bad = int((t != want).sum())
                assert bad == 0, f"rank 0 read {bad} of {nbytes} bytes wrong through the imported mapping"
                half = nbytes // 2
                t[half:].copy_(_pattern(torch, nbytes - half, 13, 5, 253, alloc.device))
                torch.cuda.synchronize(alloc.device)
                del t, want
                conn.send(b"check")
                reply = conn.recv(4096).decode(errors="replace")
                alloc.close()
            assert reply == "ok", f"exporter says: {reply or 'nothing'}; {_child_output(child)}"
            rc = child.wait(timeout)
            assert rc == 0, f"exporter exited with {rc}: {_child_output(child)}"
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            server.close()
    return (f"cuMem {nbytes >> 20} MiB exported by pid {child.pid} as a POSIX fd, imported by "
            f"pid {os.getpid()} at {alloc.ptr:#x}; bytes cross both ways")


def _accept(server: socket.socket, child: subprocess.Popen, timeout: float) -> socket.socket:
    """The exporter's connection; fails at once (with its output) if the exporter died first."""
    server.settimeout(0.2)
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn, _ = server.accept()
            return conn
        except socket.timeout:
            if child.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"exporter never connected: {_child_output(child)}") from None


def _child_output(child) -> str:
    if child.poll() is None:
        child.kill()
    out, _ = child.communicate()
    return f"exporter output: {out.strip()[-2000:] or '(none)'}"


def _export_main(path: str, nbytes: int, device: int) -> int:
    """The child: allocate, fill, send, wait for rank 0's writes, verify them, report."""
    import torch

    from pdkv.gpu.cumem import CuMemAllocation

    alloc = CuMemAllocation.allocate(nbytes, device)
    t = alloc.tensor()
    t.copy_(_pattern(torch, nbytes, 7, 3, 251, device))
    torch.cuda.synchronize(device)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(120)
        sock.connect(path)
        alloc.send(sock, rank=1)
        if sock.recv(64) != b"check":
            print("rank 0 did not ask for the check", flush=True)
            return 1
        half = nbytes // 2
        kept = int((t[:half] != _pattern(torch, half, 7, 3, 251, device)).sum())
        seen = int((t[half:] != _pattern(torch, nbytes - half, 13, 5, 253, device)).sum())
        reply = "ok" if kept == seen == 0 else (f"{kept} bytes of my half changed, {seen} bytes of "
                                                "rank 0's half not seen")
        sock.send(reply.encode())
    del t
    alloc.close()
    return 0 if reply == "ok" else 1


def check_counter_graph(device: int = 0, num_layers: int = 8, replays: int = 3,
                        layer_ms: float = 2.0, timeout: float = 60.0, bump: str = "auto") -> str:
    from pdkv.gpu.guard import cuda_driver, require_torch_cuda
    from pdkv.gpu.layer_counter import CudaLayerCounter

    cuda_driver("check_counter_graph", device)
    torch = require_torch_cuda("check_counter_graph", device)
    torch.cuda.set_device(device)
    counter = CudaLayerCounter(device, bump)
    try:
        x = torch.randn(512, 512, device=f"cuda:{device}")
        cycles = int(2_000_000 * layer_ms)  # ~layer_ms at <= 2 GHz SM clocks (an H200 boosts to 1.98)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture (cuBLAS workspaces), no bumps
            for _ in range(2):
                _ = x @ x
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(num_layers):
                torch.cuda._sleep(cycles)  # the layer's compute
                _ = x @ x
                counter.bump()  # after the "output projection"
        torch.cuda.synchronize()
        assert counter.value() == 0, f"capturing ran the bumps: counter is {counter.value()}"
        target = num_layers * replays
        seen: list[int] = []
        cell = ctypes.c_int64.from_address(counter.host_address)

        def watch():  # what the messenger's poller does, minus the C
            deadline = time.monotonic() + timeout
            last = -1
            while time.monotonic() < deadline:
                v = cell.value
                if v != last:
                    seen.append(v)
                    last = v
                    if v >= target:
                        return
                time.sleep(0)

        watcher = threading.Thread(target=watch, name="counter-watch")
        watcher.start()
        for _ in range(replays):
            graph.replay()
        watcher.join(timeout)  # NOTE: before any synchronize: the host sees it on its own
        assert seen and seen[-1] == target, f"host saw {seen[-8:]} without syncing, expected to reach {target}"
        torch.cuda.synchronize()
        assert counter.value() == target, f"counter {counter.value()} after sync, expected {target}"
        steps = sorted(v for v in set(seen) if 0 < v < target)
        assert len(steps) >= target // 2, (f"host saw only {len(steps)} intermediate values "
                                           f"{steps[:16]} of {target - 1}: bumps are not layer by layer")
        del graph
    finally:
        counter.close()
    return (f"{replays} replays x {num_layers} layers of a captured graph, bumped by {counter.bump_kind.value}: "
            f"host thread saw {len(set(seen))} distinct values up to {target} before synchronising")


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "export":
        return _export_main(argv[1], int(argv[2]), int(argv[3]))
    print("usage: python tools/gpu_check_selftest.py export SOCKET NBYTES DEVICE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
