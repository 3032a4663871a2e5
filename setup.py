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
        # megarl.platform supports Megatron-Core 0.16.1 .. 0.19.x. Every release since 0.17 requires
        # Python 3.12, so 3.11 resolves 0.16.1; on 3.12 a fresh install resolves the newest 0.19.x and
        # a cluster image's own 0.17 or 0.18 is kept rather than replaced.
        "megatron-core>=0.16.1,<0.17; python_version < '3.12'",
        "megatron-core>=0.16.1,<0.20; python_version >= '3.12'",
        "transformers>=4.51",
        # hub ids as model paths (megarl.hub); transformers depends on it too, megarl imports it directly
        "huggingface_hub>=0.24",
        "safetensors",
        "tokenizers",
        "pyarrow",
        "pyyaml",
        "mlflow",
        # megatron.core.dist_checkpointing needs psutil on CPU.
        "psutil",
        "tqdm",
        # rollout.placement=fleet (megarl/fleet): the trainer's endpoint and the servers talk ZeroMQ with
        # msgpack messages, never pickles (what vLLM uses between its own processes)
        "pyzmq>=25",
        "msgpack>=1.0",
    ],
    extras_require={
        # tracking.loggers tensorboard / wandb, tracking.prometheus_port, megarl.tools.report; each is
        # imported only when chosen. None of them moves torch, transformers or protobuf (pip --dry-run).
        "monitor": ["tensorboard", "wandb", "prometheus-client", "matplotlib"],
        "test": ["pytest>=8", "pytest-timeout", "tensorboard", "wandb", "prometheus-client", "matplotlib", "peft",
                 "ruff==0.17.6", "mypy==2.4.1"],  # make lint
        # GPU-only. NVIDIA apex is built from source (see docker/); the PyPI "apex" is unrelated.
        "gpu": ["transformer-engine[pytorch]"],
        "vllm": ["vllm==0.33.0"],
        "sglang": ["sglang==0.5.23"],
    },
)
