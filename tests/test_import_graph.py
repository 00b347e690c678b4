"""Imports point one way: every module of every package imports, and the package-level import
graph (read from each file's AST, imports inside functions and under TYPE_CHECKING included)
only points down the layers below. A new unit must be given a layer here; an upward import
(e.g. server/ importing pdkv.disagg, or the engine importing the server) fails with the edge
and the file and line that made it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> package: models/ and server/ are installed as pdkv.models and pdkv.server
PACKAGES = {"pdkv": "pdkv", "server": "pdkv.server", "models": "pdkv.models"}

# Top to bottom. A unit may import units of strictly lower layers only (and itself); units of
# one layer do not import each other (the server and the disaggregated roles in particular).
LAYERS: list[tuple[str, ...]] = [
    ("pdkv.__main__",),  # python -m pdkv
    ("pdkv.cli", "pdkv.bench"),  # entry points: build a node (engine + connector) and run it
    ("pdkv.plan", "pdkv.probe", "pdkv.planner"),  # `pdkv plan`: a deployment's per-request costs from its
    # configs (no weights); the RDMA probe (tools/topo --probe, pdkv serve's start-up check); `pdkv planner`
    # (node counts from load and SLOs; starts `pdkv serve` processes, imports no role)
    ("pdkv.disagg", "pdkv.server", "pdkv.router"),  # roles plug into the engine; the server serves HTTP around a
    # node; the router proxies HTTP to nodes (it holds no engine)
    ("pdkv.dp",),  # a data-parallel expert-parallel group: engine processes whose MoE layers share experts
    ("pdkv.engine",),  # LLMEngine, scheduler, runner, KV connector, the engine loop
    ("pdkv.tp", "pdkv.shared_weights"),  # tensor-parallel ranks the runner drives; one host's shared copy
    # of a model's weights (the engine's loader for share_weights auto)
    ("pdkv.models",),  # model families, layers, attention backends
    ("pdkv.kv", "pdkv.messenger", "pdkv.control", "pdkv.tokenizer", "pdkv.gpu", "pdkv.default_model",
     "pdkv.fleet"),  # fleet: etcd membership, draining, admission (no engine, no role)
    ("pdkv.control_handshake",),  # opening a control connection (TLS, authentication, HELLO)
    ("pdkv.control_wire",),  # control frames, HELLO and the control errors
    ("pdkv.shard",),  # pure planning over KV geometries (a KV cache describes itself as one)
    ("pdkv.detokenizer", "pdkv.tokenizer_healing", "pdkv.tiny_model", "pdkv.topo", "pdkv.tls", "pdkv.forkserver"),
    # forkserver: the parent role processes are forked from (it runs `python -m pdkv` in them by name)
    ("pdkv.config", "pdkv.env", "pdkv.errors", "pdkv._messenger", "pdkv._kernels", "pdkv.auth", "pdkv.ports", "pdkv.app_thread", "pdkv"),  # leaves
    ("pdkv.cpus", "pdkv.transports"),  # CPU-list parsing and pinning (the config validates parallel.cpus
    # with it); the transports' options and capabilities (the config, the staging choice and the
    # compiled messenger read them)
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str | None:
    """The layered unit a module belongs to: pdkv.<subpackage or module>, or pdkv."""
    parts = module.split(".")
    if parts[0] != "pdkv":
        return None
    return "pdkv" if len(parts) == 1 else f"pdkv.{parts[1]}"


def module_files() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):  # rglob does not enter pdkv/models, a link
            parts = (pkg,) + f.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports_of(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, wherever it is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            # ``from pdkv import _messenger``: the name may itself be a module
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def package_edges(files: dict[str, Path]) -> dict[tuple[str, str], str]:
    """(importer unit, imported unit) -> "file:line" of one import that makes the edge."""
    edges = {}
    for module, path in files.items():
        src = unit_of(module)
        for target, line in imports_of(path, module):
            if target not in files and target.rpartition(".")[0] in files and "." in target:
                target = target.rpartition(".")[0]  # ``from pkg.mod import name``: the module
            dst = unit_of(target)
            if dst is None or dst == src or (target not in files and dst != "pdkv._messenger"):
                continue
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            edges.setdefault((src, dst), f"{where}:{line}")
    return edges


def check_layers(edges: dict[tuple[str, str], str]) -> list[str]:
    problems = []
    for (src, dst), where in sorted(edges.items()):
        if src not in RANK or dst not in RANK:
            problems.append(f"{where}: {src} -> {dst}: give {src if src not in RANK else dst} a layer in "
                            f"tests/test_import_graph.py")
        elif RANK[dst] <= RANK[src]:
            kind = "a sideways" if RANK[dst] == RANK[src] else "an upward"
            problems.append(f"{where}: {src} -> {dst} is {kind} import")
    return problems


# Modules that import a GPU extra (requirements-gpu.txt) at the top, on purpose: they are only
# imported behind a guard that checks the extra first. They must import wherever it is installed.
GPU_EXTRA_MODULES = {"pdkv.gpu.release_bump": "triton"}


def test_every_module_imports():
    import importlib.util

    files = module_files()
    assert len(files) > 100
    failed = {}
    for module in files:
        if module.endswith("__main__"):
            continue  # running it is its purpose (pdkv.__main__ calls the CLI)
        extra = GPU_EXTRA_MODULES.get(module)
        if extra is not None and importlib.util.find_spec(extra) is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - report every failing module at once
            failed[module] = f"{type(e).__name__}: {e}"
    assert not failed, failed


def test_package_imports_point_down_the_layers():
    edges = package_edges(module_files())
    # the graph is really read: the edges the architecture rests on are all there
    for edge in [("pdkv.cli", "pdkv.disagg"), ("pdkv.cli", "pdkv.server"), ("pdkv.disagg", "pdkv.engine"),
                 ("pdkv.server", "pdkv.engine"), ("pdkv.engine", "pdkv.models"), ("pdkv.messenger", "pdkv._messenger")]:
        assert edge in edges, edge
    assert check_layers(edges) == []


@pytest.mark.parametrize("src,dst", [("pdkv.server", "pdkv.disagg"), ("pdkv.disagg", "pdkv.server"),
                                     ("pdkv.engine", "pdkv.server"), ("pdkv.models", "pdkv.engine")])
def test_an_added_upward_import_is_caught(tmp_path, src, dst):
    """The check on a copy of the tree with one bad import added to a real file of ``src``."""
    files = module_files()
    victim = next(m for m in files if unit_of(m) == src and files[m].name != "__init__.py")
    target = next(m for m in files if unit_of(m) == dst)
    bad = tmp_path / files[victim].name
    bad.write_text(files[victim].read_text() + f"\n\ndef _late():\n    import {target}  # noqa\n")
    files[victim] = bad
    problems = check_layers(package_edges(files))
    assert len(problems) == 1 and f"{src} -> {dst} is a" in problems[0], problems


def test_models_and_server_are_imported_as_pdkv_packages():
    """Installed, the folders are pdkv.models and pdkv.server; a bare ``import models`` would load
    a second copy of every module (or someone else's package of that name)."""
    bare = [f"{path.relative_to(ROOT)}:{line}: {target}"
            for module, path in module_files().items() for target, line in imports_of(path, module)
            if target.split(".")[0] in PACKAGES and target.split(".")[0] != "pdkv"]
    tests = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
    bare += [f"{p.relative_to(ROOT)}:{line}: {target}" for p in tests for target, line in imports_of(p, "tests.x")
             if target.split(".")[0] in ("models", "server")]
    assert bare == []
