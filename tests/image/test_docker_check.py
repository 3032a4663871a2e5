"""`make docker-check` (docker/check_pins.py): the GPU image's pins resolve for Linux x86-64 / CPython
3.12 and agree on one CUDA major; and docker/verify_image.py, the build's own last step.

The fast tests run the checker's reading of pip reports on hand-written metadata shaped like the real
wheels' (torch 2.14.0, vLLM 0.33.0, SGLang 0.5.23, Transformer-Engine 2.20.2); the slow one runs
`make docker-check` against PyPI, and the checker on the Dockerfile and pins of commit 4a6a786.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docker_{name}", REPO / "docker" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_pins = _load("check_pins")
verify_image = _load("verify_image")


def _item(name, version, requires, extras=None):
    return {"metadata": {"name": name, "version": version, "requires_dist": requires}, "requested_extras": extras}


TORCH_CU13 = _item("torch", "2.14.0", [
    "filelock", 'cuda-toolkit[cublas,cudart,nvrtc]==13.0.3; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.30.7; platform_system == "Linux"', 'optree>=0.13.0; extra == "optree"'])
VLLM = _item("vllm", "0.33.0", ["torch==2.14.0", "nvidia-cutlass-dsl[cu13]==4.8.0", "humming-kernels[cu13]==0.1.19",
                                'nvidia-deepstream-videodecode-cu12>=9.0.2; extra == "deepstream"'])
SGLANG = _item("sglang", "0.5.23", ["torch==2.14.1", "flashinfer_python[cu13]==0.7.2", "sglang-kernel==0.4.10"])
TE = _item("transformer_engine", "2.20.2", ['transformer_engine_cu12==2.20.2; extra == "core"',
                                            'transformer_engine_cu13==2.20.2; extra == "core-cu13"',
                                            'transformer_engine_torch==2.20.2; extra == "pytorch"'], ["core-cu13"])
# Not a root: nvidia-cutlass-dsl requires its CUDA 12 libraries whatever extra is asked for.
CUTLASS = _item("nvidia-cutlass-dsl", "4.8.0", ["nvidia-cutlass-dsl-libs-cu12==4.8.0",
                                                'nvidia-cutlass-dsl-libs-cu13==4.8.0; extra == "cu13"'], ["cu13"])
IMAGE_13 = check_pins.Image("13.0.1", "24.04", ["3.12"])


def test_cuda_majors_come_from_each_roots_own_active_requirements():
    builds = check_pins.cuda_builds({"install": [TORCH_CU13, VLLM, SGLANG, TE, CUTLASS]})
    assert sorted(builds) == ["sglang", "torch", "transformer-engine", "vllm"]
    assert {name: set(b.majors) for name, b in builds.items()} == {n: {13} for n in builds}
    assert builds["torch"].majors[13] == ["cuda-toolkit==13.0.3", "nvidia-nccl-cu13==2.30.7"]
    assert builds["vllm"].majors[13] == ["nvidia-cutlass-dsl[cu13]==4.8.0", "humming-kernels[cu13]==0.1.19"]
    assert builds["transformer-engine"].majors == {13: ["transformer_engine_cu13==2.20.2"]}  # not the "core" extra's cu12
    assert builds["sglang"].majors == {13: ["flashinfer_python[cu13]==0.7.2"]}
    assert check_pins.cuda_problems(builds, IMAGE_13, "vllm") == []


def test_a_cuda_12_build_is_named_against_a_cuda_13_image():
    torch_cu129 = _item("torch", "2.14.0+cu129", ['nvidia-nccl-cu12==2.27.5; platform_system == "Linux"'])
    te_28 = _item("transformer_engine", "2.8.0", ["transformer_engine_cu12==2.8.0"], ["pytorch"])
    builds = check_pins.cuda_builds({"install": [torch_cu129, VLLM, te_28]})
    assert builds["torch"].majors == {12: ["version 2.14.0+cu129", "nvidia-nccl-cu12==2.27.5"]}
    problems = check_pins.cuda_problems(builds, IMAGE_13, "vllm")
    assert [p.split(" is built")[0] for p in problems] == ["vllm: torch 2.14.0+cu129", "vllm: transformer-engine 2.8.0"]
    assert "CUDA 12 (version 2.14.0+cu129, nvidia-nccl-cu12==2.27.5) but the image is CUDA 13.0.1" in problems[0]
    # and the other way round: today's CUDA 13 wheels in the old CUDA 12.9 image
    old_image = check_pins.Image("12.9.1", "24.04", ["3.12"])
    named = [p.split(" is built")[0] for p in check_pins.cuda_problems(check_pins.cuda_builds({"install": [TORCH_CU13, VLLM]}),
                                                                      old_image, "vllm")]
    assert named == ["vllm: torch 2.14.0", "vllm: vllm 0.33.0"]


def test_a_root_that_names_no_cuda_build_is_a_problem():
    builds = check_pins.cuda_builds({"install": [_item("sglang", "0.5.23", ["torch==2.14.1"])]})
    (problem,) = check_pins.cuda_problems(builds, IMAGE_13, "sglang")
    assert problem.startswith("sglang: sglang 0.5.23 names no CUDA build")


def test_pip_failures_become_one_line_naming_the_pin():
    stderr = ("WARNING: Location 'file:///opt/x' is ignored\n"
              "ERROR: Could not find a version that satisfies the requirement torch==2.14.0+cu129 (from versions: 2.14.0)\n"
              "ERROR: No matching distribution found for torch==2.14.0+cu129\n")
    assert check_pins.pip_failure(stderr) == "torch==2.14.0+cu129: no wheel for Linux x86-64 / CPython 3.12"
    conflict = ("ERROR: Cannot install vllm==0.33.0 and torch==2.14.1 because these package versions have conflicting dependencies.\n"
                "The conflict is caused by:\n    The user requested torch==2.14.1\n    vllm 0.33.0 depends on torch==2.14.0\n"
                "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io\n")
    assert check_pins.pip_failure(conflict) == ("the pins conflict over vllm==0.33.0 and torch==2.14.1: The user requested "
                                                "torch==2.14.1; vllm 0.33.0 depends on torch==2.14.0")


def test_the_dockerfile_is_cuda_13_on_its_distros_python_and_installs_the_checked_files():
    text = (REPO / "docker" / "Dockerfile").read_text()
    image = check_pins.parse_dockerfile(text)
    assert (image.cuda_major, image.ubuntu, image.pythons) == (13, "24.04", ["3.12"])
    assert check_pins.image_problems(image) == []
    # what docker-check resolves is what the image installs
    assert "pip install -r docker/requirements/${ROLLOUT_EXTRA}.txt" in text
    assert "-r docker/requirements/source.txt" in text and '-e ".[${ROLLOUT_EXTRA}]"' in text
    assert "--index-url" not in text  # torch comes from PyPI with the rest
    engines = re.findall(r"ARG ROLLOUT_EXTRA=(\w+)", text)
    assert engines == ["vllm"] and all((REPO / "docker" / "requirements" / f"{e}.txt").exists() for e in ("vllm", "sglang"))
    old = check_pins.parse_dockerfile((FIXTURES / "Dockerfile.4a6a786").read_text())
    assert old.cuda == "12.9.1"
    assert check_pins.image_problems(old) == ["python3.11: Ubuntu 24.04 has no such package (its Python is 3.12); "
                                              "install python3.12"]


def test_verify_image_refuses_a_torch_of_another_cuda_major():
    assert verify_image.cuda_major_problem("2.14.0", "13.0", "13.0.1") is None
    assert verify_image.cuda_major_problem("2.14.0+cu129", "12.9", "13.0.1") == (
        "torch 2.14.0+cu129 is built for CUDA 12.9 but the image is CUDA 13.0.1: the CUDA majors differ")
    assert "CPU-only" in verify_image.cuda_major_problem("2.14.0+cpu", None, "13.0.1")
    assert verify_image.te_core_problem(["torch", "transformer_engine", "transformer_engine_cu13"], "13.0.1") is None
    assert verify_image.te_core_problem(["transformer_engine", "transformer_engine_cu12"], "13.0.1") == (
        "transformer_engine_cu12 installed in a CUDA 13.0.1 image: the CUDA majors differ")
    assert "no Transformer-Engine core wheel" in verify_image.te_core_problem(["transformer_engine"], "13.0.1")


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))


@pytest.mark.slow
@pytest.mark.timeout(2400)  # cold, on a loaded 2-core machine, resolving both engines took 9 minutes
def test_make_docker_check_passes_on_the_image_and_fails_on_the_old_one():
    """Against PyPI: today's pins resolve and agree on CUDA 13; the Dockerfile and pins of commit 4a6a786
    fail, each problem naming its package. About 3 minutes on a fresh machine (the reports of today's
    pins are then reused from runs/docker-check/)."""
    new = _run(["make", "--no-print-directory", "docker-check"], timeout=2000)
    assert new.returncode == 0, (new.stdout + new.stderr)[-4000:]
    for engine, root in (("vllm", "vllm 0.33.0"), ("sglang", "sglang 0.5.23")):
        line = next(line for line in new.stdout.splitlines() if line.startswith(f"docker-check: {engine}:"))
        assert f"{root} CUDA 13" in line and "torch 2.14." in line and "transformer-engine 2.20.2 CUDA 13" in line, line

    python = str(REPO / check_pins.CACHE.relative_to(REPO) / "venv" / "bin" / "python")
    old = _run([python, "docker/check_pins.py", "--dockerfile", str(FIXTURES / "Dockerfile.4a6a786"),
                "--requirements", str(FIXTURES / "requirements-4a6a786"), "--engines", "vllm"], timeout=900)
    assert old.returncode == 1, old.stdout + old.stderr
    failed = [line for line in old.stderr.splitlines() if line.startswith("docker-check FAILED: ")]
    assert "docker-check FAILED: python3.11: Ubuntu 24.04 has no such package (its Python is 3.12); install python3.12" in failed
    assert "docker-check FAILED: vllm: torch==2.14.0+cu129: no wheel for Linux x86-64 / CPython 3.12" in failed, failed

    # today's resolved vLLM set in the old CUDA 12.9 image: every root is named
    (report,) = [p for p in check_pins.CACHE.glob("vllm-*.json") if p.name == check_pins.report_name(
        "vllm", REPO / "docker" / "requirements" / "vllm.txt", REPO)]
    builds = check_pins.cuda_builds(json.loads(report.read_text()))
    old_image = check_pins.parse_dockerfile((FIXTURES / "Dockerfile.4a6a786").read_text())
    named = sorted(p.split(" is built")[0] for p in check_pins.cuda_problems(builds, old_image, "vllm"))
    assert named == ["vllm: torch 2.14.0", "vllm: transformer-engine 2.20.2", "vllm: vllm 0.33.0"]

