"""`python -m pdkv.bench NAME [ARGS...]` runs pdkv/bench/NAME.py's main(argv)."""

import importlib
import pkgutil
import sys

import pdkv.bench


def main(argv: list[str]) -> int:
    names = sorted(m.name for m in pkgutil.iter_modules(pdkv.bench.__path__) if not m.name.startswith("_"))
    if not argv or argv[0] not in names:
        print(f"usage: python -m pdkv.bench {{{'|'.join(names)}}} [args...]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"pdkv.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
