# Two entry points for a fresh machine with Python 3.11 and 3.12: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# --- Python 3.12 + Megatron-Core 0.19.x (w17) -------------------------------------------------------
# megarl is tested on two stacks: Python 3.11 with Megatron-Core 0.16.1 (.venv) and Python 3.12 with
# the newest 0.19.x (.venv-py312). `make test` runs the full suite on the stack PY names and the
# core tier (CORE_TESTS) on the other; `make test PY=3.12` runs the full suite on 3.12.
PY        ?= 3.11
PYTHON312 ?= python3.12
# pyenv's shim finds python3.12 only when PYENV_VERSION names a 3.12 (as on the CI machines).
PYENV_312 := $(shell pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$$' | tail -1)
VENV312   := .venv-py312
BIN312    := $(VENV312)/bin
# The core tier: platform seams and checkpoint versions, parity of every family at tp2 and pp2 (and
# ep2), engine layout equivalence, 2-step PPO at dp2 against one process, checkpoint save + resume.
CORE_TESTS := tests/platform \
	tests/models/test_parity.py::test_parity_two_processes \
	tests/engine/test_engine.py::test_actor_and_critic_update_identical_across_layouts \
	"tests/trainer/test_ppo_runs.py::test_same_run_under_every_layout[dp2]" \
	tests/trainer/test_ppo_runs.py::test_resume_equals_uninterrupted_run
FULL_BIN  := $(if $(filter 3.12,$(PY)),$(BIN312),$(BIN))
CORE_BIN  := $(if $(filter 3.12,$(PY)),$(BIN),$(BIN312))
# ---------------------------------------------------------------------------------------------------

.PHONY: setup setup-py312 demo test test-full test-core
setup: $(VENV)/.installed
setup-py312: $(VENV312)/.installed

# torch is pinned to the CPU build that lies on local disk; an unpinned torch pulls a CUDA build.
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -e ".[test]"
	touch $@

# No CPU build of torch for 3.12 lies on local disk: the registry's CUDA build runs on CPU and brings
# triton, which `import megatron.core` needs since 0.18. setup.py resolves Megatron-Core 0.19.x here.
$(VENV312)/.installed: setup.py
	$(if $(PYENV_312),PYENV_VERSION=$(PYENV_312)) $(PYTHON312) -m venv $(VENV312)
	$(BIN312)/pip install -q --upgrade pip
	$(BIN312)/pip install -q torch==2.14.1 -e ".[test]"
	touch $@

demo: setup
	$(BIN)/torchrun --standalone --nproc_per_node 2 launch/ppo.py --config configs/tiny_cpu.yaml

# Each tier sees the other stack's python: tests/platform then checks real checkpoints across releases.
test: test-full test-core

test-full: setup setup-py312
	MEGARL_OTHER_PYTHON=$(abspath $(CORE_BIN))/python $(FULL_BIN)/python -m pytest tests

test-core: setup setup-py312
	MEGARL_OTHER_PYTHON=$(abspath $(FULL_BIN))/python $(CORE_BIN)/python -m pytest $(CORE_TESTS)
