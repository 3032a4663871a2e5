"""Under LoRA the training state follows the adapters: after one update the gradient buffer holds
the adapters' float32 gradients and the optimizer two Adam moments of them, nothing of the frozen
base; the parameters are the base plus the adapters, and offloading them moves both."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_worker import update  # noqa: E402

from megarl.engine.engine import EngineConfig, MegatronEngine  # noqa: E402
from megarl.models.lora import LoraOptions  # noqa: E402


def _adapter_numel(spec_layers: int, hidden: int, ffn: int, q: int, kv: int, rank: int) -> int:
    """Hand count for a llama layer: (A [r, in] + B [out, r]) per HF projection."""
    per_layer = sum(rank * (i + o) for i, o in [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
                                                (hidden, ffn), (hidden, ffn), (ffn, hidden)])
    return spec_layers * per_layer


def test_grads_and_optimizer_state_scale_with_the_adapters(tiny_models, world_of_one):
    model = str(tiny_models["llama"])
    full = MegatronEngine(model, world_of_one, EngineConfig(param_offload=True))
    lora = MegatronEngine(model, world_of_one, EngineConfig(param_offload=True, lora=LoraOptions(rank=4, alpha=8.0, seed=1)))
    for engine in (full, lora):
        update(engine, world_of_one, 0, critic=False)
    s = lora.spec
    adapter = _adapter_numel(s.num_layers, s.hidden_size, s.ffn_hidden_size, s.num_heads * s.head_dim,
                             s.num_kv_heads * s.head_dim, 4)

    f, l = full.state_bytes(), lora.state_bytes()
    base = f["params"]  # float32, every weight trains
    assert f["trainable_params"] == f["params"] and f["grads"] == base and f["optimizer"] == 2 * base
    assert l["trainable_params"] == 4 * adapter
    assert l["params"] == base + 4 * adapter  # frozen base (own Parameters) + adapters (DDP buffer)
    assert l["grads"] == 4 * adapter  # float32 gradients of the adapters only
    assert l["optimizer"] == 2 * 4 * adapter  # exp_avg, exp_avg_sq; no fp32 master copy in float32
    assert l["grads"] / f["grads"] < 0.5  # the ratio benchmarks/lora_memory.py records

    # Offloading the parameters moves the frozen base too (DDP's buffer holds only the adapters).
    resident = lora.resident_bytes()["params"]
    moved = lora.offload()
    assert resident == l["params"] and moved["params"] == l["params"] and lora.resident_bytes()["params"] == 0
    lora.onload()
    assert lora.resident_bytes()["params"] == l["params"] and lora.state_bytes() == l
