"""A throw-away PKI for the TLS tests, made at test time with the ``openssl`` command (no
network): two CAs, node certificates signed by each, all EC P-256, valid for two days."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

LEAF_EXT = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth,clientAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")


def have_openssl() -> str | None:
    """Why certificates cannot be made here, or None."""
    return None if shutil.which("openssl") else "no openssl command on this machine (and no cryptography package)"


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
         "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def make_leaf(d: Path, name: str, ca: tuple[Path, Path]) -> dict:
    """{cert, key, ca}: a node certificate signed by ``ca`` (the messenger.tls section for it)."""
    (d / "leaf.ext").write_text(LEAF_EXT)
    _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
         "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
         "-days", "2", "-extfile", "leaf.ext", "-out", f"{name}.pem", cwd=d)
    return {"cert": str(d / f"{name}.pem"), "key": str(d / f"{name}.key"), "ca": str(ca[0])}


def make_pki(d: Path) -> dict:
    """prefill / decode: the cluster's nodes (CA "cluster-ca"); stranger: a node of another CA."""
    ca, other = make_ca(d, "cluster-ca"), make_ca(d, "other-ca")
    return {"prefill": make_leaf(d, "prefill", ca), "decode": make_leaf(d, "decode", ca),
            "stranger": make_leaf(d, "stranger", other), "dir": d}
