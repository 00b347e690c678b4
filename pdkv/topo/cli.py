"""``tools/topo``: show the topology (table or --json), or capture it for a bug report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

from pdkv.topo.capture import capture, open_tree
from pdkv.topo.discover import discover
from pdkv.topo.model import TopologyError
from pdkv.topo.render import to_dict
from pdkv.topo.report import format_report

USAGE = """\
topo [--sysfs ROOT] [--json] [--gpu BUS_ID] [--nics auto|NIC,NIC...]
topo capture OUT [--sysfs ROOT]
topo --probe [-c CONFIG] [--nics NIC,NIC...] [--json]   (does RDMA work here? see --probe --help)"""


def _show_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="topo", usage=USAGE, description=(
        "Show GPUs (by PCI bus id), RDMA devices and ports, network interfaces, NUMA nodes, the "
        "PCIe tree, and the NIC/CPU placement the messenger would use for each GPU."))
    p.add_argument("--sysfs", default="/", metavar="ROOT",
                   help="read a captured tree (directory or .tar.gz) instead of this machine")
    p.add_argument("--json", action="store_true", help="print JSON instead of the report")
    p.add_argument("--gpu", metavar="BUS_ID", help="place only this GPU (PCI bus id, e.g. 0000:1b:00.0)")
    p.add_argument("--nics", default="auto", metavar="auto|LIST",
                   help="the messenger's nics setting to evaluate: auto (default) or comma-separated names")
    return p


def _capture_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="topo capture", description=(
        "Save the sysfs/procfs files topology discovery reads into OUT (a new directory, or a "
        ".tar.gz) so it can be attached to a bug report and read back with --sysfs OUT."))
    p.add_argument("out", metavar="OUT")
    p.add_argument("--sysfs", default="/", metavar="ROOT", help="capture from this tree instead of /")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="pdkv-topo-") as tmp:
        try:
            if argv[:1] == ["capture"]:
                args = _capture_parser().parse_args(argv[1:])
                n = capture(args.out, open_tree(args.sysfs, tmp))
                print(f"captured {n} files and links into {args.out}; read back with: "
                      f"tools/topo --sysfs {args.out}")
                return 0
            args = _show_parser().parse_args(argv)
            nics = [n.strip() for n in args.nics.split(",") if n.strip()]
            topology = discover(open_tree(args.sysfs, tmp))
            # Name the tree the user gave, not the temporary directory a tarball was unpacked in.
            topology = dataclasses.replace(topology, sysfs_root=os.path.abspath(args.sysfs))
            data = to_dict(topology, nics, args.gpu)
            if args.json:
                print(json.dumps(data, indent=2))
            else:
                print(format_report(topology, nics, args.gpu, data), end="")
        except BrokenPipeError:  # `tools/topo | head`: the reader left, nothing to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except (TopologyError, OSError, ValueError) as e:
            print(f"topo: error: {e}", file=sys.stderr)
            return 2
    # The tool's job is to report: a host without GPU or RDMA is a successful run. Only a
    # placement the user asked for explicitly (--gpu or --nics) that cannot be made fails.
    explicit = args.gpu is not None or nics != ["auto"]
    return 1 if explicit and any(p["error"] for p in data["placement"]) else 0
