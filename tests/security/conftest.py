"""tests/security: hostile peers against real nodes on loopback; cluster helpers from tests/disagg."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "disagg"))
