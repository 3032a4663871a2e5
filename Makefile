# Two entry points for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test test-fast
setup: $(VENV)/.installed

# torch is pinned to the CPU build that lies on local disk; an unpinned torch pulls a CUDA build.
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -e ".[test]"
	touch $@

demo: setup
	$(BIN)/torchrun --standalone --nproc_per_node 2 launch/ppo.py --config configs/tiny_cpu.yaml

test: setup
	$(BIN)/python -m pytest tests

# The edit loop: pure math, config, data, single-process parity (no slow, multiprocess, gpu or
# vllm tests); under 5 minutes on 2 cores. `make test` still runs everything.
test-fast: setup
	$(BIN)/python -m pytest tests -m "not slow and not multiprocess and not gpu and not vllm"

# Benchmark suite (benchmarks/suite.py, benchmarks/README.md): a few minutes on 2 CPU cores.
# bench-check measures, then compares with benchmarks/baselines/<machine kind>/suite.json and
# fails, naming the figure, when one is more than 15% slower than its baseline.
.PHONY: bench bench-check
bench: setup
	$(BIN)/python benchmarks/suite.py run

bench-check: bench
	$(BIN)/python benchmarks/suite.py check
