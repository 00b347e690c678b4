"""The ``pdkv`` command line (also ``python -m pdkv``).

    pdkv serve  -c configs/colocated.yaml [--set server.port=8001 --set model.path=/models/qwen]
    pdkv up     -c configs/local-disagg.yaml [--set ...]   # prefill + decode nodes on loopback
                                                           # (decode.replicas > 1: and a router)
    pdkv router -c configs/router.yaml [--set port=8080]  # one API in front of several nodes
    pdkv config -c configs/colocated.yaml [--set ...]     # print the resolved config as YAML
    pdkv default-model                                     # print the shipped default model's path
    pdkv plan   -c configs/deepseek-r1/cluster-tp8.yaml    # one request's KV plan (pdkv/plan.py)
    pdkv planner -c configs/planner.yaml                   # scale prefill and decode apart (pdkv/planner)

Config errors exit with status 2 and one line that names the file (or --set), the field and
what was expected; a model that cannot be loaded exits with status 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, Sequence

from pdkv.config import Config, ConfigError, config_to_dict, load_config

log = logging.getLogger("pdkv")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdkv", description="LLM serving with disaggregated prefill and decode.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def config_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("-c", "--config", metavar="FILE", help="YAML role config (default: built-in defaults)")
        sp.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                        help="override a config field with a dotted key mirroring the YAML, "
                             "e.g. --set server.port=8001 (repeatable)")

    serve = sub.add_parser("serve", help="serve one role over HTTP (OpenAI-compatible API)")
    config_args(serve)
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None,
                       help="log level (default: PDKV_LOG_LEVEL or info)")
    upp = sub.add_parser("up", help="start a local disaggregated cluster (prefill.replicas + "
                                     "decode.replicas nodes, a router when decode.replicas > 1) and serve "
                                     "the API until Ctrl-C")
    config_args(upp)
    upp.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None)
    rt = sub.add_parser("router", help="serve one OpenAI API in front of several decode/colocated nodes, "
                                        "choosing each request's node by load and prefix affinity")
    rt.add_argument("-c", "--config", metavar="FILE", help="router YAML (nodes, policy; see configs/router.yaml)")
    rt.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                    help="override a router field, e.g. --set port=8080 or --set 'nodes=[http://h:8001]'")
    rt.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None)
    show = sub.add_parser("config", help="print the resolved config (after --set) as YAML")
    config_args(show)
    sub.add_parser("default-model", help="print the path of the shipped default model")
    plan = sub.add_parser("plan", help="what one request costs a deployment (KV bytes, pages and writes per "
                                       "rank pair, bytes per NIC, immediates, weights per rank); no weights read")
    plan.add_argument("-c", "--config", metavar="FILE", required=True, help="cluster or role YAML")
    plan.add_argument("--prompt-len", type=int, default=4096, metavar="N", help="prompt tokens (default 4096)")
    plan.add_argument("--topo", metavar="DIR", default=None, help="a captured sysfs tree (tools/topo --capture); "
                                                                  "default: this host")
    plan.add_argument("--request-id", default="req-0", help="the request whose seeded replica choice is shown")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    plan.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                      help="each GPU's memory for the fits / does-not-fit verdict (default: the file's "
                           "deployment.gpu_memory_gib)")
    pl = sub.add_parser("planner", help="size the prefill and decode pools from measured load and the SLOs "
                                         "(/plan, pdkv_planner_desired_nodes); actuators local | kubernetes")
    pl.add_argument("-c", "--config", metavar="FILE", required=True, help="planner YAML (configs/planner.yaml)")
    pl.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                    help="override a planner field, e.g. --set slo.ttft_ms=1500")
    pl.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None)
    return p


def _setup_logging(level: str | None) -> None:
    from pdkv.env import ENV

    logging.basicConfig(level=(level or ENV.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _progress_bar(desc: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback that draws a tqdm bar on stderr."""
    from tqdm import tqdm

    state: dict[str, tqdm] = {}

    def progress(done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=True)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return progress


def load_engine(cfg: Config):
    """Load the engine of ``cfg`` with a progress bar while the weights load."""
    from pdkv.engine import build_engine

    where = cfg.model.path or "the shipped default model"
    log.info("loading %s (%s, %s)", where, cfg.model.dtype, cfg.model.device)
    if cfg.parallel.dp > 1:  # a data-parallel expert-parallel group: its front serves it (pdkv/dp)
        from pdkv.dp.group import DPGroup
        from pdkv.errors import PdkvError

        try:
            return DPGroup.from_config(cfg)
        except ValueError as e:  # ConfigError too: a role or a model the group cannot run, named
            raise PdkvError(str(e)) from None
    kw = {}
    # one contiguous KV buffer, registered with the messenger (with tp > 1 pdkv.tp makes every rank's)
    if cfg.role in ("prefill", "decode") and cfg.parallel.tp == 1:
        from pdkv.disagg.node import kv_buffer_factory

        kw["kv_buffer"] = kv_buffer_factory(cfg.model.device)
    engine = build_engine(cfg, progress=_progress_bar("loading weights"), **kw)
    stats = engine.stats()
    log.info("model '%s' ready: max_model_len %d, KV cache %d pages of %d tokens",
             engine.model_name, engine.max_model_len, stats.get("num_pages_total", 0), cfg.kv_cache.page_size)
    return engine


def cmd_serve(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    cfg = load_config(args.config, args.overrides)
    from pdkv.cpus import pin_cpus
    from pdkv.errors import PdkvError

    try:
        pin_cpus(cfg.parallel.cpus)  # before the engine: its torch threads follow the affinity
    except OSError as e:
        print(f"pdkv: {cfg.source}: {e}", file=sys.stderr)
        return 1
    if cfg.parallel.gpu_sm_percent not in (0, 100):  # before anything initializes CUDA (MPS reads it then)
        from pdkv.gpu import sm_split

        try:
            split = sm_split.probe(cfg.model.device, cfg.parallel.gpu_sm_percent)
            sm_split.apply(split, cfg.model.device)
        except sm_split.SMSplitError as e:
            print(f"pdkv: {cfg.source}: {e}", file=sys.stderr)
            return 2
        log.info("GPU SM split: %d%% by %s%s", split.percent, split.mechanism,
                 f" ({split.num_sms} SMs)" if split.num_sms else "")
    if cfg.role in ("prefill", "decode"):
        from pdkv.config import ConfigError
        from pdkv.disagg.staged import staging_mode

        try:  # before the weights load: a KV placement this host cannot move is refused by name
            staging_mode(cfg)
        except ConfigError as e:
            print(f"pdkv: config error: {e}", file=sys.stderr)
            return 2
        from pdkv.probe import serve_check

        refused = serve_check(cfg)  # verbs: the NICs it will open must work, before the weights load
        if refused:
            print(f"pdkv: {refused}", file=sys.stderr)
            return 1
    try:
        engine = load_engine(cfg)
    except (PdkvError, OSError) as e:
        print(f"pdkv: cannot load the model ({cfg.source}, model.path={cfg.model.path!r}): {e}", file=sys.stderr)
        return 1
    # The CLI builds the node (a role's coordinator + KV connector); the server only serves HTTP
    # around what it is handed.
    from pdkv.disagg.node import build_node
    from pdkv.server import serve

    try:
        return serve(cfg, engine, build_node(cfg, engine))
    except OSError as e:
        print(f"pdkv: {e.strerror or e}", file=sys.stderr)
        return 1


def cmd_up(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    if not args.config:
        raise ConfigError("pdkv up needs a cluster file: pdkv up -c configs/local-disagg.yaml")
    from pdkv.disagg.launcher import up

    return up(args.config, args.overrides, args.log_level)


def cmd_router(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from pdkv.config.router import load_router_config
    from pdkv.router import serve_router

    cfg = load_router_config(args.config, args.overrides)
    try:
        serve_router(cfg)
    except OSError as e:
        print(f"pdkv: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    cfg = load_config(args.config, args.overrides, check_paths=False)
    print(f"# resolved from {cfg.source}" + "".join(f" --set {o}" for o in args.overrides))
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    return 0


def cmd_default_model(args: argparse.Namespace) -> int:
    _setup_logging(None)
    from pdkv.default_model import ensure_default_model

    print(ensure_default_model())
    return 0


def cmd_planner(args: argparse.Namespace) -> int:
    import asyncio

    _setup_logging(args.log_level)
    from pdkv.planner.config import load_planner_config
    from pdkv.planner.service import serve_planner

    cfg = load_planner_config(args.config, args.overrides)  # ConfigError (an SLO no count meets too): status 2
    return asyncio.run(serve_planner(cfg, args.log_level))


def _cmd_plan(args: argparse.Namespace) -> int:
    from pdkv.errors import PdkvError
    from pdkv.plan import cmd_plan

    try:
        return cmd_plan(args)
    except PdkvError as e:  # a bad deployment file or model config: one line, status 2
        print(f"pdkv plan: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"serve": cmd_serve, "up": cmd_up, "router": cmd_router, "config": cmd_config,
                "default-model": cmd_default_model, "plan": _cmd_plan,
                "planner": cmd_planner}
    try:
        return commands[args.command](args)
    except ConfigError as e:
        print(f"pdkv: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
