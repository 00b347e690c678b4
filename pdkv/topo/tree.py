"""Reading a sysfs-like tree: the live ``/`` or a captured copy of it.

A captured tree keeps sysfs's symlinks as relative links, and every link is resolved here by
walking it component by component *inside the root* (an absolute link target is taken relative
to the root), so a capture never reads the machine it is inspected on.
"""

from __future__ import annotations

import os


class SysfsTree:
    def __init__(self, root: str = "/"):
        self.root = os.path.abspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"sysfs root {root!r} is not a directory")
        # NOTE: resolved directories are cached: discovery reads ~10 attributes per PCI device
        # and each device sits ~10 links and directories deep. A tree is read once, so the cache
        # never goes stale within one discover().
        self._resolved: dict[str, str] = {}
        # Links a capture keeps in a manifest instead of on disk (see LINK_MANIFEST).
        self.manifest: dict[str, str] = {}
        if not self.live:
            self.manifest = parse_link_manifest(self.read(LINK_MANIFEST))

    @property
    def live(self) -> bool:
        return self.root == "/"

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel.strip("/"))

    def resolve(self, rel: str) -> str:
        """The canonical path of ``rel`` inside the tree, links followed ("" is the root)."""
        rel = rel.strip("/")
        if rel in self._resolved:
            return self._resolved[rel]
        head, _, last = rel.rpartition("/")
        if head:  # resolve the parent once (cached), then only the last component here
            todo, out = [last], [p for p in self.resolve(head).split("/") if p]
        else:
            todo, out = [p for p in rel.split("/") if p], []
        hops = 0
        while todo:
            part = todo.pop(0)
            if part == ".":
                continue
            if part == "..":
                if out:
                    out.pop()
                continue
            full = os.path.join(self.root, *out, part)
            listed = self.manifest.get("/".join(out + [part]))
            if listed is not None or os.path.islink(full):
                hops += 1
                if hops > 40:  # the kernel's own limit on nested links
                    raise OSError(f"too many levels of symbolic links under {self.path(rel)}")
                target = listed if listed is not None else os.readlink(full)
                if target.startswith("/"):
                    out = []
                todo = [p for p in target.split("/") if p] + todo
            else:
                out.append(part)
        self._resolved[rel] = "/".join(out)
        return self._resolved[rel]

    def parts(self, rel: str) -> list[str]:
        resolved = self.resolve(rel)
        return resolved.split("/") if resolved else []

    def read(self, rel: str) -> str | None:
        """A sysfs attribute's text, stripped; None when it is absent or the kernel refuses it
        (some attributes fail with EINVAL, e.g. ``speed`` of a down link, an empty GID slot)."""
        try:
            with open(self.path(self.resolve(rel)), "r", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def read_int(self, rel: str) -> int | None:
        text = self.read(rel)
        try:
            return int(text, 0) if text is not None else None
        except ValueError:
            return None

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(self.resolve(rel))))
        except OSError:
            return []

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.path(rel)) or rel.strip("/") in self.manifest

    def link_name(self, rel: str) -> str | None:
        """The last component of a link's target (``driver`` → ``nvidia``), if it is a link."""
        full = self.path(rel)
        if not os.path.islink(full):
            return None
        return os.path.basename(os.readlink(full).rstrip("/")) or None


# sysfs links that point back up the tree (``infiniband/mlx5_0/device`` → its own PCI device)
# make a directory cycle: any walker that follows links (pytest collecting tests, find -L,
# editors' indexers) never ends. A capture stores exactly those links here, one per line.
LINK_MANIFEST = "pdkv-capture/links.txt"
_MANIFEST_HEAD = "# links pointing back up the tree, kept out of the file system to avoid cycles\n"


def is_back_link(rel: str, target: str) -> bool:
    """True when the relative link ``rel`` → ``target`` points at one of rel's own ancestors."""
    if target.startswith("/"):
        return False
    dest = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    return rel.startswith(dest + "/") or dest in (".", "")


def format_link_manifest(links: dict[str, str]) -> str:
    return _MANIFEST_HEAD + "".join(f"{rel} -> {links[rel]}\n" for rel in sorted(links))


def parse_link_manifest(text: str | None) -> dict[str, str]:
    out = {}
    for line in (text or "").splitlines():
        rel, sep, target = line.partition(" -> ")
        if sep and not line.startswith("#"):
            out[rel.strip()] = target.strip()
    return out


def parse_cpulist(text: str | None) -> tuple[int, ...]:
    """``"0-55,112-167"`` → (0, 1, ..., 55, 112, ..., 167). Empty or absent → ()."""
    cpus: list[int] = []
    for chunk in (text or "").split(","):
        chunk = chunk.strip()
        if not chunk:
            continue
        lo, _, hi = chunk.partition("-")
        try:
            cpus.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}") from None
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus) -> str:
    """(0, 1, 2, 5) → ``"0-2,5"``; the inverse of parse_cpulist."""
    cpus = sorted(set(cpus))
    out = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)
