"""The image build's last step (docker/Dockerfile): fail the build, not the first job on a cluster.

    python docker/verify_image.py <engine>

Checks that torch and Transformer-Engine's core wheel are built for the base image's CUDA major
(CUDA_VERSION, set by the nvidia/cuda images; a CUDA 12 torch in a CUDA 13 image, or the reverse,
imports but its kernels and the engine's do not load), then imports torch, Transformer-Engine's
PyTorch layers and the rollout engine.
"""
from __future__ import annotations

import importlib
import os
import re
import sys


def cuda_major_problem(torch_version: str, torch_cuda: str | None, image_cuda: str | None) -> str | None:
    """One line when torch's CUDA major differs from the image's (None: they agree)."""
    if not image_cuda:
        return "CUDA_VERSION is not set: build from an nvidia/cuda base image"
    if not torch_cuda:
        return f"torch {torch_version} is a CPU-only build; the image is CUDA {image_cuda}"
    if torch_cuda.split(".")[0] != image_cuda.split(".")[0]:
        return f"torch {torch_version} is built for CUDA {torch_cuda} but the image is CUDA {image_cuda}: the CUDA majors differ"
    return None


def te_core_problem(distributions: list[str], image_cuda: str) -> str | None:
    """Transformer-Engine's core library wheel (transformer_engine_cuNN) must be the image's CUDA major."""
    cores = sorted({d for d in distributions if re.fullmatch(r"transformer[-_]engine[-_]cu\d+", d.lower())})
    wrong = [d for d in cores if d.lower().rsplit("cu", 1)[1] != image_cuda.split(".")[0]]
    if not cores:
        return "no Transformer-Engine core wheel (transformer_engine_cuNN) is installed"
    if wrong:
        return f"{', '.join(wrong)} installed in a CUDA {image_cuda} image: the CUDA majors differ"
    return None


def main(engine: str) -> int:
    from importlib.metadata import distributions

    import torch

    image_cuda = os.environ.get("CUDA_VERSION")
    problem = cuda_major_problem(torch.__version__, torch.version.cuda, image_cuda) or \
        te_core_problem([d.metadata["Name"] for d in distributions()], image_cuda)
    if problem:
        print(f"verify_image: {problem}", file=sys.stderr)
        return 1
    import transformer_engine.pytorch  # noqa: F401  (its torch extension, not just the Python package)

    from megarl.models.builder import have_transformer_engine

    assert have_transformer_engine()
    module = importlib.import_module(engine)
    print(f"verify_image: torch {torch.__version__} (CUDA {torch.version.cuda}), {engine} {module.__version__}, "
          f"image CUDA {os.environ['CUDA_VERSION']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
