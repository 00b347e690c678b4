"""tests/models: helpers live in _hf.py (importable as ``_hf`` from these tests)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
