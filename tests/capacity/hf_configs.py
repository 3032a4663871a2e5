"""Public Hugging Face config.json contents (the fields the planner reads), written by the tests
themselves: nothing is downloaded. Published totals in PUBLISHED_PARAMS."""
from __future__ import annotations

import json
from pathlib import Path

QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
             "tie_word_embeddings": False, "max_position_embeddings": 131072, "rope_theta": 1000000.0}
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "tie_word_embeddings": True}
LLAMA31_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
               "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
               "tie_word_embeddings": False}
# Llama-3-70B(-Instruct): Llama-3.1-70B's dimensions, 8k context
LLAMA3_70B = {**LLAMA31_70B, "rope_theta": 500000.0, "max_position_embeddings": 8192}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "attention_bias": False}
QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": True, "attention_bias": False}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}
QWEN3_235B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
              "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
              "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
              "tie_word_embeddings": False, "attention_bias": False}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "topk_method": "noaux_tc",
               "num_nextn_predict_layers": 1, "vocab_size": 129280, "tie_word_embeddings": False}
GLM45 = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120, "intermediate_size": 12288,
         "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
         "head_dim": 128, "attention_bias": True, "use_qk_norm": True, "n_routed_experts": 160, "n_shared_experts": 1,
         "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1, "vocab_size": 151552,
         "partial_rotary_factor": 0.5, "tie_word_embeddings": False}

# (config, published total, source). DeepSeek-V3: 671B main model + 14B MTP module (tech report,
# arXiv:2412.19437, "685B" on the hub); GLM-4.5: 355B (zai-org model card).
PUBLISHED_PARAMS = {
    "qwen2.5-0.5b": (QWEN25_05B, 0.494e9),
    "qwen2.5-7b": (QWEN25_7B, 7.61e9),
    "llama3.1-70b": (LLAMA31_70B, 70.6e9),
    "qwen3-8b": (QWEN3_8B, 8.19e9),
    "mixtral-8x7b": (MIXTRAL_8X7B, 46.7e9),
    "qwen3-235b-a22b": (QWEN3_235B, 235.1e9),
    "deepseek-v3": (DEEPSEEK_V3, 671e9),
    "glm-4.5": (GLM45, 355e9),
}


def write(cfg: dict, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory
