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
    and touched, and a file no process holds adds nothing. The file is held by a small quiet
    child, not by this test's worker: a worker's PSS moves by megabytes between two reads as
    other processes map and unmap the libraries it shares."""
    import subprocess
    import sys

    from pdkv.bench.ab.resources import held_breakdown, held_bytes, pss_bytes

    size = 8 << 20
    child = subprocess.Popen([sys.executable, "-S", "-c", _HOLDER, str(size)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        def step(cmd: str) -> None:
            child.stdin.write(cmd + "\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == cmd

        step("plain")
        pid, base = child.pid, pss_bytes(child.pid)
        assert held_bytes([pid]) - base < (1 << 20)  # nothing held beyond its PSS
        step("map")
        assert held_bytes([pid]) - base >= size - (1 << 20)  # untouched: not in PSS, held whole
        step("touch")  # touched: now half of it is in PSS too
        assert pss_bytes(pid) - base >= size // 2 - (1 << 20)
        assert abs(held_bytes([pid]) - (pss_bytes(pid) - size // 2) - size) < (2 << 20)
        twice = held_breakdown([pid, pid])  # the process counted twice, its file once
        assert twice["shm_bytes"] == size
        one = held_bytes([pid])
        assert abs(twice["held_bytes"] - 2 * one + size) < (2 << 20)
        step("close")
        assert held_bytes([pid]) - pss_bytes(pid) < (1 << 20)
    finally:
        child.kill()
        child.wait()


# The holder: waits for each command on stdin and echoes it once done, so every measurement
# sees one settled state.
_HOLDER = """
import mmap, os, sys
size = int(sys.argv[1])
fd = m = None
for cmd in sys.stdin:
    cmd = cmd.strip()
    if cmd == "map":
        fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, size)
        m = mmap.mmap(fd, size)
    elif cmd == "touch":
        m[: size // 2] = b"\\1" * (size // 2)
    elif cmd == "close":
        m.close()
        os.close(fd)
    print(cmd, flush=True)
"""


def test_the_peak_breakdown_names_each_process_and_counts_a_shared_file_once(tmp_path):
    """Two real processes mapping one /dev/shm file: the breakdown lists both, the file once (its
    whole allocation), and its parts add up to held_bytes; the report's memory table prints them
    with the ratio against colocated's held bytes. Both are small quiet children (as above): the
    test's worker's own PSS moves by megabytes between two reads."""
    import os
    import subprocess
    import sys
    import time

    from pdkv.bench.ab.report import _memory_table
    from pdkv.bench.ab.resources import Sampler, held_breakdown, held_bytes

    size = 16 << 20
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    children = []
    try:
        os.posix_fallocate(fd, 0, size)
        for touch in (1, 0):  # the first writes a quarter of the file, the second reads that quarter
            child = subprocess.Popen([sys.executable, "-S", "-c", f"import mmap,sys,time\nm = mmap.mmap({fd}, 0)\n"
                                      f"if {touch}:\n    m[:len(m)//4] = b'\\2' * (len(m)//4)\nm[:len(m)//4]\n"
                                      "sys.stdout.write('ok\\n'); sys.stdout.flush(); time.sleep(60)"],
                                     pass_fds=(fd,), stdout=subprocess.PIPE, text=True)
            children.append(child)
            assert child.stdout.readline() == "ok\n"
        pids = [c.pid for c in children]
        parts = held_breakdown(pids)
        assert [v["pid"] for v in parts["procs"]] == pids
        assert parts["shm_bytes"] >= size  # the file once, whole, though both map it
        assert parts["shm_bytes"] < 2 * size
        assert parts["held_bytes"] == parts["shm_bytes"] + sum(v["pss_bytes"] for v in parts["procs"])
        assert abs(held_bytes(pids) - parts["held_bytes"]) < (2 << 20)
        for v in parts["procs"]:
            assert 0 < v["private_bytes"] <= v["pss_bytes"] + (1 << 20)
        s = Sampler(lambda: pids, period=0.05, names=lambda: dict(zip(pids, ("writer", "reader")))).start()
        time.sleep(0.2)
        res = s.stop()
        pm = res["peak_memory"]
        assert sorted(p["name"] for p in pm["procs"]) == ["reader", "writer"]
        assert pm["held_bytes"] == res["peak_held_bytes"]
        half = {**pm, "held_bytes": pm["held_bytes"] // 2}
        lines = _memory_table([{"arch": "colocated", "resources": {"peak_memory": half}},
                               {"arch": "pair", "resources": {"peak_memory": pm}}])
        row = next(line for line in "\n".join(lines).splitlines() if line.startswith("| pair "))
        assert f"| {pm['held_bytes'] / half['held_bytes']:.2f}x |" in row and "writer " in row and "reader " in row
    finally:
        for child in children:
            child.kill()
            child.wait()
        os.close(fd)


def test_disagg_shm_forks_its_nodes_and_a_bad_fork_value_is_named(tmp_path):
    import pytest

    from pdkv.config import ConfigError

    assert A.builtin("disagg-shm").fork and not A.builtin("disagg").fork and not A.builtin("colocated").fork
    assert A.with_pd(A.builtin("disagg-shm"), "1:2", "auto").fork
    f = tmp_path / "bad.yaml"
    f.write_text("kind: disagg\nfork: yes-please\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: fork must be true or false .* got 'yes-please'"):
        A.load_arch("bad", f)
