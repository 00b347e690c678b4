# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all install demo test bench bench-micro clean

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Reinstall when the requirements or the build inputs change.
$(STAMP): $(PY) requirements.txt requirements-dev.txt setup.py $(wildcard */__init__.py pdkv/*.pyx pdkv/*.pxd pdkv/*.pxi pdkv/csrc/*.c pdkv/csrc/*.h)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) tools/demo.py

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) -m pdkv.bench engine

# Hot-path micro-benchmarks (tests/bench, never part of `make test`): saves this run under
# .benchmarks/ and prints the change per benchmark against the previous saved run.
BENCH_MICRO := --benchmark-only --benchmark-autosave --benchmark-compare --benchmark-sort=name \
	--benchmark-columns=min,median,iqr,rounds
bench-micro: install
	nice -n 10 $(PY) -m pytest -q $(BENCH_MICRO) tests/bench

clean:
	rm -rf build *.egg-info pdkv/_messenger.c pdkv/*.so
