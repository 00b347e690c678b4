"""The request fields that constrain what is generated: ``response_format`` (OpenAI), vLLM's
``structured_outputs`` and its older ``guided_*`` names, and ``tools`` / ``tool_choice``.

Each becomes at most one ``StructuredSpec`` (what the grammar compiler gets, with the field it
came from for errors) and a ``ToolsSpec``. ``tool_choice`` ``required`` and a named function are
enforced the way vLLM does: a JSON schema for the call(s), so even a model that never learned
the tool format produces one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdkv.server.errors import APIError

MAX_TOOLS = 128
MAX_CHOICES = 256
_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    kind: str  # "json" (value: a schema, JSON text), "json_object", "regex", "choice", "grammar"
    value: str  # canonical text: the cache key with ``kind``
    field: str  # the request field it came from, named by errors

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.value


@dataclass(frozen=True)
class ToolsSpec:
    tools: tuple  # the request's tools, as sent ({"type": "function", "function": {...}})
    choice: str  # "auto" | "none" | "required" | "named"
    name: str | None = None  # the named function

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}


def _bad(name: str, expected: str, got: Any) -> APIError:
    shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
    return APIError(f"'{name}' must be {expected}, got {shown}", 400, param=name)


def _schema_text(v: Any, name: str) -> str:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise APIError(f"'{name}' is not valid JSON: {e}", 400, param=name) from None
    if not isinstance(v, (dict, bool)):
        raise _bad(name, "a JSON schema object", v)
    return json.dumps(v, ensure_ascii=False)  # property order is output order: kept


def _one(kind: str, v: Any, name: str) -> StructuredSpec:
    if kind == "json":
        return StructuredSpec("json", _schema_text(v, name), name)
    if kind == "choice":
        if not isinstance(v, list) or not v or len(v) > MAX_CHOICES or not all(isinstance(c, str) for c in v):
            raise _bad(name, f"a non-empty list of at most {MAX_CHOICES} strings", v)
        return StructuredSpec("choice", json.dumps(v, ensure_ascii=False), name)
    if not isinstance(v, str) or not v:
        raise _bad(name, "a non-empty string", v)
    return StructuredSpec(kind, v, name)


def _response_format(v: Any) -> StructuredSpec | None:
    if not isinstance(v, dict):
        raise _bad("response_format", "an object with a 'type'", v)
    t = v.get("type")
    if t == "text":
        return None
    if t == "json_object":
        return StructuredSpec("json_object", "", "response_format")
    if t == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise _bad("response_format.json_schema", "an object with a 'schema'", js)
        return StructuredSpec("json", _schema_text(js["schema"], "response_format.json_schema.schema"),
                              "response_format.json_schema.schema")
    raise _bad("response_format.type", "'text', 'json_object' or 'json_schema'", t)


def parse_structured(body: dict) -> StructuredSpec | None:
    """The one constraint the request asks for, from whichever field names it (two: a 400)."""
    found: list[StructuredSpec] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(spec)
    so = body.get("structured_outputs", body.get("guided_decoding"))
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", "an object", so)
        given = [k for k in (*_KINDS, "json_object") if so.get(k) not in (None, False)]
        if len(given) > 1:
            raise APIError(f"'structured_outputs' takes one of {', '.join(_KINDS)}, got {', '.join(given)}",
                           400, param="structured_outputs")
        for k in given:
            found.append(StructuredSpec("json_object", "", "structured_outputs.json_object")
                         if k == "json_object" else _one(k, so[k], f"structured_outputs.{k}"))
    for k in _KINDS:
        if body.get(f"guided_{k}") is not None:
            found.append(_one(k, body[f"guided_{k}"], f"guided_{k}"))
    if body.get("guided_json_object"):
        found.append(StructuredSpec("json_object", "", "guided_json_object"))
    if len(found) > 1:
        raise APIError(f"only one output constraint may be given, got {', '.join(s.field for s in found)}",
                       400, param=found[1].field)
    return found[0] if found else None


def parse_tools(body: dict) -> ToolsSpec | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") not in (None, []):
        raise APIError("'functions' (the deprecated form) is not supported; send 'tools'", 400, param="functions")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise APIError("'tool_choice' needs 'tools'", 400, param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"a list of at most {MAX_TOOLS} tools", tools)
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", "{'type': 'function', 'function': {...}}", t)
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise _bad(f"tools[{i}].function.name", "a non-empty string of at most 64 characters", name)
        if name in names:
            raise APIError(f"tools[{i}].function.name {name!r} is given twice", 400,
                           param=f"tools[{i}].function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", "a JSON schema object", params)
    if choice is None or choice in ("auto", "none", "required"):
        return ToolsSpec(tuple(tools), choice or "auto")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise APIError(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                           f"({', '.join(sorted(names))})", 400, param="tool_choice")
        return ToolsSpec(tuple(tools), "named", name)
    raise _bad("tool_choice", "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
               choice)


def tool_call_schema(spec: ToolsSpec) -> StructuredSpec | None:
    """The constraint that forces ``required`` / a named function (vLLM's): a named call's
    arguments object, or a non-empty array of {name, parameters} over the tools."""
    fns = spec.functions
    if spec.choice == "named":
        schema = fns[spec.name].get("parameters") or {"type": "object"}
        return StructuredSpec("json", json.dumps(schema, sort_keys=True), "tool_choice")
    if spec.choice != "required":
        return None
    one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                "parameters": f.get("parameters") or {"type": "object"}},
               "required": ["name", "parameters"]} for n, f in fns.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    return StructuredSpec("json", json.dumps(schema, sort_keys=True), "tool_choice")
