"""`tools/topo capture`: a capture reads back as the same topology, and re-capturing is exact."""

import os
import sys

import pytest

from pdkv.topo import discover
from pdkv.topo.capture import capture
from pdkv.topo.render import to_dict

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")


def snapshot(root: str) -> dict[str, tuple[str, str]]:
    """Every file and link under root (links not followed): {relpath: (kind, content or target)}."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = ("link", os.readlink(full))
            elif os.path.isfile(full):
                with open(full) as f:
                    out[rel] = ("file", f.read())
    return out


def comparable(topology) -> dict:
    d = to_dict(topology)
    d.pop("sysfs_root")
    return d


@pytest.mark.parametrize("host", ["dgx-h100", "no-accel", "live-vm"])
def test_capturing_a_capture_reproduces_it_exactly(host, tmp_path):
    out = str(tmp_path / "again")
    n = capture(out, os.path.join(FIX, host))
    assert snapshot(out) == snapshot(os.path.join(FIX, host))
    assert n == len(snapshot(out))


@pytest.mark.parametrize("host", ["dgx-h100", "aws-p5", "no-accel"])
def test_committed_fixtures_are_what_make_fixtures_writes(host):
    sys.path.insert(0, HERE)
    try:
        import make_fixtures
    finally:
        sys.path.remove(HERE)
    w = make_fixtures.build(host)
    built = {rel: ("file", text) for rel, text in w.files.items()}
    built.update({rel: ("link", target) for rel, target in w.links.items()})
    committed = {rel: v for rel, v in snapshot(os.path.join(FIX, host)).items()}
    assert built == committed


def test_live_capture_round_trips(tmp_path):
    out = str(tmp_path / "live")
    capture(out)
    assert comparable(discover(out)) == comparable(discover("/"))
    assert os.path.islink(os.path.join(out, "sys/bus/pci/devices")) is False
    for bdf in os.listdir("/sys/bus/pci/devices"):
        link = os.path.join(out, "sys/bus/pci/devices", bdf)
        assert os.path.islink(link) and not os.readlink(link).startswith("/")


def test_capture_never_overwrites(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        capture(str(out), os.path.join(FIX, "no-accel"))
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        capture(str(tmp_path / "new"), str(tmp_path / "no-such-root"))
    assert not (tmp_path / "new").exists()
