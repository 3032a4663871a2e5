# Two entry points for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test test-fast test-multinode multinode-deps
setup: $(VENV)/.installed

# torch is pinned to the CPU build that lies on local disk; an unpinned torch pulls a CUDA build.
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -e ".[test]"
	touch $@

demo: setup
	$(BIN)/torchrun --standalone --nproc_per_node 2 launch/ppo.py --config configs/tiny_cpu.yaml

test: setup multinode-deps
	$(BIN)/python -m pytest tests

# The edit loop: pure math, config, data, single-process parity (no slow, multiprocess, gpu or
# vllm tests); under 5 minutes on 2 cores. `make test` still runs everything.
test-fast: setup
	$(BIN)/python -m pytest tests -m "not slow and not multiprocess and not gpu and not vllm"

# Two nodes as network namespaces, a real Slurm (slurmctld + one slurmd per node), preemption and
# stalled-rank tests (tests/multinode). Needs root for namespaces; without it they skip, visibly.
test-multinode: setup multinode-deps
	$(BIN)/python -m pytest tests/multinode

# Debian's slurm-wlm and iproute2 for that tier, installed only as root and only when missing.
multinode-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! (command -v slurmctld && command -v ip) >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm iproute2 >/dev/null; fi
