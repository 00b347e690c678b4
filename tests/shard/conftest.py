"""tests/shard: test_latent.py reuses test_plan_bytes.py's replay (importable by name from here)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
