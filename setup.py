"""megarl: PPO / RLHF for large language models on Megatron-Core."""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="PPO / RLHF trainer for LLMs on Megatron-Core with a 3D-HybridEngine",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        # GPU users install their own CUDA build of torch first; the CPU quick start pins 2.13.0.
        "torch>=2.6",
        # 0.16.1 is the newest release for Python 3.11 and the range megarl.platform tests.
        "megatron-core>=0.16.0,<0.17",
        "transformers>=4.51",
        "safetensors",
        "tokenizers",
        "pyarrow",
        "pyyaml",
        "mlflow",
        # megatron.core.dist_checkpointing needs psutil on CPU.
        "psutil",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout"],
        # GPU-only. NVIDIA apex is built from source (see docker/); the PyPI "apex" is unrelated.
        "gpu": ["transformer-engine[pytorch]"],
        "vllm": ["vllm==0.33.0"],
        "sglang": ["sglang==0.5.23"],
    },
)
