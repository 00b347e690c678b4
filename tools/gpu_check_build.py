"""gpu_check's build step: pdkv's compiled extensions, built in place by the interpreter the check
runs under, before the checks that import them.

The machine a GPU check runs on is not the one the checkout was made on: its Python is another
version (an extension built for 3.11 does not load under 3.12), it may have no network (nothing
can be pip-installed there), and a fresh checkout has no build artefacts at all. So the check
builds them itself, with ``setup.py build_ext --inplace`` under ``sys.executable``; setuptools
compares timestamps, so on an up-to-date tree the step costs about half a second. It never
calls pip. Where no C compiler, Python headers or Cython exist, the step is SKIP with that
reason, and so is every check that needs an extension that is not already importable.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from gpu_check_models import SkipCheck

REPO = Path(__file__).resolve().parents[1]
# The extensions setup.py builds. A check lists the ones it imports in its ``needs``.
EXTENSIONS = ("pdkv._messenger", "pdkv._kernels")
BUILD_TIMEOUT = 300.0  # a cold build is ~20 s on 2 cores; a compiler that hangs must not eat the run


def _compiler_env() -> tuple[dict, str | None]:
    """The environment to build with and the reason no C compiler can be found (None: found).

    The interpreter records the compiler it was built with (sysconfig's CC, LDSHARED), which can
    be a name only its build machine had (``x86_64-linux-gnu-gcc``, a path into a toolchain
    folder); setuptools honours CC and LDSHARED from the environment, so a ``cc``/``gcc`` on
    PATH stands in for it."""
    env = dict(os.environ)
    cc = shlex.split(env.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if cc and shutil.which(cc[0]):
        return env, None
    if env.get("CC"):  # asked for by name: do not silently build with another one
        return env, f"no C compiler: CC={env['CC']!r} is not on PATH"
    for alt in ("cc", "gcc", "clang"):
        if shutil.which(alt):
            ld = shlex.split(sysconfig.get_config_var("LDSHARED") or "cc -shared")
            env["CC"] = shlex.join([alt] + cc[1:])
            env["LDSHARED"] = shlex.join([alt] + ld[1:])
            return env, None
    return env, f"no C compiler: {cc[0] if cc else 'cc'!r}, cc, gcc and clang are not on PATH"


def toolchain_problem() -> str | None:
    """What this interpreter lacks to build the extensions (None: nothing)."""
    problems = []
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        problems.append(f"no Python headers: {include / 'Python.h'} does not exist "
                        f"(Debian/Ubuntu: apt-get install python{sys.version_info[0]}."
                        f"{sys.version_info[1]}-dev)")
    problems.append(_compiler_env()[1])
    for module in ("Cython", "setuptools"):
        if importlib.util.find_spec(module) is None:
            problems.append(f"{module} is not installed for {sys.executable}")
    problems = [p for p in problems if p]
    return "; ".join(problems) or None


def built_path(name: str) -> Path:
    """Where build_ext --inplace puts ``name`` for this interpreter."""
    *package, module = name.split(".")
    return REPO.joinpath(*package, module + sysconfig.get_config_var("EXT_SUFFIX"))


def import_error(name: str) -> str | None:
    """Why ``name`` cannot be imported here (None: it imports)."""
    importlib.invalidate_caches()  # the build may have just created the file
    try:
        importlib.import_module(name)
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_build() -> tuple[str, dict]:
    python = f"python {sys.version_info[0]}.{sys.version_info[1]} ({sys.executable})"
    problem = toolchain_problem()
    if problem:
        ready = [n for n in EXTENSIONS if import_error(n) is None]
        have = f"; already importable: {', '.join(ready)}" if ready else ""
        raise SkipCheck(f"cannot build pdkv's extensions with {python}: {problem}{have}")
    before = {n: built_path(n).stat().st_mtime_ns if built_path(n).exists() else None for n in EXTENSIONS}
    jobs = str(max(1, min(os.cpu_count() or 1, 8)))  # build_ext builds the extensions in parallel
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", jobs]
    env = _compiler_env()[0]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"`{shlex.join(cmd)}` did not finish in {BUILD_TIMEOUT:.0f} s") from None
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise AssertionError(f"`{shlex.join(cmd)}` in {REPO} exited {proc.returncode} after "
                             f"{seconds:.1f} s:\n{(proc.stdout + proc.stderr)[-4000:]}")
    errors = {n: e for n in EXTENSIONS if (e := import_error(n))}
    assert not errors, f"built, but {'; '.join(f'{n}: {e}' for n, e in errors.items())}"
    rebuilt = [n for n in EXTENSIONS if built_path(n).stat().st_mtime_ns != before[n]]
    verbs = bool(getattr(sys.modules["pdkv._messenger"], "HAVE_VERBS", False))
    what = f"built {', '.join(rebuilt)}" if rebuilt else f"{', '.join(EXTENSIONS)} up to date"
    transports = "tcp, verbs" if verbs else "tcp only: no libibverbs headers, or PDKV_NO_VERBS"
    return (f"{what} (messenger: {transports}) "
            f"with {python} in {seconds:.1f} s"), {
        "seconds": seconds, "rebuilt": rebuilt, "verbs": verbs, "python": sys.version.split()[0],
        "files": [str(built_path(n).relative_to(REPO)) for n in EXTENSIONS]}


def missing_for(needs, build_result) -> str | None:
    """Why a check that imports the extensions in ``needs`` must be skipped (None: it can run).

    Only when the build did not pass: after a passing build an import error is the check's own
    failure to report."""
    wanted = [n for n in EXTENSIONS if n in needs]
    if not wanted or (build_result is not None and build_result.status == "PASS"):
        return None
    missing = [n for n in wanted if import_error(n) is not None]
    if not missing:
        return None
    if build_result is None:
        why = "the build step did not run"
    elif build_result.status == "FAIL":
        why = "the build step failed (above)"
    else:
        why = build_result.detail
    return f"needs {', '.join(missing)}, which is not built for this Python: {why}"
