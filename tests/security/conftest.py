"""tests/security: hostile peers against real nodes on loopback; cluster helpers from tests/disagg
(``_cluster``) and the hostile peer here (``_hostile``)."""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "disagg"))
sys.path.insert(0, str(HERE))
