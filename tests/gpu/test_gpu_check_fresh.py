"""tools/gpu_check.py --dry-run as the first GPU run meets the repository: a fresh copy of the
checkout with no build artefacts, and a Python that has the requirements but no pdkv.

The copy holds exactly what git would hand over (tracked files and untracked ones it does not
ignore, so uncommitted edits are tested too; no .so, no generated .c). The interpreter is a
bare venv of the base Python whose site-packages names this venv's site-packages in a .pth
line: the requirements import, but the editable install's import hook (a .pth that runs code)
does not, so pdkv resolves to the copy alone -- with the hook, the copy would quietly import
the developer checkout's compiled pdkv._messenger and hide a missing build.

One test, ~60 s on 2 cores (a cold build of both extensions is most of it): the real dry run
(the build PASSes, every check passes on the CPU stand-ins), then, in a second fresh copy, one
without a C compiler (the build and the check needing pdkv._messenger are SKIP naming why, and
the run exits 0).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXT = sysconfig.get_config_var("EXT_SUFFIX")


def _fresh_copy(dest: Path) -> Path:
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                                capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"needs a git checkout to list the repository's files: {e}")
    for rel in filter(None, listed.decode().split("\0")):
        src, dst = REPO / rel, dest / rel
        if not os.path.lexists(src):  # deleted in the work tree, not yet in the index
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif src.is_file():
            shutil.copy2(src, dst)
    return dest


def _bare_python(dest: Path) -> Path:
    """A venv without pdkv: this interpreter's packages through a plain path .pth line."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    python = dest / "bin" / "python"
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # every site directory of this interpreter (a venv's, and the system's where it includes them)
    ours = dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"]])
    Path(out, "requirements.pth").write_text("".join(p + "\n" for p in ours))
    return python


def _run(python: Path, cwd: Path, args: list[str], **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CC", "LDSHARED")}
    return subprocess.run([str(python), "tools/gpu_check.py", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=400, env=dict(clean, PYTHONUNBUFFERED="1", **env))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_on_a_fresh_checkout_builds_the_extensions_and_every_check_passes(tmp_path):
    repo = _fresh_copy(tmp_path / "repo")
    python = _bare_python(tmp_path / "venv")
    assert not list((repo / "pdkv").glob("*.so")) and not (repo / "pdkv/_messenger.c").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([str(python), "-c", "import pdkv._messenger"], cwd=repo, capture_output=True,
                           text=True, timeout=120, env=env)
    assert "No module named 'pdkv._messenger'" in probe.stderr, probe  # fresh, and nothing leaks in

    proc = _run(python, repo, ["--dry-run", "--json", "r.json"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    report = json.loads((repo / "r.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["build", "apis", "decode-graphs", "disagg-gpu"], list(checks)
    assert all(c["status"] == "PASS" for c in checks.values()), [(c["name"], c["status"], c["detail"][:300])
                                                                 for c in checks.values()]
    b = checks["build"]
    assert b["data"]["rebuilt"] == ["pdkv._messenger", "pdkv._kernels"], b
    assert (repo / f"pdkv/_messenger{EXT}").is_file() and (repo / f"pdkv/_kernels{EXT}").is_file()
    assert b["detail"].startswith("built pdkv._messenger, pdkv._kernels (messenger: tcp"), b
    assert b["data"]["seconds"] > 0 and f"in {b['data']['seconds']:.1f} s" in b["detail"], b
    assert "PASS build (" in out and "4 passed, 0 failed, 0 skipped" in out
    assert "build toolchain: complete" in out and "cython: " in out  # the environment lines

    g = checks["decode-graphs"]["data"]  # the engine's decode under the stand-in capture
    assert g["device"] == "cpu" and g["tokens_equal"] and g["padded_rows"] > 0 and g["graph_replays"]
    assert g["counter_bumps"] == g["counter_bumps_issued"] > 0 and "graph_counter_vs_graph_b8" in g
    d = checks["disagg-gpu"]  # pdkv up: two processes, tcp, staging through the CPU copy engine
    assert d["data"]["device"] == "cpu" and d["data"]["kv_bytes"] > 0
    assert "tokens equal colocated" in d["detail"] and "cpu-copy" in d["detail"]

    # another fresh copy without a C compiler: SKIP (not FAIL) for the build and what needs it
    repo = _fresh_copy(tmp_path / "repo-nocc")
    proc = _run(python, repo, ["--dry-run", "--only", "apis", "disagg-gpu", "--json", "nocc.json"],
                CC="/nonexistent/cc")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    build, apis, disagg = json.loads((repo / "nocc.json").read_text())["checks"]
    assert build["name"] == "build" and build["status"] == "SKIP", build
    assert "no C compiler: CC='/nonexistent/cc' is not on PATH" in build["detail"], build
    assert apis["name"] == "apis" and apis["status"] == "PASS", apis
    assert disagg["name"] == "disagg-gpu" and disagg["status"] == "SKIP", disagg
    assert disagg["detail"].startswith("needs pdkv._messenger, which is not built for this Python: cannot "
                                       "build pdkv's extensions"), disagg
    assert not list((repo / "pdkv").glob("*.so"))
