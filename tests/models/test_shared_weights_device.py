"""The device-memory path of model.share_weights (CUDA IPC on a GPU, pdkv/gpu/weights_ipc.py),
run on the CPU against a host stand-in with the same interface: the owner packs into one
allocation and serves a fresh handle per attaching process, the importer checks and builds
views of it, computes what the owner computes, keeps computing once the owner and its handles
are gone (as a cuMem import does: its own reference), and refuses memory of another device
naming both. On the GPU the same flow is tools/gpu_check.py's ``weights-ipc``."""
from __future__ import annotations

import mmap
import os

import pytest
import torch

from pdkv import shared_weights as SW


class HostStandIn:
    """FAKE device memory for the test: a memfd (unsealed, like GPU memory), its handles dups."""

    kind = "host-standin"
    exports = 0

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)  # the mapping is the reference, as an imported cuMem handle is
        self._flat = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def pack(cls, blobs, size: int) -> "HostStandIn":
        fd = os.memfd_create("standin")
        os.ftruncate(fd, size)
        self = cls(os.dup(fd), size)
        self.owner_fd = fd
        for off, st in blobs:
            self._flat[off:off + st.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(st))
        return self

    def tensor(self):
        return self._flat

    def header(self) -> dict:
        return {"device": "standin:0", "size": self.size}

    def export_fd(self) -> int:
        HostStandIn.exports += 1
        return os.dup(self.owner_fd)

    def settle(self) -> None:
        pass

    @classmethod
    def attach(cls, fd: int, header: dict, device: str) -> "HostStandIn":
        if header.get("device") != "standin:0":
            raise ValueError(f"shared weights are on {header.get('device')}, this process computes on "
                             f"standin:0: refused")
        return cls(os.dup(fd), int(header["size"]))


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setitem(SW.DEVICE_MEMORY, HostStandIn.kind, HostStandIn)
    HostStandIn.exports = 0


def _model(path):
    from pdkv.models.loader import load_model

    return load_model(str(path), "float32", "cpu", 64, None, cpu_kernels=False)


def test_device_memory_flow_serves_a_fresh_handle_each_and_outlives_the_owner(tiny_model_dir, standin):
    owner = _model(tiny_model_dir)
    want = {n: p.detach().clone() for n, p in owner.model.named_parameters()}
    share = SW.WeightShare(owner.model, "fp-standin", memory=HostStandIn.kind)
    try:
        assert all(torch.equal(p, want[n]) for n, p in owner.model.named_parameters())  # rebound, same values
        got = []
        for _ in range(2):
            fd, header = SW.fetch("fp-standin")
            assert header["memory"] == HostStandIn.kind
            got.append((fd, header))
        assert HostStandIn.exports == 2  # one handle per attaching process, closed after sending
        from pdkv.models.loader import read_json

        skel = SW._skeleton(tiny_model_dir, read_json(tiny_model_dir / "config.json"), "float32", 64, False)
        fd, header = got[0]
        keep = SW.attach(skel.model, "fp-standin", fd, header, "cpu")
        for f, _ in got:
            os.close(f)
    finally:
        share.close()
    # the owner goes: its model, its server, its handle; the importer's own reference remains
    os.close(share.device.owner_fd)
    del owner, share
    import gc

    gc.collect()
    params = dict(skel.model.named_parameters())
    assert set(params) == set(want)
    assert all(torch.equal(params[n], w) for n, w in want.items())
    assert isinstance(keep, HostStandIn)
    emb = next(n for n in want if n.endswith("embed_tokens.weight"))
    x = torch.tensor([3, 4, 5])
    torch.testing.assert_close(torch.nn.functional.embedding(x, params[emb]), want[emb][x])


def test_memory_of_another_device_or_kind_is_refused_naming_both(tiny_model_dir, standin):
    from pdkv.models.loader import read_json

    owner = _model(tiny_model_dir)
    share = SW.WeightShare(owner.model, "fp-standin2", memory=HostStandIn.kind)
    try:
        fd, header = SW.fetch("fp-standin2")
        skel = SW._skeleton(tiny_model_dir, read_json(tiny_model_dir / "config.json"), "float32", 64, False)
        bad = {**header, "device": {**header["device"], "device": "standin:1"}}
        with pytest.raises(SW.SharedWeightsError, match="on standin:1, this process computes on standin:0"):
            SW.attach(skel.model, "fp-standin2", fd, bad, "cpu")
        with pytest.raises(SW.SharedWeightsError, match="cannot be attached here"):
            SW.attach(skel.model, "fp-standin2", fd, {**header, "memory": "nvlink"}, "cpu")
        with pytest.raises(SW.SharedWeightsError, match="cumem memory, this process computes on cpu"):
            SW.attach(skel.model, "fp-standin2", fd, {**header, "memory": "cumem"}, "cpu")
        os.close(fd)
    finally:
        share.close()
