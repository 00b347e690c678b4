# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all install demo test bench bench-micro mutants clean

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Whether setup.py will compile the verbs transport (the libibverbs headers are there, and
# PDKV_NO_VERBS is not set). The answer is recorded in the NAME of a file, so when it changes
# (libibverbs-dev installed after the venv was built) the file is new and the stamp below is
# out of date -- a header's own mtime cannot say that: dpkg keeps the package's old mtime.
VERBS_HEADERS ?= /usr/include/infiniband/verbs.h /usr/local/include/infiniband/verbs.h
HAVE_VERBS := $(if $(PDKV_NO_VERBS),no,$(if $(wildcard $(VERBS_HEADERS)),yes,no))
# The same for the libfabric transport (libfabric-dev, PDKV_NO_LIBFABRIC): both answers name the file.
FABRIC_HEADERS ?= /usr/include/rdma/fabric.h /usr/local/include/rdma/fabric.h
HAVE_FABRIC := $(if $(PDKV_NO_LIBFABRIC),no,$(if $(wildcard $(FABRIC_HEADERS)),yes,no))
VERBS_STAMP := $(VENV)/.verbs-$(HAVE_VERBS)-fabric-$(HAVE_FABRIC)
VERBS_PY := $(if $(filter yes,$(HAVE_VERBS)),True,False)
FABRIC_PY := $(if $(filter yes,$(HAVE_FABRIC)),True,False)
CHECK_VERBS := $(PY) -c 'import sys, pdkv._messenger as m; sys.exit(m.HAVE_VERBS is not $(VERBS_PY) or m.HAVE_LIBFABRIC is not $(FABRIC_PY))'

$(VERBS_STAMP): | $(PY)
	mkdir -p $(@D)
	rm -f $(VENV)/.verbs-*
	touch $@

# Reinstall when the requirements, the build inputs or the verbs answer change. An editable
# install may keep an up-to-date-looking extension built the other way: rebuild it then.
$(STAMP): $(PY) $(VERBS_STAMP) requirements.txt requirements-dev.txt setup.py $(wildcard */__init__.py pdkv/*.pyx pdkv/*.pxd pdkv/*.pxi pdkv/csrc/*.c pdkv/csrc/*.h pdkv/kernels/*.c pdkv/kernels/*.h)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps xgrammar
	$(PY) -m pip install -q --no-build-isolation -e .
	$(CHECK_VERBS) || $(PY) setup.py -q build_ext --inplace --force
	@$(CHECK_VERBS) || { echo "pdkv._messenger.HAVE_VERBS is not $(VERBS_PY) or HAVE_LIBFABRIC not $(FABRIC_PY) after the build"; exit 1; }
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) tools/demo.py

# Two workers, each test file on one of them (--dist loadfile: a file's module fixtures, such as
# the DP groups and node pairs, start once): most tests wait on node processes rather than
# compute, so two at a time fit 2 cores and keep the suite under 15 minutes. TEST_WORKERS=0 runs
# it in one process. --no-loadscope-reorder: files go out in the order tests/conftest.py gives
# them (those with a `slow` test first), not by test count, which sent the minute-long one-test
# files last and left one worker idle at the end.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: install
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,$(XDIST)) tests

bench: install
	$(PY) -m pdkv.bench engine

# Hot-path micro-benchmarks (benchmarks/micro, never part of `make test`): saves this run under
# .benchmarks/ and prints the change per benchmark against the previous saved run.
BENCH_MICRO := --benchmark-only --benchmark-autosave --benchmark-compare --benchmark-sort=name \
	--benchmark-columns=min,median,iqr,rounds
bench-micro: install
	nice -n 10 $(PY) -m pytest -q $(BENCH_MICRO) benchmarks/micro

clean:
	rm -rf build *.egg-info pdkv/_messenger.c pdkv/_kernels.c pdkv/*.so

# Curated mutants (tools/mutants_catalog.py), each in a scratch copy, each required to fail a
# named test file; prints the kill rate (docs/TESTING.md). Not part of `make test`.
mutants: install
	$(PY) tools/mutants.py
