"""The RDMA probe: can pdkv's verbs transport really work on this host, on which NICs?

``tools/topo --probe`` (pdkv/probe/cli.py) and ``pdkv serve`` (``serve_check``, before the
weights load) run the same checks on each RDMA device, through rdma-core's pyverbs where it
imports (via_pyverbs.py) and else through pdkv's own verbs messenger (via_messenger.py): open it,
query every port (state, link layer, rate, MTU, GID table), allocate a PD, create a CQ and an RC
QP and move 4 KiB through the port, register the host memory the node will register (checked
against RLIMIT_MEMLOCK first), and with a GPU try dma-buf and peer-memory registration (gpu.py).
Each device ends as one line: OK, or what is missing and how to fix it (checks.py, report.py).
docs/TOPO.md describes the output.
"""

from pdkv.probe.needs import ConfigNeeds, config_needs, serve_check
from pdkv.probe.report import DeviceReport, PortInfo, Problem
from pdkv.probe.run import ProbeResult, ProbeUnavailable, run_probe

__all__ = ["ConfigNeeds", "DeviceReport", "PortInfo", "Problem", "ProbeResult", "ProbeUnavailable",
           "config_needs", "run_probe", "serve_check"]
