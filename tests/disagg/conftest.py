"""tests/disagg: helpers live in _cluster.py (importable as ``_cluster`` from these tests)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
