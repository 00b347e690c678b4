"""NIC / GPU / NUMA / PCIe topology: discovery from sysfs, and the messenger's NIC placement.

    topology = discover()                       # this machine; discover("capture/") reads a capture
    p = placement(topology, "0000:1b:00.0", ["auto"])
    p.nics, p.cpus, p.reason                    # ['mlx5_0'], [0, 1, ...], 'same PCIe switch as ...'

GPUs are named by PCI bus id only; ``bus_id_for_ordinal`` turns a CUDA ordinal into one under a
given CUDA_VISIBLE_DEVICES. ``tools/topo`` shows all of it; docs/TOPO.md explains the output.
"""

from pdkv.topo.cuda import CudaMapping, bus_id_for_ordinal, cuda_mapping, torch_device_bus_id
from pdkv.topo.discover import discover
from pdkv.topo.model import (Gid, Gpu, NetInterface, NumaNode, PciDevice, RdmaDevice, RdmaPort,
                             Topology, TopologyError)
from pdkv.topo.placement import Placement, gpu_mapping, placement

__all__ = [
    "CudaMapping", "Gid", "Gpu", "NetInterface", "NumaNode", "PciDevice", "Placement", "RdmaDevice",
    "RdmaPort", "Topology", "TopologyError", "bus_id_for_ordinal", "cuda_mapping", "discover",
    "gpu_mapping", "placement", "torch_device_bus_id",
]
