"""``python -m pdkv`` is the ``pdkv`` command line (see pdkv/cli.py)."""

import sys

from pdkv.cli import main

sys.exit(main())
