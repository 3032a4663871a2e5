# Two entry points for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup demo demo-eval test test-fast
setup: $(VENV)/.installed

# torch is pinned to the CPU build that lies on local disk; an unpinned torch pulls a CUDA build.
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -e ".[test]"
	touch $@

demo: setup
	$(BIN)/torchrun --standalone --nproc_per_node 2 launch/ppo.py --config configs/tiny_cpu.yaml

# The README's demo figure: greedy exact match of the demo's last checkpoint on the held-out prompts.
DEMO_RUN := runs/tiny_cpu
demo-eval: setup
	$(BIN)/python -m megarl.tools.export_hf --ckpt $$(ls -d $(DEMO_RUN)/checkpoints/step_* | tail -n 1) --out $(DEMO_RUN)/hf_last
	$(BIN)/python -m megarl.tools.eval_exact_match --model $(DEMO_RUN)/hf_last --data runs/data/arithmetic/test.parquet \
		--run-config $(DEMO_RUN)/config.yaml

test: setup
	$(BIN)/python -m pytest tests

# The edit loop: pure math, config, data, single-process parity (no slow, multiprocess, gpu or
# vllm tests); under 5 minutes on 2 cores. `make test` still runs everything.
test-fast: setup
	$(BIN)/python -m pytest tests -m "not slow and not multiprocess and not gpu and not vllm"
