"""The call graph between the C files of pdkv/csrc, read from the sources (no compiler needed).

A file depends on another when it names a function that the other file defines with external
linkage: a call, or a reference such as a vtable entry or a thread's start routine. Comments and
string literals are stripped first, so a name mentioned in prose is no edge. Static functions and
the static inline helpers of headers are private to one file and never make an edge.

This is a ctags-like parse, good enough for pdkv's C (K&R or same-line braces, one definition per
top-level statement); `definitions` is checked against known names by the test so that a parser
that silently finds nothing cannot pass.
"""

from __future__ import annotations

import re
from pathlib import Path

_COMMENT_OR_STRING = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'", re.S)
_PREPROCESSOR = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)
# a definition: a top-level declarator `name(...)` followed by `{` (the body), not by `;`
_DEFINITION = re.compile(r"^(?P<head>[A-Za-z_][\w \t\*]*?)\b(?P<name>[A-Za-z_]\w*)\s*\((?P<args>[^;{}]*?)\)\s*"
                         r"(?:__attribute__\s*\(\(.*?\)\)\s*)?\{", re.M | re.S)
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "do", "else"}


def strip(code: str) -> str:
    """C source without comments, string/char literals and preprocessor lines."""
    code = _COMMENT_OR_STRING.sub(lambda m: " " if m.group(0).startswith("/") else '""', code)
    return _PREPROCESSOR.sub("", code)


def definitions(code: str) -> dict[str, bool]:
    """Functions defined in stripped code -> True if external (not static)."""
    out = {}
    for m in _DEFINITION.finditer(code):
        name = m.group("name")
        if name in _KEYWORDS:
            continue
        out[name] = not re.search(r"\bstatic\b", m.group("head"))
    return out


def call_graph(csrc: Path) -> dict[str, set[str]]:
    """file name -> the files whose external functions it names (no self-edges)."""
    codes = {p.name: strip(p.read_text()) for p in sorted(Path(csrc).glob("*.c"))}
    owner: dict[str, str] = {}
    for name, code in codes.items():
        for fn, external in definitions(code).items():
            if external:
                if fn in owner:
                    raise ValueError(f"{fn} is defined in both {owner[fn]} and {name}")
                owner[fn] = name
    graph: dict[str, set[str]] = {name: set() for name in codes}
    for name, code in codes.items():
        for ident in set(_IDENT.findall(code)):
            other = owner.get(ident)
            if other and other != name:
                graph[name].add(other)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None if the graph is a DAG."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cyc := visit(m)):
                return cyc
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cyc := visit(n)):
            return cyc
    return None


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Files by depth in a DAG: layer 0 calls nothing, layer k calls only layers < k."""
    depth: dict[str, int] = {}

    def d(n: str) -> int:
        if n not in depth:
            depth[n] = 1 + max((d(m) for m in graph[n]), default=-1)
        return depth[n]

    for n in graph:
        d(n)
    out: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for n, k in sorted(depth.items()):
        out[k].append(n)
    return out


# ---- the transport table (transports.c): every row's constructor exists, every transport is a row ----

_ROW = re.compile(r'\{\s*"(?P<name>[^"]+)"\s*,\s*(?P<ctor>\w+)\s*,\s*(?P<caps>PDKV_CAP_\w+(?:\s*\|\s*PDKV_CAP_\w+)*)\s*,')
_VTABLE = re.compile(r"pdkv_transport_ops\s+\w+\s*=\s*\{[^}]*?\.name\s*=\s*\"(?P<name>[^\"]+)\"", re.S)
_CAP_ENUM = re.compile(r"\bPDKV_CAP_(?P<name>\w+)\s*=\s*(?P<value>\d+)")


def registration_table(csrc: Path) -> list[tuple[str, str, set[str]]]:
    """The rows of transports.c's TABLE: (name, constructor, capability names without PDKV_CAP_)."""
    code = _COMMENT_OR_STRING.sub(lambda m: " " if m.group(0).startswith("/") else m.group(0),
                                  (Path(csrc) / "transports.c").read_text())
    start = code.index("TABLE[] = {")
    table = code[start:code.index("};", start)]
    return [(m["name"], m["ctor"], {c.strip().removeprefix("PDKV_CAP_") for c in m["caps"].split("|")})
            for m in _ROW.finditer(table)]


def capability_bits(csrc: Path) -> dict[str, int]:
    """transport.h's enum pdkv_capability: name (without PDKV_CAP_) -> bit."""
    return {m["name"]: int(m["value"]) for m in _CAP_ENUM.finditer((Path(csrc) / "transport.h").read_text())}


def vtables(csrc: Path) -> dict[str, str]:
    """file -> the transport name its pdkv_transport_ops says (files that define a transport)."""
    out = {}
    for p in sorted(Path(csrc).glob("*.c")):
        code = _COMMENT_OR_STRING.sub(lambda m: " " if m.group(0).startswith("/") else m.group(0), p.read_text())
        for m in _VTABLE.finditer(code):
            out[p.name] = m["name"]
    return out


def function_bodies(code: str) -> dict[str, str]:
    """Stripped code's functions -> their bodies (brace-matched)."""
    out = {}
    for m in _DEFINITION.finditer(code):
        depth, i = 0, m.end() - 1
        while i < len(code):
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if depth == 0:
                break
            i += 1
        out[m["name"]] = code[m.end():i]
    return out


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += graph.get(n, ())
    return seen


def check_registration(csrc: Path) -> list[str]:
    """Problems with the transport table, [] when every row's constructor is a function of
    transports.c that reaches a transport of that name, and every transport file (one that
    defines a pdkv_transport_ops) is reached from a row of its own name."""
    csrc = Path(csrc)
    problems = []
    rows = registration_table(csrc)
    if not rows:
        return ["transports.c: no rows found in TABLE"]
    graph = call_graph(csrc)
    code = strip((csrc / "transports.c").read_text())
    raw = (csrc / "transports.c").read_text()
    bodies = function_bodies(code)
    owner = {fn: p.name for p in sorted(csrc.glob("*.c")) for fn, ext in definitions(strip(p.read_text())).items()
             if ext}
    tables = vtables(csrc)
    bits = capability_bits(csrc)
    made: dict[str, set[str]] = {}  # transport name -> the files its row's constructor reaches
    for name, ctor, caps in rows:
        unknown = caps - set(bits)
        if unknown:
            problems.append(f"row {name!r}: capabilities {sorted(unknown)} are not in transport.h")
        if ctor not in bodies:
            problems.append(f"row {name!r}: constructor {ctor} is not a function of transports.c")
            continue
        calls = {owner[i] for i in _IDENT.findall(bodies[ctor]) if owner.get(i, "transports.c") != "transports.c"}
        files = set().union(*(reachable(graph, f) for f in calls)) if calls else set()
        if not any(tables.get(f) == name for f in files):
            problems.append(f"row {name!r}: constructor {ctor} reaches no transport named {name!r} "
                            f"(it calls into {sorted(calls) or 'nothing'})")
        # a constructor compiled only with a system library needs its NULL stand-in
        guard = re.search(rf"#else\s*\n\s*#define\s+{ctor}\s+NULL", raw)
        if re.search(rf"#ifdef\s+PDKV_HAVE_\w+[^#]*?\b{ctor}\b", raw, re.S) and not guard:
            problems.append(f"row {name!r}: {ctor} is built conditionally without '#define {ctor} NULL'")
        made[name] = files
    names = [r[0] for r in rows]
    for dup in {n for n in names if names.count(n) > 1}:
        problems.append(f"transport {dup!r} has more than one row")
    for f, name in tables.items():
        if name not in made:
            problems.append(f"{f} defines transport {name!r}, which has no row in transports.c's TABLE")
        elif f not in made[name]:
            problems.append(f"{f} defines transport {name!r}, but that row's constructor never reaches it")
    return problems


if __name__ == "__main__":  # print the order: python tests/messenger/c_graph.py
    g = call_graph(Path(__file__).resolve().parents[2] / "pdkv" / "csrc")
    cyc = find_cycle(g)
    if cyc:
        print("cycle:", " -> ".join(cyc))
    else:
        for i, files in enumerate(layers(g)):
            print(i, " ".join(f"{f}({','.join(sorted(g[f]))})" for f in files))
