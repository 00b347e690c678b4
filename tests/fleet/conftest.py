"""tests/fleet: a real etcd per test (``etcd`` fixture), nodes as ``pdkv serve`` processes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))

from _etcd import EtcdServer, etcd_available  # noqa: E402


@pytest.fixture
def etcd(tmp_path):
    if not etcd_available():
        pytest.fail("etcd is not installed: apt-get install -y etcd-server (see README, set-up)")
    data = tmp_path / "etcd-data"
    data.mkdir()
    srv = EtcdServer(data).start()
    try:
        yield srv
    finally:
        srv.stop()
