"""``tools/topo capture OUT``: save the files discovery reads into a tree users can attach to a
bug report, and ``--sysfs`` can read back anywhere.

The tree mirrors the machine's paths (``OUT/sys/...``, ``OUT/proc/...``) and keeps sysfs's
links as relative symlinks, so ``sys/bus/pci/devices/<bdf>`` still points into the PCIe
hierarchy under ``sys/devices/pci*/``; the links that point back up the tree (a class device's
``device`` link to its own PCI function) would make a directory cycle, so they are listed in
``pdkv-capture/links.txt`` instead and read from there. ``OUT.tar.gz`` (or ``.tgz``) writes a tarball instead
(tar keeps symlinks; zip files and some upload forms do not). ``pdkv-capture/`` holds what is
not a file on the machine: nvidia-smi's answer and a short description of the capture.
"""

from __future__ import annotations

import os
import platform
import shutil
import tarfile
import tempfile
import time

from pdkv.topo.discover import PCI_ATTRS, ZERO_GID
from pdkv.topo.gpu import SMI_CAPTURE, run_nvidia_smi
from pdkv.topo.tree import LINK_MANIFEST, SysfsTree, format_link_manifest, is_back_link

RDMA_ATTRS = ("node_guid", "fw_ver", "hca_type", "board_id", "node_type")
PORT_ATTRS = ("state", "phys_state", "link_layer", "rate", "lid", "sm_lid")
NET_ATTRS = ("mtu", "operstate", "address", "type", "speed", "dev_port", "dev_id")
TARBALL = (".tar.gz", ".tgz")


class _Writer:
    def __init__(self, src: SysfsTree, out: str):
        self.src, self.out, self.num_files = src, out, 0
        self.back_links: dict[str, str] = {}

    def file(self, rel: str) -> None:
        """Copy one attribute (rel is resolved first: written where it really lives)."""
        text = self.src.read(rel)
        if text is None:
            return
        dest = os.path.join(self.out, self.src.resolve(rel))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "w") as f:
            f.write(text + "\n")
        self.num_files += 1

    def link(self, rel: str) -> None:
        """Copy one symlink as a relative link (absolute targets are rewritten relative)."""
        parent = self.src.resolve(os.path.dirname(rel))
        where = os.path.join(parent, os.path.basename(rel)) if parent else os.path.basename(rel)
        full = self.src.path(where)
        target = self.src.manifest.get(where)
        if target is None:
            if not os.path.islink(full):
                return
            target = os.readlink(full)
        if target.startswith("/"):
            target = os.path.relpath(target.lstrip("/"), parent or ".")
        if is_back_link(where, target):
            self.back_links[where] = target  # a cycle on disk: recorded in the manifest instead
            return
        dest = os.path.join(self.out, where)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if not os.path.lexists(dest):
            os.symlink(target, dest)
            self.num_files += 1


def capture(out: str, sysfs_root: str = "/") -> int:
    """Write the capture of ``sysfs_root`` to ``out`` (a new directory, or a .tar.gz); returns
    the number of files and links written. Refuses to touch an existing non-empty ``out``."""
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise FileExistsError(f"capture output {out!r} already exists; choose a new path")
    if out.endswith(TARBALL):
        with tempfile.TemporaryDirectory(prefix="pdkv-topo-") as tmp:
            n = capture(os.path.join(tmp, "tree"), sysfs_root)
            with tarfile.open(out, "w:gz") as tar:
                tar.add(os.path.join(tmp, "tree"), arcname=".")
            return n
    src = SysfsTree(sysfs_root)
    os.makedirs(out, exist_ok=True)
    w = _Writer(src, out)
    try:
        _capture_into(src, w)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half capture left behind
        raise
    return w.num_files


def _capture_into(src: SysfsTree, w: _Writer) -> None:
    w.file("sys/devices/system/cpu/online")
    for node in src.listdir("sys/devices/system/node"):
        if node.startswith("node") and node[4:].isdigit():
            w.file(f"sys/devices/system/node/{node}/cpulist")
            w.file(f"sys/devices/system/node/{node}/meminfo")
    for bdf in src.listdir("sys/bus/pci/devices"):
        rel = f"sys/bus/pci/devices/{bdf}"
        w.link(rel)
        for attr in PCI_ATTRS:
            w.file(f"{rel}/{attr}")
        w.link(f"{rel}/driver")
    for dev in src.listdir("sys/class/infiniband"):
        rel = f"sys/class/infiniband/{dev}"
        w.link(rel)
        w.link(f"{rel}/device")
        for attr in RDMA_ATTRS:
            w.file(f"{rel}/{attr}")
        for port in src.listdir(f"{rel}/ports"):
            prel = f"{rel}/ports/{port}"
            for attr in PORT_ATTRS:
                w.file(f"{prel}/{attr}")
            for i in src.listdir(f"{prel}/gids"):
                if src.read(f"{prel}/gids/{i}") not in (None, ZERO_GID):
                    w.file(f"{prel}/gids/{i}")
                    w.file(f"{prel}/gid_attrs/types/{i}")
                    w.file(f"{prel}/gid_attrs/ndevs/{i}")
    for name in src.listdir("sys/class/net"):
        rel = f"sys/class/net/{name}"
        w.link(rel)
        w.link(f"{rel}/device")
        for attr in NET_ATTRS:
            w.file(f"{rel}/{attr}")
    for bdf in src.listdir("proc/driver/nvidia/gpus"):
        w.file(f"proc/driver/nvidia/gpus/{bdf}/information")
    if w.back_links:
        _write(w, LINK_MANIFEST, format_link_manifest(w.back_links))
    smi = run_nvidia_smi()[0] if src.live else src.read(SMI_CAPTURE)
    if smi:
        _write(w, SMI_CAPTURE, smi.strip() + "\n")
    info = src.read("pdkv-capture/CAPTURE.txt") if not src.live else None
    _write(w, "pdkv-capture/CAPTURE.txt", info + "\n" if info else _describe())


def _write(w: _Writer, rel: str, text: str) -> None:
    dest = os.path.join(w.out, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest, "w") as f:
        f.write(text)
    w.num_files += 1


def _describe() -> str:
    u = platform.uname()
    lines = [f"captured_at: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
             f"hostname: {u.node}", f"kernel: {u.system} {u.release} {u.machine}",
             f"CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}",
             f"CUDA_DEVICE_ORDER: {os.environ.get('CUDA_DEVICE_ORDER', '(unset)')}",
             "read back with: tools/topo --sysfs <this directory>"]
    return "\n".join(lines) + "\n"


def open_tree(path: str, tmp_parent: str) -> str:
    """A directory to read: ``path`` itself, or a .tar.gz capture unpacked under ``tmp_parent``."""
    if not path.endswith(TARBALL):
        return path
    dest = tempfile.mkdtemp(prefix="capture-", dir=tmp_parent)
    with tarfile.open(path, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")  # no absolute or escaping links, no devices
        else:  # Python < 3.11.4: the same checks by hand
            for m in tar.getmembers():
                target = os.path.normpath(os.path.join(os.path.dirname(m.name), m.linkname or "."))
                if not (m.isfile() or m.isdir() or m.issym()) or os.path.isabs(m.name) \
                        or m.name.startswith("..") or (m.issym() and (os.path.isabs(m.linkname)
                                                                      or target.startswith(".."))):
                    raise ValueError(f"{path}: refusing unsafe member {m.name!r} in a capture")
            tar.extractall(dest)
    return dest
