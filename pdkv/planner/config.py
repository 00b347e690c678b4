"""The planner's config (``pdkv planner -c configs/planner.yaml``): a file of its own, not a role.

    slo: {ttft_ms: 2000, itl_ms: 150, quantile: 0.9}
    interval_s: 5
    capacities: capacity.json        # python -m pdkv.bench capacity -o capacity.json, or inline
    nodes: {prefill: 1..8, decode: 1..8}   # "min..max" per role (or {min: 1, max: 8})
    policy: {target_utilization: 0.8, scale_down_utilization: 0.6, scale_down_cooldown_s: 60, ...}
    server: {host: 127.0.0.1, port: 8090}  # /plan, /metrics (pdkv_planner_desired_nodes{role}), /health
    observe: {prefill: [http://...], decode: [http://...]}   # static list, or {dns: name, port: N}
    actuator: {kind: none | local | kubernetes, local: {...}}

Errors are ConfigError naming the file and the field, like every other config of pdkv; an SLO
that no count of nodes can meet (pdkv/planner/capacity.py InfeasibleSLO) is one too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from pdkv.config import ConfigError, _read_yaml
from pdkv.planner.capacity import Capacities, capacities_from_dict, load_capacities
from pdkv.planner.decide import ROLES, Planner, Policy

ACTUATORS = ("none", "local", "kubernetes")


@dataclass(frozen=True)
class PlannerConfig:
    policy: Policy
    caps: Capacities
    quantile: float = 0.9
    host: str = "127.0.0.1"
    port: int = 8090
    observe: dict = field(default_factory=dict)  # role -> list of base URLs, or {"dns": name, "port": n}
    actuator: str = "none"
    local: dict = field(default_factory=dict)
    poll_timeout_s: float = 2.0
    source: str = "<dict>"


def _pos(where: str, v, integer: bool = False, zero: bool = False) -> float:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or v < 0 or (v == 0 and not zero):
        kind = "integer" if integer else "number"
        raise ConfigError(f"{where} must be a {'non-negative' if zero else 'positive'} {kind}, got {v!r}"[:200])
    return v


def _range(where: str, v) -> tuple[int, int]:
    if isinstance(v, str) and ".." in v:
        a, _, b = v.partition("..")
        try:
            lo, hi = int(a), int(b)
        except ValueError:
            raise ConfigError(f"{where} must be 'MIN..MAX' with integers, got {v!r}") from None
    elif isinstance(v, dict):
        lo, hi = v.get("min", 1), v.get("max", 8)
    elif isinstance(v, int) and not isinstance(v, bool):
        lo = hi = v
    else:
        raise ConfigError(f"{where} must be 'MIN..MAX', an integer or {{min, max}}, got {v!r}"[:200])
    _pos(f"{where} min", lo, integer=True, zero=True)
    _pos(f"{where} max", hi, integer=True)
    if lo > hi:
        raise ConfigError(f"{where}: min {lo} > max {hi}")
    return lo, hi


POLICY_KEYS = {f.name for f in dataclasses.fields(Policy)} - {"ttft_ms", "itl_ms", "min_nodes", "max_nodes",
                                                            "interval_s"}


def planner_config_from_dict(d: dict, where: str = "<dict>", base: Path | None = None) -> PlannerConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: a planner config must be a mapping")
    known = {"slo", "interval_s", "capacities", "nodes", "policy", "server", "observe", "actuator",
             "poll_timeout_s"}
    for k in d:
        if k not in known:
            raise ConfigError(f"{where}: unknown field '{k}' (known: {', '.join(sorted(known))})")
    slo = d.get("slo")
    if not isinstance(slo, dict) or "ttft_ms" not in slo or "itl_ms" not in slo:
        raise ConfigError(f"{where}: slo must be a mapping with ttft_ms and itl_ms")
    ttft = _pos(f"{where}: slo.ttft_ms", slo["ttft_ms"])
    itl = _pos(f"{where}: slo.itl_ms", slo["itl_ms"])
    q = slo.get("quantile", 0.9)
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
        raise ConfigError(f"{where}: slo.quantile must be a number in (0, 1), got {q!r}")
    caps_v = d.get("capacities")
    if isinstance(caps_v, str):
        p = Path(caps_v)
        if not p.is_absolute() and base is not None and not p.exists():
            p = base / p
        caps = load_capacities(p)
    elif isinstance(caps_v, dict):
        caps = capacities_from_dict(caps_v, f"{where}: capacities")
    else:
        raise ConfigError(f"{where}: capacities must be a JSON file's path (python -m pdkv.bench capacity) "
                          "or an inline mapping with prefill and decode points")
    nodes = d.get("nodes") or {}
    if not isinstance(nodes, dict):
        raise ConfigError(f"{where}: nodes must map prefill/decode to 'MIN..MAX'")
    rng = {r: _range(f"{where}: nodes.{r}", nodes.get(r, "1..8")) for r in ROLES}
    pol = d.get("policy") or {}
    if not isinstance(pol, dict):
        raise ConfigError(f"{where}: policy must be a mapping")
    kw = {}
    for k, v in pol.items():
        if k not in POLICY_KEYS:
            raise ConfigError(f"{where}: unknown field 'policy.{k}' (known: {', '.join(sorted(POLICY_KEYS))})")
        integer = k == "max_step_up"
        zero = k.endswith("_s") or k in ("smoothing", "scale_down_fraction")
        kw[k] = _pos(f"{where}: policy.{k}", v, integer=integer, zero=zero)
    interval = _pos(f"{where}: interval_s", d.get("interval_s", 5.0))
    policy = Policy(ttft_ms=float(ttft), itl_ms=float(itl), min_nodes={r: rng[r][0] for r in ROLES},
                    max_nodes={r: rng[r][1] for r in ROLES}, interval_s=float(interval), **kw)
    try:
        Planner(policy, caps)  # the bands and the SLOs' feasibility, checked now (InfeasibleSLO names the role)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    server = d.get("server") or {}
    if not isinstance(server, dict):
        raise ConfigError(f"{where}: server must be a mapping with host and port")
    port = server.get("port", 8090)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"{where}: server.port must be an integer 0..65535, got {port!r}")
    observe = d.get("observe") or {}
    if not isinstance(observe, dict):
        raise ConfigError(f"{where}: observe must map roles to URL lists or {{dns, port}}")
    for r, v in observe.items():
        if r not in ROLES + ("colocated",):
            raise ConfigError(f"{where}: observe.{r}: unknown role (prefill, decode, colocated)")
        if isinstance(v, list):
            for u in v:
                if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                    raise ConfigError(f"{where}: observe.{r}: {u!r} is not an http(s) URL")
        elif not (isinstance(v, dict) and isinstance(v.get("dns"), str) and isinstance(v.get("port"), int)):
            raise ConfigError(f"{where}: observe.{r} must be a list of URLs or {{dns: NAME, port: N}}")
    act = d.get("actuator") or {"kind": "none"}
    if isinstance(act, str):
        act = {"kind": act}
    kind = act.get("kind", "none") if isinstance(act, dict) else act
    if kind not in ACTUATORS:
        raise ConfigError(f"{where}: actuator.kind must be one of {', '.join(ACTUATORS)}, got {kind!r}")
    local = act.get("local") or {}
    if kind == "local" and not isinstance(local.get("cluster"), str):
        raise ConfigError(f"{where}: actuator.local.cluster must name a `pdkv up` cluster file")
    return PlannerConfig(policy=policy, caps=caps, quantile=float(q), host=str(server.get("host", "127.0.0.1")),
                         port=port, observe=observe, actuator=kind, local=local,
                         poll_timeout_s=float(_pos(f"{where}: poll_timeout_s", d.get("poll_timeout_s", 2.0))),
                         source=where)


def load_planner_config(path: str | Path, overrides: list[str] | None = None) -> PlannerConfig:
    import yaml

    p = Path(path)
    d = _read_yaml(p)
    for item in overrides or []:
        key, eq, raw = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        node = d
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part} is not a mapping")
        node[parts[-1]] = yaml.safe_load(raw)
    return planner_config_from_dict(d, str(p), base=p.parent)
