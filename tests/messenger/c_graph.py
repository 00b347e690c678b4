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


if __name__ == "__main__":  # print the order: python tests/messenger/c_graph.py
    g = call_graph(Path(__file__).resolve().parents[2] / "pdkv" / "csrc")
    cyc = find_cycle(g)
    if cyc:
        print("cycle:", " -> ".join(cyc))
    else:
        for i, files in enumerate(layers(g)):
            print(i, " ".join(f"{f}({','.join(sorted(g[f]))})" for f in files))
