"""The transports the messenger tests run over (``transport_params``), the libfabric software
providers that work here ("libfabric:<provider>"), and what each reports of a refused write.
Imported by conftest.py and the tests (tests/messenger is on sys.path).

"mrep_double" is a TEST DOUBLE, not a libfabric provider: fabric_mrep_provider.c, built here
into a DL provider that libfabric loads through FI_PROVIDER_PATH (set at import, before any
process of the tests loads libfabric), wrapping tcp;ofi_rxm on the loopback and demanding
FI_MR_ENDPOINT, which no provider installed here does (see that file)."""
from __future__ import annotations

import os
import sys

import pytest

FABRIC_PROVIDERS = ("tcp;ofi_rxm", "sockets", "shm", "mrep_double")  # software ones + the double
FABRIC_DOMAINS = {"tcp;ofi_rxm": ["lo"], "sockets": ["lo"], "mrep_double": ["lo"]}  # loopback only
MREP_DOUBLE = "mrep_double"
_FOUND = None


def _build_mrep_double() -> str | None:
    """Build the FI_MR_ENDPOINT test double (once per source text) and put its directory on
    FI_PROVIDER_PATH; None (and the double's tests skip, naming why) without gcc or headers."""
    import hashlib
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    src = Path(__file__).resolve().parent / "fabric_mrep_provider.c"
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return "no C compiler"
    out = Path(tempfile.gettempdir()) / f"pdkv-mrep-{hashlib.sha1(src.read_bytes()).hexdigest()[:12]}"
    lib = out / "libmrep_double-fi.so"
    if not lib.exists():
        out.mkdir(exist_ok=True)
        tmp = out / f".build-{os.getpid()}.so"
        r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-o", str(tmp), str(src), "-lfabric"],
                           capture_output=True, text=True)
        if r.returncode:
            return f"cannot build {src.name}: {r.stderr[-300:]}"
        tmp.replace(lib)  # atomic: parallel test processes never load half a file
    paths = [p for p in os.environ.get("FI_PROVIDER_PATH", "").split(":") if p]
    if str(out) not in paths:
        os.environ["FI_PROVIDER_PATH"] = ":".join([*paths, str(out)])
    return None


MREP_DOUBLE_MISSING = _build_mrep_double()


def refusal_reported(transport: str) -> tuple[bool, bool]:
    """(the writer, the receiver) learn of a remote write the target refused. tcp and verbs: both
    (the receiver's check, the NIC's access error breaking the QP). libfabric: the target's
    provider refuses it with no event to the target application; tcp;ofi_rxm (under
    FI_DELIVERY_COMPLETE; a key the target lacks: never completed, failed by the transport's
    stall clock) and sockets fail the writer's completion, shm drops it silently (the write
    reports done; the immediate the target waits for never arrives). Nothing lands on any."""
    if not transport.startswith("libfabric:"):
        return True, True
    return transport != "libfabric:shm", False


_PROBE = """
import json, sys
from pdkv._messenger import HAVE_LIBFABRIC, Messenger
from pdkv.transports import LibfabricOptions
found, why = [], {}
for p, domains in json.loads(sys.argv[1]):
    try:
        Messenger("libfabric", 1, LibfabricOptions(provider=p, domains=tuple(domains))).close()
        found.append(p)
    except Exception as e:
        why[p] = str(e)
print(json.dumps([HAVE_LIBFABRIC, found, why]))
"""


def fabric_providers() -> list[str]:
    """The software providers that can make a libfabric transport here, [] when pdkv was built
    without libfabric; asked once, in a child process (libfabric and its provider libraries
    are never loaded into the test process for this), and printed with the reasons for the
    others. Under PDKV_REQUIRE_LIBFABRIC=1 (.ci/run) a missing one fails the tests that use it
    instead of leaving them out."""
    global _FOUND
    if _FOUND is None:
        import json
        import subprocess
        from pathlib import Path

        arg = json.dumps([[p, FABRIC_DOMAINS.get(p, [])] for p in FABRIC_PROVIDERS])
        r = subprocess.run([sys.executable, "-c", _PROBE, arg], capture_output=True, text=True,
                           timeout=60, cwd=str(Path(__file__).resolve().parents[2]))
        have, _FOUND, why = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
            (False, [], {"probe": r.stderr[-500:]})
        print(f"libfabric providers found: {_FOUND or 'none'} (built with libfabric: {have})"
              + "".join(f"; {p}: {w}" for p, w in why.items()), file=sys.stderr)
    return _FOUND


def fabric_params(providers=FABRIC_PROVIDERS) -> list:
    found = fabric_providers()
    need = os.environ.get("PDKV_REQUIRE_LIBFABRIC") == "1"
    return [pytest.param(f"libfabric:{p}", marks=pytest.mark.skipif(
        p not in found and not need, reason=f"libfabric provider {p} not available"
        + (f" ({MREP_DOUBLE_MISSING})" if p == MREP_DOUBLE and MREP_DOUBLE_MISSING else "")))
        for p in providers]


def transport_params(providers=("tcp;ofi_rxm", MREP_DOUBLE)) -> list:
    """tcp, verbs, shm (same host: grants are mappings), auto (connected as peers of one host: its
    shm route), and libfabric over `providers` (the whole suite: tcp;ofi_rxm, the software
    provider closest to EFA -- RDM emulated over connections, manual progress -- and the same
    under the FI_MR_ENDPOINT test double; test_transfer.py runs over every provider:
    transport_params(FABRIC_PROVIDERS))."""
    from pdkv._messenger import HAVE_VERBS

    # Under PDKV_REQUIRE_VERBS=1 (.ci/run) a missing verbs build fails these (in the
    # loopback_verbs_dir fixture) instead of skipping them.
    skip = not HAVE_VERBS and os.environ.get("PDKV_REQUIRE_VERBS") != "1"
    verbs = pytest.param("verbs", marks=pytest.mark.skipif(skip, reason="pdkv built without libibverbs"))
    return ["tcp", verbs, "shm", "auto"] + fabric_params(providers)
