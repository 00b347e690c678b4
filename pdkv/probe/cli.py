"""``tools/topo --probe``: can pdkv's verbs transport work on this host, on which NICs?

    tools/topo --probe                          # every RDMA device: one line each
    tools/topo --probe -c configs/prefill.yaml  # the NICs that config's node would open, with
                                                # its KV cache's size registered
    tools/topo --probe --nics mlx5_0:1 --bytes 64GiB --json

Exit status: 0 when every device probed is usable; 1 when one is not (or there is none); 2 for
bad input (a config error, an unknown option, a backend that cannot run here).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"--bytes: expected a size such as 4096, 512MiB or 16GiB, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="topo --probe", description=(
        "Check that pdkv's verbs transport can use this host's RDMA devices: open each, query its "
        "ports and GIDs, make a PD, CQ and RC QP and move 4 KiB through the port, register the host "
        "memory pdkv would register and, with a GPU, try dma-buf and peer-memory registration."))
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-c", "--config", metavar="FILE", help="probe the NICs this role config would open")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config field (as pdkv serve --set)")
    p.add_argument("--nics", metavar="LIST", help="comma-separated devices (dev or dev:port) or interfaces")
    p.add_argument("--bytes", metavar="SIZE", help="host memory to register (default: the config's KV "
                                                   "cache or staging ring; 0 without a config)")
    p.add_argument("--cuda", metavar="N|off", default=None,
                   help="GPU for the GPUDirect checks (default: the config's model.device, else cuda:0 "
                        "where an NVIDIA GPU and CUDA are present)")
    p.add_argument("--backend", choices=("auto", "pyverbs", "messenger"), default="auto",
                   help="pyverbs (rdma-core's Python bindings) or pdkv's own verbs messenger; auto: "
                        "pyverbs where it imports")
    p.add_argument("--sysfs", default="/", metavar="ROOT", help="sysfs tree for interface names (default /)")
    p.add_argument("--json", action="store_true", help="print JSON instead of one line per device")
    p.add_argument("-v", "--verbose", action="store_true", help="also the checks made and every port")
    return p


def _gpu(args, ordinal):
    """(DeviceMemory or None, note)."""
    from pdkv.probe.gpu import cuda_memory  # noqa: PLC0415

    if args.cuda == "off":
        return None, ""
    if args.cuda is not None:
        if not args.cuda.isdigit():
            raise ValueError(f"--cuda: expected a CUDA ordinal or off, got {args.cuda!r}")
        ordinal = int(args.cuda)
    if ordinal is None:
        from pdkv.topo import discover  # noqa: PLC0415

        if not discover(args.sysfs).gpus:
            return None, "GPUDirect not checked: no NVIDIA GPU on this host"
        ordinal = 0
    mem, why = cuda_memory(ordinal)
    return mem, f"GPUDirect not checked: {why}" if why else ""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from pdkv.config import ConfigError, load_config  # noqa: PLC0415
    from pdkv.probe.needs import config_needs  # noqa: PLC0415
    from pdkv.probe.paths import gpu_paths, path_lines  # noqa: PLC0415
    from pdkv.probe.run import ProbeUnavailable, run_probe  # noqa: PLC0415
    from pdkv.topo import TopologyError, discover  # noqa: PLC0415

    gpu = None
    try:
        nics = [n.strip() for n in (args.nics or "").split(",") if n.strip()]
        host_bytes, what, ordinal, required, head = 0, "host memory", None, False, ""
        if args.config:
            cfg = load_config(args.config, args.overrides, check_paths=False)
            needs = config_needs(cfg, args.sysfs)
            nics = nics or list(needs.nics)
            host_bytes, what, ordinal, required = (needs.host_bytes, needs.what, needs.gpu_ordinal,
                                                   needs.gpudirect_required)
            head = f"{cfg.source}: NICs {', '.join(needs.nics)} ({needs.reason})"
        if args.bytes is not None:
            host_bytes = parse_bytes(args.bytes)
        if args.config and ordinal is None and args.cuda is None:  # CPU KV: no GPU memory to reach
            gpu, gpu_note = None, "GPUDirect not checked: the config's model.device is cpu"
        else:
            gpu, gpu_note = _gpu(args, ordinal)
        try:
            topology = discover(args.sysfs)
        except (TopologyError, OSError):
            topology = None
        result = run_probe(nics, host_bytes, what, args.backend, gpu, gpu_note, required, topology)
    except (ConfigError, TopologyError, ValueError, ProbeUnavailable) as e:
        print(f"topo --probe: error: {e}", file=sys.stderr)
        return 2
    finally:
        if gpu is not None:
            gpu.close()
    paths = gpu_paths(topology, result.reports)
    if args.json:
        print(json.dumps({"config": args.config, **result.to_dict(), "gpu_paths": paths}, indent=2))
    else:
        print(f"pdkv RDMA probe through {result.backend}" + (f"; {head}" if head else ""))
        for p in result.problems:
            print(f"NOT USABLE: {p}")
        for r in result.reports:
            print(r.line())
            if args.verbose:
                print("".join(f"    done: {c}\n" for c in r.checks), end="")
                for p in r.ports:
                    print(f"    port {p.num}: {p.state} ({p.phys_state}), {p.link_layer}, {p.rate}, "
                          f"MTU {p.active_mtu}/{p.max_mtu}, LID {p.lid}, GIDs: "
                          + (", ".join(f"{g.index}:{g.gid} {g.type}" for g in p.gids) or "none"))
                if r.attrs:
                    print("    device: " + ", ".join(f"{k} {v}" for k, v in r.attrs.items()))
        if paths:
            print("Fastest path from each GPU (the messenger's placement, docs/TOPO.md):")
            print("".join(f"  {line}\n" for line in path_lines(paths)), end="")
        for n in result.notes:
            print(f"note: {n}")
    return 0 if result.ok else 1
