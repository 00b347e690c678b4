#!/usr/bin/env python3
"""Writes a tiny random Hugging Face model folder: ``tools/make_tiny_model.py OUT [--arch ...]``.
Same as ``python -m pdkv.tiny_model``; see pdkv/tiny_model.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdkv.tiny_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
