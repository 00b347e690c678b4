"""A small kustomize renderer for deploy/kubernetes, so the manifest tests need no kustomize binary.

It implements what those kustomizations use, and refuses anything else by name (so a new
feature in a kustomization fails the test until the renderer learns it):
``resources`` (files of YAML documents, or folders with a kustomization.yaml, rendered first),
``configMapGenerator`` (``files: [key=path | path]``), ``secretGenerator`` (``envs``),
``generatorOptions: {disableNameSuffixHash: true}`` (required: hashed names are not rendered),
``replicas``, ``images`` and ``patches`` given as JSON 6902 operation lists (add / replace /
remove) with a ``target`` of kind and a name regex (anchored, as kustomize matches it).
Where ``kubectl kustomize`` is installed, the tests check this renderer's output equals it.
"""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path

import yaml

KNOWN = {"apiVersion", "kind", "resources", "configMapGenerator", "secretGenerator", "generatorOptions", "replicas",
         "images", "patches"}


class RenderError(Exception):
    pass


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _json_patch(doc: dict, ops: list[dict], where: str) -> None:
    for op in ops:
        keys = _pointer(op["path"])
        node = doc
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
        last = keys[-1]
        kind = op["op"]
        if isinstance(node, list):
            i = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(i, op["value"])
            elif kind == "replace":
                node[i] = op["value"]
            elif kind == "remove":
                del node[i]
            else:
                raise RenderError(f"{where}: JSON patch op {kind!r} is not rendered")
        else:
            if kind in ("replace", "remove") and last not in node:
                raise RenderError(f"{where}: {kind} of a missing path {op['path']}")
            if kind in ("add", "replace"):
                node[last] = op["value"]
            elif kind == "remove":
                del node[last]
            else:
                raise RenderError(f"{where}: JSON patch op {kind!r} is not rendered")


def render(folder: str | Path, secret_env: dict | None = None) -> list[dict]:
    """The documents `kubectl kustomize folder` prints (in no particular order)."""
    folder = Path(folder)
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for key in k:
        if key not in KNOWN:
            raise RenderError(f"{folder}/kustomization.yaml: {key!r} is not rendered by tests/k8s_render.py")
    out: list[dict] = []
    for r in k.get("resources", []):
        p = folder / r
        out += render(p, secret_env) if p.is_dir() else _docs(p)
    gen = k.get("generatorOptions") or {}
    if (k.get("configMapGenerator") or k.get("secretGenerator")) and not gen.get("disableNameSuffixHash"):
        raise RenderError(f"{folder}: generators need generatorOptions.disableNameSuffixHash: true here")
    for g in k.get("configMapGenerator", []):
        data = {}
        for f in g.get("files", []):
            key, eq, rel = f.partition("=")
            if not eq:
                key, rel = Path(f).name, f
            data[key] = (folder / rel).read_text()
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": g["name"]}, "data": data})
    for g in k.get("secretGenerator", []):
        data = {}
        for f in g.get("envs", []):
            p = folder / f
            text = p.read_text() if p.exists() else "".join(f"{a}={b}\n" for a, b in (secret_env or {}).items())
            for line in text.splitlines():
                if line.strip() and not line.startswith("#"):
                    a, _, b = line.partition("=")
                    data[a.strip()] = base64.b64encode(b.encode()).decode()
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": g["name"]}, "type": "Opaque",
                    "data": data})
    for rep in k.get("replicas", []):
        hits = [d for d in out if d["metadata"]["name"] == rep["name"] and "replicas" in d.get("spec", {})]
        if not hits:
            raise RenderError(f"{folder}: replicas for {rep['name']!r}: no such workload")
        for d in hits:
            d["spec"]["replicas"] = rep["count"]
    for patch in k.get("patches", []):
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise RenderError(f"{folder}/{patch['path']}: only JSON 6902 patches (a list of ops) are rendered")
        t = patch["target"]
        hits = [d for d in out if d["kind"] == t.get("kind", d["kind"])
                and re.fullmatch(t.get("name", ".*"), d["metadata"]["name"])]
        if not hits:
            raise RenderError(f"{folder}/{patch['path']}: its target {t} matches nothing")
        for d in hits:
            _json_patch(d, copy.deepcopy(ops), f"{folder}/{patch['path']}")
    for img in k.get("images", []):
        for d in out:
            for c in _containers(d):
                if c.get("image", "").split(":")[0] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img.get('newTag', 'latest')}"
    return out


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])
