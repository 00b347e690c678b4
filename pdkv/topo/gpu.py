"""GPUs: found on the PCI bus, named by the driver.

The PCI bus says where a GPU is (vendor 0x10de, display class 03xx); the driver says what it is
(model, UUID). Driver sources, best first:

- ``nvidia-smi --query-gpu=...`` on the live machine; in a captured tree, the same command's
  output saved by ``tools/topo capture`` as ``pdkv-capture/nvidia-smi.csv``;
- ``proc/driver/nvidia/gpus/<bdf>/information`` (present whenever the kernel module is loaded).

NOTE: only NVIDIA GPUs are recognised. The BMC's VGA function (ASPEED 1a03:2000, class 0300)
is on every server board and must not count as a GPU, so "any display device" is not a rule.
"""

from __future__ import annotations

import shutil
import subprocess

from pdkv.topo.model import Gpu, PciDevice
from pdkv.topo.pcie import normalize_bus_id
from pdkv.topo.tree import SysfsTree

NVIDIA = "0x10de"
SMI_QUERY = ["nvidia-smi", "--query-gpu=index,pci.bus_id,uuid,name", "--format=csv,noheader"]
SMI_CAPTURE = "pdkv-capture/nvidia-smi.csv"


def is_gpu(dev: PciDevice) -> bool:
    return dev.vendor == NVIDIA and dev.class_code[:4] == "0x03"


def run_nvidia_smi(timeout: float = 15.0) -> tuple[str | None, str]:
    """(output, note): nvidia-smi's CSV, or None and why not."""
    if shutil.which("nvidia-smi") is None:
        return None, "nvidia-smi not found"
    try:
        res = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi failed: {e}"
    if res.returncode != 0:
        return None, f"nvidia-smi exited {res.returncode}: {(res.stderr or res.stdout).strip()[:200]}"
    return res.stdout, ""


def parse_smi_csv(text: str) -> dict[str, tuple[str, str]]:
    """``0, 00000000:1B:00.0, GPU-..., NVIDIA H100 80GB HBM3`` lines → {bus_id: (model, uuid)}."""
    out = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 4:
            out[normalize_bus_id(fields[1])] = (", ".join(fields[3:]), fields[2])
    return out


def parse_proc_information(text: str) -> tuple[str, str, str]:
    """proc/driver/nvidia/gpus/<bdf>/information → (bus_id, model, uuid)."""
    info = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    bus = info.get("Bus Location", "")
    return (normalize_bus_id(bus) if bus else ""), info.get("Model", ""), info.get("GPU UUID", "")


def find_gpus(tree: SysfsTree, pci: dict[str, PciDevice]) -> tuple[list[Gpu], list[str]]:
    """NVIDIA GPUs in PCI bus order (= nvidia-smi index order), with notes on what was missing."""
    notes: list[str] = []
    driver: dict[str, tuple[str, str, str]] = {}
    for bdf in tree.listdir("proc/driver/nvidia/gpus"):
        text = tree.read(f"proc/driver/nvidia/gpus/{bdf}/information")
        if text:
            bus, model, uuid = parse_proc_information(text)
            driver[bus or bdf] = (model, uuid, "/proc/driver/nvidia")
    smi_text = None
    if tree.live:
        smi_text, why = run_nvidia_smi()
        if smi_text is None and any(is_gpu(d) for d in pci.values()):
            notes.append(why)
    else:
        smi_text = tree.read(SMI_CAPTURE)
    if smi_text:
        for bus, (model, uuid) in parse_smi_csv(smi_text).items():
            driver[bus] = (model, uuid, "nvidia-smi")
    gpus = []
    for bdf in sorted(pci):
        if is_gpu(pci[bdf]):
            model, uuid, source = driver.get(bdf, ("", "", "pci"))
            gpus.append(Gpu(bus_id=bdf, pci=pci[bdf], model=model, uuid=uuid, source=source))
    for bus in sorted(set(driver) - {g.bus_id for g in gpus}):
        notes.append(f"the NVIDIA driver reports a GPU at {bus} that is not on the PCI bus listing")
    if gpus and all(g.source == "pci" for g in gpus):
        notes.append("NVIDIA GPUs on the PCI bus but no driver information (module not loaded?)")
    return gpus, notes
