"""`python -m pdkv.bench NAME [ARGS...]` runs pdkv/bench/NAME.py's main(argv)."""

import importlib
import pkgutil
import sys

import pdkv.bench


def main(argv: list[str]) -> int:
    names = sorted(m.name for m in pkgutil.iter_modules(pdkv.bench.__path__) if not m.name.startswith("_"))
    name = argv[0].replace("-", "_") if argv else ""  # `fleet-sim` runs fleet_sim.py
    if name not in names:
        print(f"usage: python -m pdkv.bench {{{'|'.join(names)}}} [args...]",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"pdkv.bench.{name}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
