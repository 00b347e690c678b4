"""Loading a role config: YAML (and ``--set key=value`` overrides) in, a validated Config out.

Every value is coerced to its field's type; an error names the file (or the ``--set``), the
field and what was expected.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Iterable

from pdkv.config.sections import Config, ConfigError
from pdkv.config.validate import validate

# Fields that a YAML file may not set: bookkeeping, not configuration.
_INTERNAL = {"source"}


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (), *,
                check_paths: bool = True) -> Config:
    """Read a YAML role config, apply ``--set key=value`` overrides, validate, freeze.

    ``path=None`` starts from the defaults. Overrides use dotted keys that mirror the YAML
    (``server.port=8001``); their values are parsed as YAML scalars (``null``, ``8001``,
    ``[a, b]``) except where the field is a string, which takes the text as written.
    ``check_paths=False`` skips checking that ``model.path`` exists (for configs of other hosts).
    """
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path))
    origins: dict[str, str] = {}  # dotted field -> the --set that gave its value, for errors
    for item in overrides:
        origins[_apply_override(data, item)] = f"--set {item}"
    cfg = _build(Config, data, source, prefix="")
    cfg = dataclasses.replace(cfg, source=source)
    if cfg.model.path.startswith("~"):  # shells leave "--set model.path=~/x" unexpanded
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(Path(cfg.model.path).expanduser())))
    validate(cfg, origins, check_paths=check_paths)
    return cfg


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a Config from a plain nested dict (same schema as the YAML)."""
    cfg = dataclasses.replace(_build(Config, data, source, prefix=""), source=source)
    validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The nested dict a YAML file would hold for ``cfg`` (tuples as lists, no bookkeeping)."""
    out = dataclasses.asdict(cfg)
    for name in _INTERNAL:
        out.pop(name, None)
    return _lists(out)


def _lists(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    return x


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml  # only the loader needs it; the dataclasses are importable without

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _apply_override(data: dict[str, Any], item: str) -> str:
    """Set one ``key=value`` in the nested dict; returns the dotted key."""
    where = f"--set {item}"
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(f"{where}: expected KEY=VALUE with a dotted key such as server.port=8001")
    parts = key.split(".")
    hint = _field_type(Config, parts, where)
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(parts[:i + 1])} is not a section")
        node = child
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        raise ConfigError(f"{where}: {key} is a section; set one of its fields "
                          f"({', '.join(key + '.' + n for n in _hints(hint))})")
    node[parts[-1]] = _coerce(_parse_value(raw, hint), hint, where, key)
    return key


def _field_type(cls: type, parts: list[str], where: str) -> Any:
    """The type hint of the field at dotted ``parts``; unknown names are an error."""
    hint: Any = cls
    for i, part in enumerate(parts):
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            raise ConfigError(f"{where}: {'.'.join(parts[:i])} is a value, not a section")
        hints = _hints(hint)
        if part not in hints:
            raise ConfigError(f"{where}: unknown field {'.'.join(parts[:i + 1])!r} "
                              f"(known: {', '.join(hints)})")
        hint = hints[part]
    return hint


def _parse_value(raw: str, hint: Any) -> Any:
    import yaml

    text = raw.strip()
    allowed = _union_args(hint)
    if str in allowed and not (type(None) in allowed and text in ("null", "~", "")):
        return raw  # a string field takes the text as written ("--set server.api_key=123")
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return raw


def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in _INTERNAL}


def _union_args(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    """Turn a nested dict into dataclass ``cls``, checking names and types field by field."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {_show(data)}")
    hints = _hints(cls)
    unknown = [k for k in data if k not in hints]
    if unknown:
        raise ConfigError(f"{source}: unknown field {prefix}{unknown[0]} (known in {where}: {', '.join(hints)})")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, {} if value is None else value, source, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, source, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, source: str, name: str) -> Any:
    allowed = _union_args(hint)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{source}: {name} must be {_describe(hint)}, got null")
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
        if typing.get_origin(t) is tuple:
            item = typing.get_args(t)[0]  # tuple[str, ...] or tuple[int, ...]
            items = [value] if isinstance(value, (str, int)) else value
            if isinstance(items, (list, tuple)) and all(_is_item(v, item) for v in items):
                return tuple(items)
    raise ConfigError(f"{source}: {name} must be {_describe(hint)}, got {_show(value)}")


def _is_item(v: Any, item: type) -> bool:
    return isinstance(v, item) and not (item is int and isinstance(v, bool))


def _describe(hint: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             type(None): "null"}
    lists = {str: "a list of strings", int: "a list of integers"}
    parts = [lists[typing.get_args(t)[0]] if typing.get_origin(t) is tuple else names.get(t, str(t))
             for t in _union_args(hint)]
    return " or ".join(parts)


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if not isinstance(value, str) else repr(value)


