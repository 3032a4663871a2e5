"""megarl: PPO / RLHF for large language models on Megatron-Core."""

__version__ = "0.1.0"
