"""The GPU checks live in tools/ (gpu_check.py and its gpu_check_*.py modules, the one home of
every GPU check); these tests import them from there, as tools/gpu_check.py does."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
