"""`make mutants`: realistic one-line bugs, each applied in a scratch copy of the repository,
each of which must make at least one NAMED test file fail (tools/mutants_catalog.py lists them
by area). Not part of `make test`: it runs the named files once per mutant.

    python tools/mutants.py                 every mutant (and a clean run of their test files first)
    python tools/mutants.py NAME ...        only these (names or areas: "chooser", "spec", ...)
    python tools/mutants.py --list          the catalog
    python tools/mutants.py --no-baseline   skip the clean run
    python tools/mutants.py --tests-at REV  the named test files (whole) as they were at git REV
                                            (e.g. main: which mutants they let through before)

The scratch copy is the working tree's tracked and untracked-but-not-ignored files, plus the
built extensions (pdkv/*.so) and the loopback verbs device's build cache (.cache/verbs_loopback),
so nothing is rebuilt for a Python mutant; a C mutant (``rebuild``) rebuilds the extensions in
the copy and puts the clean ones back afterwards. The working tree itself is never written.

A mutant is killed when its test run fails (pytest exit status 1); any other non-zero status
(a collection error, a timeout) is reported as ERROR and counts as not killed, since it says
nothing about whether the tests would have caught the bug. Prints a table and the kill rate;
exits 1 when a mutant survives, 2 when the clean run fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from mutants_catalog import MUTANTS, Mutant  # noqa: E402

KEEP = ("pdkv/*.so", ".cache/verbs_loopback")  # built artifacts the copy needs (git-ignored)
PER_MUTANT_TIMEOUT_S = 600


def scratch_copy(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    for pattern in KEEP:
        for src in ROOT.glob(pattern):
            if src.is_dir():
                shutil.copytree(src, dst / src.relative_to(ROOT), symlinks=True, dirs_exist_ok=True)
            else:
                shutil.copy2(src, dst / src.relative_to(ROOT))
    if not list(dst.glob("pdkv/_messenger*.so")):
        sys.exit("tools/mutants.py: no built pdkv/_messenger*.so in the working tree: run "
                 "`python setup.py build_ext --inplace` (or `make install`) first")


def tests_at(copy: Path, rev: str) -> None:
    """Replaces the copy's tests/ with the tree's tests/ at ``rev``."""
    shutil.rmtree(copy / "tests")
    tar = subprocess.run(["git", "archive", rev, "tests"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(copy)], input=tar, check=True)
    conftest = copy / "tests" / "conftest.py"
    if 'register_profile("mutants"' not in conftest.read_text():  # a tree from before the profile
        with open(conftest, "a") as f:
            f.write('\nfrom hypothesis import Phase, settings  # noqa: E402  (added by tools/mutants.py)\n'
                    'settings.register_profile("mutants", phases=(Phase.explicit, Phase.generate), database=None)\n')
    build = ROOT / ".cache" / "verbs_loopback"
    if build.exists():  # the device's build cache is keyed by source hash: an old tree rebuilds it
        shutil.copytree(build, copy / ".cache" / "verbs_loopback", symlinks=True, dirs_exist_ok=True)


def pytest_run(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "--no-header", "-p", "no:randomly",
                            "--hypothesis-profile=mutants", *tests],
                           cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout:.0f} s\n{(e.stdout or b'')[-2000:]!r}"
    return rc, out, time.monotonic() - t0


def first_failure(out: str) -> str:
    for line in out.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0][:150]
    return (out.strip().splitlines() or [""])[-1][:150]


def build(copy: Path) -> None:
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=copy, check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(copy)})


def apply(copy: Path, m: Mutant) -> dict[Path, bytes]:
    """Edits the copy's files; returns their original bytes (to restore)."""
    saved = {}
    for path, old, new in m.edits:
        f = copy / path
        if f not in saved:
            saved[f] = f.read_bytes()
        s = f.read_text()
        if s.count(old) != 1:
            raise SystemExit(f"tools/mutants_catalog.py: mutant {m.name}: the text to replace occurs "
                             f"{s.count(old)} times in {path} (must be once): {old!r}")
        f.write_text(s.replace(old, new))
    return saved


def named(m: Mutant, copy: Path, whole_files: bool) -> tuple[str, ...]:
    """The mutant's tests that exist in the copy; ``whole_files``: their files (--tests-at an
    older revision, whose files may not have the tests named yet)."""
    tests = [t.split("::")[0] if whole_files else t for t in m.tests]
    return tuple(dict.fromkeys(t for t in tests if (copy / t.split("::")[0]).exists()))


def run_one(copy: Path, m: Mutant, clean_so: dict[Path, bytes], whole_files: bool = False) -> tuple[str, str, float]:
    tests = named(m, copy, whole_files)
    if not tests:  # --tests-at a revision from before these files
        return "SURVIVED", "none of its test files exists in this tree", 0.0
    saved = apply(copy, m)
    t0 = time.monotonic()
    try:
        if m.rebuild:
            build(copy)
        rc, out, _ = pytest_run(copy, tests, PER_MUTANT_TIMEOUT_S)
        dt = time.monotonic() - t0  # the rebuild included
    finally:
        for f, data in saved.items():
            f.write_bytes(data)
        if m.rebuild:
            for f, data in clean_so.items():
                f.write_bytes(data)
    verdict = "killed" if rc == 1 else ("SURVIVED" if rc == 0 else f"ERROR (exit {rc})")
    return verdict, first_failure(out) if rc else "", dt


def select(names: list[str]) -> list[Mutant]:
    if not names:
        return list(MUTANTS)
    known = {m.name for m in MUTANTS} | {m.area for m in MUTANTS}
    bad = [n for n in names if n not in known]
    if bad:
        sys.exit(f"unknown mutant or area: {', '.join(bad)} (--list shows them)")
    return [m for m in MUTANTS if m.name in names or m.area in names]


def _sigterm(signum, frame):
    raise KeyboardInterrupt  # unwinds: the running test is killed, the scratch copy removed


def main() -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--tests-at", metavar="REV")
    a = ap.parse_args()
    chosen = select(a.names)
    if a.list:
        for m in chosen:
            print(f"{m.area:12} {m.name:34} {' '.join(m.tests)}\n{'':12} {m.why}")
        return 0
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdkv-mutants-") as tmp:
        copy = Path(tmp)
        scratch_copy(copy)
        if a.tests_at:
            tests_at(copy, a.tests_at)
        clean_so = {f: f.read_bytes() for f in copy.glob("pdkv/*.so")}
        if not a.no_baseline:
            files = tuple(sorted({t for m in chosen for t in named(m, copy, bool(a.tests_at))}))
            rc, out, dt = pytest_run(copy, files, 1800)
            print(f"clean run of {len(files)} test files: {'passed' if rc == 0 else 'FAILED'} in {dt:.0f} s")
            if rc != 0:
                print(out[-3000:])
                return 2
        rows = []
        for m in chosen:
            verdict, why, dt = run_one(copy, m, clean_so, bool(a.tests_at))
            rows.append((m, verdict, why, dt))
            print(f"{m.area:12} {m.name:34} {verdict:9} {dt:5.0f} s  {why}", flush=True)
    killed = sum(v == "killed" for _, v, _, _ in rows)
    print(f"\nkill rate: {killed}/{len(rows)} = {100 * killed / max(1, len(rows)):.0f}% "
          f"({time.monotonic() - t_start:.0f} s in all)")
    for m, v, _, _ in rows:
        if v != "killed":
            print(f"  not killed: {m.name} ({v}): {m.why}")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
