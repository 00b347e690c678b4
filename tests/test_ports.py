"""pdkv.ports hands out ports a child process can bind: outside the kernel's ephemeral range
(where outgoing connections take theirs), never twice, never one that is in use."""
import itertools
import socket

from pdkv import ports


def test_ports_are_below_the_ephemeral_range_and_distinct():
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(ports._LOW <= p < ports._HIGH for p in got)
    assert ports._HIGH <= ports._ephemeral_low() or ports._HIGH == ports._LOW + 1000


def test_a_port_in_use_below_the_range_is_skipped(monkeypatch):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = ports.free_port()
        s.bind(("127.0.0.1", port))
        s.listen()
        monkeypatch.setattr(ports, "_next", itertools.count(port - ports._LOW))  # it comes up first
        got = ports.free_port()
        assert got != port and got > port


def test_unreadable_port_range_falls_back(tmp_path):
    assert ports._ephemeral_low(str(tmp_path / "missing")) == 32768
    (tmp_path / "r").write_text("40000\t60999\n")
    assert ports._ephemeral_low(str(tmp_path / "r")) == 40000
