"""The disagg-shm architecture: configs/ab/disagg.yaml on the shm transport with shared weights,
and the held memory its shm files make (PSS misses their untouched pages)."""
from __future__ import annotations

from pdkv.bench.ab import archs as A
from pdkv.config import load_config


def test_disagg_shm_is_disagg_with_shm_and_shared_weights(tmp_path):
    import yaml

    shm, tcp = A.builtin("disagg-shm"), A.builtin("disagg")
    assert (shm.kind, shm.num_prefill, shm.num_decode) == (tcp.kind, tcp.num_prefill, tcp.num_decode)
    nodes = A.node_specs(shm, [0, 1])
    assert [n.role for n in nodes] == ["prefill", "decode"]
    for n in nodes:  # each node's role config is valid, and differs from disagg's only there
        n.config.setdefault("messenger", {})["prefill_peers"] = ["127.0.0.1:1"]
        f = tmp_path / f"{n.name}.yaml"
        f.write_text(yaml.safe_dump(n.config))
        cfg = load_config(f)
        assert (cfg.messenger.transport, cfg.model.share_weights) == ("shm", "auto")
    plain = {n.role: n.config for n in A.node_specs(tcp, [0, 1])}
    for n in nodes:
        a, b = dict(n.config), dict(plain[n.role])
        a["messenger"] = {k: v for k, v in a["messenger"].items() if k not in ("transport", "prefill_peers")}
        b["messenger"] = {k: v for k, v in b["messenger"].items() if k not in ("transport", "prefill_peers")}
        a["model"] = {k: v for k, v in a["model"].items() if k != "share_weights"}
        assert a == b


def test_held_memory_counts_a_held_shm_file_whole_and_once():
    """A /dev/shm file allocated whole but untouched (what the shm transport's registration
    makes) is missing from PSS; held_bytes counts all of it, once, however much of it is mapped
    and touched, and a file no process holds adds nothing."""
    import mmap
    import os

    from pdkv.bench.ab.resources import held_bytes, pss_bytes

    size = 8 << 20
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        m = mmap.mmap(fd, size)
        me = os.getpid()
        base = pss_bytes(me)
        assert held_bytes([me]) - base >= size - (1 << 20)  # untouched: not in PSS, held whole
        m[: size // 2] = b"\1" * (size // 2)  # touched: now half of it is in PSS too
        assert pss_bytes(me) - base >= size // 2 - (1 << 20)
        assert abs(held_bytes([me]) - (pss_bytes(me) - size // 2) - size) < (2 << 20)
        twice = held_bytes([me, me])  # the process counted twice, its file once
        assert abs(twice - 2 * held_bytes([me]) + size) < (4 << 20)
        m.close()
    finally:
        os.close(fd)
    assert held_bytes([me]) - pss_bytes(me) < (1 << 20)
