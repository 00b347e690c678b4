"""tests/bench/ab: helpers live in _abrun.py (importable as ``_abrun`` from these tests)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
