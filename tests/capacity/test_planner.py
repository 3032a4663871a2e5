"""The planner's arithmetic on public configs: parameter counts against published totals, the
published DeepSeek-V3 layouts fit and an impossible one does not (naming the phase and the
numbers), the shipped configs fit their stated cluster, FLOPs by hand, the CLI's interface."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from conftest import REPO
from hf_configs import DEEPSEEK_V3, GLM45, LLAMA3_70B, PUBLISHED_PARAMS, QWEN3_4B, QWEN3_235B, QWEN25_05B, QWEN25_7B, write
from megarl.capacity import Cluster, GPUS, Layout, RunShape, arch_from_config, plan, search, train_flops_per_token
from megarl.capacity.estimate import GIB
from megarl.capacity.arch import forward_flops_per_token, params_mtp, params_total, stage_layers
from megarl.capacity.from_config import load_run_config, planner_inputs


@pytest.mark.parametrize("name", PUBLISHED_PARAMS)
def test_params_total_matches_published(name):
    cfg, published = PUBLISHED_PARAMS[name]
    assert params_total(arch_from_config(cfg)) == pytest.approx(published, rel=0.01)


def test_deepseek_v3_mtp_and_active_params():
    arch = arch_from_config(DEEPSEEK_V3)
    # Tech report: 671B main model + 14B MTP module, whose embedding and head (2 x 0.93B) are the
    # main model's; 37B activated per token.
    shared_embedding_and_head = 2 * 129280 * 7168
    assert params_mtp(arch) + shared_embedding_and_head == pytest.approx(14e9, rel=0.05)
    from megarl.capacity.arch import params_active
    assert params_active(arch) == pytest.approx(37e9, rel=0.03)
    no_q_lora = arch_from_config({**DEEPSEEK_V3, "q_lora_rank": None})  # DeepSeek-V2-Lite style: a plain q projection
    assert params_total(no_q_lora) - params_total(arch) == 61 * (7168 * 128 * 192 - 7168 * 1536 - 1536 - 1536 * 128 * 192)


def test_hand_worked_flops():
    # llama, h=8, 1 layer, 2 heads of 4, 1 kv head, ffn 16, vocab 10 (the embedding lookup is free).
    arch = arch_from_config({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10})
    # matmul weights per token: qkv (2+2)*4*8 = 128; proj 64; fc1 256; fc2 128; head 80 -> 656 weights.
    # attention at context c: 2 * c * heads 2 * (4 + 4) = 32c.
    assert forward_flops_per_token(arch, 3.0) == 2 * 656 + 32 * 3
    assert train_flops_per_token(arch, 6) == 3 * (2 * 656 + 32 * 3)
    assert train_flops_per_token(arch, 6, recompute="full") == 4 * (2 * 656 + 32 * 3)


def test_uneven_stages():
    from megarl.capacity.estimate import balanced_split

    assert [len(r) for r in stage_layers(61, 16, 3, 2)] == [3] + [4] * 14 + [2]
    assert [len(r) for r in stage_layers(61, 12, None, 6)] == [5] * 11 + [6]
    with pytest.raises(ValueError, match="61 layers do not split over pp=16"):
        stage_layers(61, 16)
    # The search's split: the busiest stage as light as possible, then the lightest end stages.
    assert balanced_split(24, 4) == (None, None)
    assert [len(r) for r in stage_layers(61, 16, *balanced_split(61, 16))] == [4] * 15 + [1]
    assert max(len(r) for r in stage_layers(61, 12, *balanced_split(61, 12))) == 6


NEMO_RL = dict(  # NeMo-RL examples/configs/recipes/llm/performance/grpo-deepseek-v3-32n8g.yaml
    layout=Layout(tp=1, pp=16, ep=16, first_stage_layers=3, last_stage_layers=2, rollout_tp=32),
    # activation_checkpointing: true; 32 prompts x 16 generations; max_total_sequence_length 1536;
    # train_micro_batch_size 1; vLLM gpu_memory_utilization 0.6 (grpo_math_1B defaults); the
    # policy is moved off the GPU for colocated generation (NeMo-RL offloads it before refit).
    run=RunShape(prompts_per_step=32, samples_per_prompt=16, prompt_len=512, response_len=1024, max_tokens_per_microbatch=1536,
                 recompute="full", param_offload=True, grad_offload=True, optimizer_offload="phases", gpu_memory_fraction=0.6),
    cluster=Cluster(256, 8, GPUS["h100-80gb"]))
VERL = dict(  # verl examples/grpo_trainer/run_deepseek671b_math_megatron_96gb.sh
    layout=Layout(tp=8, pp=12, ep=8, etp=1, last_stage_layers=6, rollout_tp=32),
    # offload=True (param, grad), optimizer_cpu_offload=True with optimizer_offload_fraction=1,
    # ref param_offload, recompute full, gen_tp 32, gpu_memory_utilization 0.6, prompt 2048,
    # response 1204 * 8, ppo_max_token_len_per_gpu = prompt + response, 96 prompts x 8.
    run=RunShape(prompts_per_step=96, samples_per_prompt=8, prompt_len=2048, response_len=9632, max_tokens_per_microbatch=11680,
                 recompute="full", param_offload=True, grad_offload=True, optimizer_offload="cpu", gpu_memory_fraction=0.6),
    cluster=Cluster(96, 8, GPUS["h20-96gb"]))


@pytest.mark.parametrize("recipe", [NEMO_RL, VERL], ids=["nemo-rl-256xh100", "verl-96xh20"])
def test_deepseek_v3_published_layouts_fit(recipe):
    report = plan(arch_from_config(DEEPSEEK_V3), recipe["layout"], recipe["run"], recipe["cluster"])
    assert report["fits"], report["problems"]
    assert report["problems"] == []
    mem = report["memory_gib"]
    assert mem["training"]["total"] <= recipe["cluster"].gpu.memory_gib
    # Everything is offloaded for the rollout, which then holds 1/32 of the bf16 model, plus whole
    # copies of what TP replicates: MLA's q/kv down-projections and the routers.
    assert mem["rollout"]["training_state"] == 0
    replicated = 61 * 7168 * (1536 + 576) + 58 * 256 * 7168
    expected = (671e9 - replicated) * 2 / 32 + replicated * 2
    assert mem["rollout"]["rollout_weights"] == pytest.approx(expected / 2**30, rel=0.01)


def test_deepseek_v3_without_offload_does_not_fit_the_verl_cluster():
    run = VERL["run"].__class__(**{**VERL["run"].__dict__, "optimizer_offload": "none"})
    report = plan(arch_from_config(DEEPSEEK_V3), VERL["layout"], run, VERL["cluster"])
    assert not report["fits"] and report["problems"][0].startswith("training:")


def test_deepseek_v3_on_eight_gpus_does_not_fit(tmp_path):
    model = write(DEEPSEEK_V3, tmp_path / "dsv3")
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "megarl.tools.plan", "--model", str(model), "--gpus", "8", "--gpus-per-node", "8",
                           "--gpu", "h100-80gb", "--tp", "8", "--json", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(out.read_text())
    assert report["fits"] is False and report["params_total"] == params_total(arch_from_config(DEEPSEEK_V3))
    training = report["memory_gib"]["training"]
    # 671B bf16 weights over 8 GPUs: 156 GiB of actor parameters per GPU before anything else.
    assert training["params"] > 2 * 150 and training["fits"] is False
    assert "training: " in proc.stdout and "> 80 GiB on h100-80gb" in proc.stdout and "params 31" in proc.stdout
    assert "DOES NOT FIT" in proc.stdout


def test_glm45_sizes_and_fits_on_a_large_cluster():
    arch = arch_from_config(GLM45)
    lay = Layout(tp=4, pp=8, ep=16, etp=1, first_stage_layers=8, last_stage_layers=12, rollout_tp=16)
    report = plan(arch, lay, RunShape(recompute="full", param_offload=True, grad_offload=True, optimizer_offload="phases"),
                  Cluster(256, 8, GPUS["h100-80gb"]))
    assert report["fits"], report["problems"]


def test_search_finds_deepseek_v3_layouts_on_256_h100():
    run = NEMO_RL["run"]
    found = search(arch_from_config(DEEPSEEK_V3), run, NEMO_RL["cluster"], top=3)
    assert found, "the published NeMo-RL layout fits, so the search must find at least one"
    assert all(f["training_gib"] <= 80 and f["rollout_gib"] <= 80 for f in found)


def test_search_ranks_fitting_layouts_for_qwen25_7b():
    found = search(arch_from_config(QWEN25_7B), RunShape(prompt_len=512, response_len=1024, max_tokens_per_microbatch=4096),
                   Cluster(8, 8, GPUS["h100-80gb"]))
    assert found and all(f["training_gib"] <= 80 and f["rollout_gib"] <= 80 for f in found)
    assert [f["step_time_s"] for f in found] == sorted(f["step_time_s"] for f in found)


# Shipped configs and the cluster their headers state.
SHIPPED = {"qwen2.5-0.5b-gsm8k.yaml": (QWEN25_05B, Cluster(1, 1, GPUS["h100-80gb"])),
           "qwen2.5-0.5b-gsm8k-tool.yaml": (QWEN25_05B, Cluster(1, 1, GPUS["h100-80gb"])),
           # issue 14's 671B-class configs: 32 nodes of 8 H100s each (their headers)
           "deepseek-v3-671b.yaml": (DEEPSEEK_V3, Cluster(256, 8, GPUS["h100-80gb"])),
           "glm-4.5-355b.yaml": (GLM45, Cluster(256, 8, GPUS["h100-80gb"])),
           "qwen3-235b-a22b.yaml": (QWEN3_235B, Cluster(256, 8, GPUS["h100-80gb"])),
           # issue 26: LoRA on one node of 8 H100s
           "llama-3-70b-lora.yaml": (LLAMA3_70B, Cluster(8, 8, GPUS["h100-80gb"])),
           # issue 23's long-reasoning recipe: one node of 8 H100s, context parallelism 4
           "qwen3-4b-long-reasoning.yaml": (QWEN3_4B, Cluster(8, 8, GPUS["h100-80gb"]))}


def test_shipped_configs_fit_their_stated_cluster(tmp_path):
    for path in sorted((REPO / "configs").glob("*.yaml")):
        if path.name == "tiny_cpu.yaml" or path.name.startswith("tiny_"):
            continue  # CPU demos: sized by tests/capacity/test_planner_vs_measured.py against measurement
        assert path.name in SHIPPED, f"{path.name}: add its model config and stated cluster to SHIPPED"
        hf, cluster = SHIPPED[path.name]
        _, lay, run = planner_inputs(load_run_config(path))
        report = plan(arch_from_config(hf), lay, run, cluster)
        assert report["fits"], (path.name, report["problems"])
        # the planner sees the config's whole layout (uneven end stages, virtual stages)
        p = load_run_config(path).parallel
        assert (lay.first_stage_layers, lay.last_stage_layers, lay.vpp) == (
            p.first_stage_layers, p.last_stage_layers, p.vpp or 1), path.name


def test_lora_70b_fits_one_node_where_full_weights_do_not():
    """configs/llama-3-70b-lora.yaml: adapters of rank 32 fit 8 x H100 80 GB; the same run training
    every weight needs about twice the memory. Hand-worked adapter count: per layer, rank x (in + out)
    of q (8192 -> 8192), k and v (8192 -> 1024), o (8192 -> 8192), gate and up (8192 -> 28672),
    down (28672 -> 8192) = 32 x 161,792 = 5,177,344; x 80 layers = 414,187,520."""
    cfg = load_run_config(REPO / "configs" / "llama-3-70b-lora.yaml")
    _, lay, run = planner_inputs(cfg)
    cluster = Cluster(8, 8, GPUS["h100-80gb"])
    lora = plan(arch_from_config(LLAMA3_70B), lay, run, cluster)
    full = plan(arch_from_config(LLAMA3_70B), lay, dataclasses.replace(run, lora_rank=0), cluster)
    assert lora["fits"] and not full["fits"], (lora["problems"], full["problems"])
    assert lora["lora"]["adapter_params"] == 32 * (2 * 8192 + 2 * (8192 + 1024) + 2 * 8192 + 2 * (8192 + 28672) + 28672 + 8192) * 80
    assert lora["lora"]["adapter_params"] == 414_187_520
    lt, ft = lora["memory_gib"]["training"], full["memory_gib"]["training"]
    # grads (fp32) and Adam state (+ fp32 master, bf16 weights) scale with the trained parameters:
    # adapters sharded 8 ways over tp (the replicated factor whole): per GPU between 1/8 and all of them
    assert 414_187_520 * 4 / 8 / GIB < lt["grads"] < 414_187_520 * 4 / GIB
    assert lt["optimizer"] == pytest.approx(lt["grads"] * 3, rel=0.01)  # 12 B vs 4 B per parameter, dp = 1
    assert ft["grads"] > 30 * lt["grads"]
    assert full["memory_gib"]["training"]["total"] > 2 * lt["total"]


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "12", "--tp", "3"], "parallel.tp = 3 does not divide the model's 28 attention heads"),
    (["--gpus", "6", "--tp", "4"], "--gpus 6 is not divisible by tp 4"),
    (["--gpus", "8", "--gpu", "tpu-v9"], "--gpu 'tpu-v9' is not in the GPU table"),
    (["--gpus", "8", "--ep", "2"], "parallel.ep = 2 needs a mixture-of-experts model"),
    (["--gpus", "0"], "--gpus must be at least 1"),
])
def test_bad_input_exits_2_with_one_clear_line(tmp_path, argv, message):
    model = write(QWEN25_7B, tmp_path / "q7")
    proc = subprocess.run([sys.executable, "-m", "megarl.tools.plan", "--model", str(model), *argv], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr


def test_missing_config_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megarl.tools.plan", "--model", str(tmp_path), "--gpus", "8"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "is not a Hugging Face model directory" in proc.stderr


def test_gpu_table_extends(tmp_path):
    table = tmp_path / "gpus.json"
    table.write_text(json.dumps({"mi300x-192gb": {"memory_gib": 192, "bf16_tflops": 1307, "nvlink_gb_s": 448, "ib_gb_s": 50}}))
    model = write(QWEN25_7B, tmp_path / "q7")
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "megarl.tools.plan", "--model", str(model), "--gpus", "8", "--gpu", "mi300x-192gb",
                           "--gpu-table", str(table), "--search", "--json", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["fits"] is True and report["cluster"]["memory_gib"] == 192 and report["search"]


def test_sequence_parallelism_splits_the_norm_share_of_activations():
    # Qwen2.5-7B, no recompute, one stage: per layer and token 4h elements (the norms' and residuals'
    # inputs and outputs) are whole on every TP rank without sequence parallelism, 4h / tp with it.
    from dataclasses import replace

    from megarl.capacity.estimate import activation_bytes

    arch, run = arch_from_config(QWEN25_7B), RunShape(max_tokens_per_microbatch=4096, dtype="bfloat16")
    lay = Layout(tp=4)
    with_sp, logits = activation_bytes(arch, lay, 0, run)
    without_sp, same_logits = activation_bytes(arch, replace(lay, sequence_parallel=False), 0, run)
    assert logits == same_logits
    assert without_sp - with_sp == pytest.approx(28 * 4 * 3584 * (1 - 1 / 4) * 4096 * 2)
    # tp 1: nothing to split, the key changes nothing
    assert activation_bytes(arch, Layout(), 0, run) == activation_bytes(arch, Layout(sequence_parallel=False), 0, run)


def test_verl_deepseek_v3_layout_is_accepted_and_planned(tmp_path):
    """verl's DeepSeek-V3 layout on 96 H20-96GB (verl docs/perf/dpsk.md, the 96-GPU row: TP8 PP12 EP8,
    LAST_LAYER=6, i.e. 5 layers on each other stage; ETP1 as in its 671B scripts): config
    validation takes it (MoE at tp8 with sequence parallelism, the default), and the planner plans it."""
    from megarl.config import validate
    from megarl.config.inputs import check_model_layout

    model = write(DEEPSEEK_V3, tmp_path / "dsv3")
    layout = ["parallel.tp=8", "parallel.pp=12", "parallel.ep=8", "parallel.etp=1", "parallel.first_stage_layers=null",
              "parallel.last_stage_layers=6", "rollout.tp=32", "data.prompts_per_step=96"]
    cfg = load_run_config(REPO / "configs" / "deepseek-v3-671b.yaml", [f"model.path={model}", *layout])
    assert cfg.parallel.sequence_parallel and validate(cfg, world_size=96).dp == 1
    check_model_layout(cfg)
    _, lay, run = planner_inputs(cfg)
    report = plan(arch_from_config(DEEPSEEK_V3), lay, run, Cluster(96, 8, GPUS["h20-96gb"]))
    assert report["layout"]["dp"] == 1 and report["layout"]["expert_dp"] == 1
    assert [len(r) for r in stage_layers(61, 12, None, 6)] == [5] * 11 + [6]
    from dataclasses import replace

    without = plan(arch_from_config(DEEPSEEK_V3), replace(lay, sequence_parallel=False), run, Cluster(96, 8, GPUS["h20-96gb"]))
    assert report["memory_gib"]["training"]["activations"] < without["memory_gib"]["training"]["activations"]


def test_long_reasoning_recipe_fits_only_with_context_parallelism():
    """configs/qwen3-4b-long-reasoning.yaml: 34k-token sequences fit 8 H100s at cp4 (a quarter of each
    micro-batch's tokens per GPU) and do not at cp1, where the activations and logits of the whole
    micro-batch sit on one GPU."""
    import dataclasses

    _, lay, run = planner_inputs(load_run_config(REPO / "configs" / "qwen3-4b-long-reasoning.yaml"))
    cluster = Cluster(8, 8, GPUS["h100-80gb"])
    at_cp4, at_cp1 = (plan(arch_from_config(QWEN3_4B), dataclasses.replace(lay, cp=cp), run, cluster) for cp in (4, 1))
    assert lay.cp == 4 and at_cp4["fits"] and not at_cp1["fits"]
    t4, t1 = at_cp4["memory_gib"]["training"], at_cp1["memory_gib"]["training"]
    assert t4["logits"] == pytest.approx(t1["logits"] / 4)
    # activations: a quarter of the tokens, plus one layer's all-gathered K/V (and their gradients)
    gathered = 2 * 36864 * 2 * 8 * 128 * 2 / 2**30
    assert t4["activations"] == pytest.approx(t1["activations"] / 4 + gathered, rel=1e-4)
    assert t4["params"] == t1["params"] and t4["grads"] > t1["grads"] / 4  # CP ranks hold weight replicas


def test_published_long_context_layout_is_planned():
    """slime's DeepSeek-R1 layout (issue 23: TP8 PP4 CP4 EP32 on 128 H100, the optimizer in CPU memory)
    with 32k-token responses, 16k tokens per GPU; 61 layers as 15 + 15 + 15 + 16."""
    lay = Layout(tp=8, pp=4, cp=4, ep=32, etp=1, first_stage_layers=15, last_stage_layers=16, rollout_tp=32)
    run = RunShape(prompts_per_step=64, samples_per_prompt=8, prompt_len=2048, response_len=32768,
                   max_tokens_per_microbatch=4 * 16384, recompute="full", param_offload=True, grad_offload=True,
                   optimizer_offload="cpu")
    report = plan(arch_from_config(DEEPSEEK_V3), lay, run, Cluster(128, 8, GPUS["h100-80gb"]))
    assert report["fits"], report["problems"]


def test_delta_weight_sync_in_the_planner():
    """rollout.weight_sync.mode=delta: bytes x the wire share of the changed fraction (bf16: indices
    6k bytes below 1/32 changed, bitmask 1/16 + 2k above), and the copy in both memory phases."""
    from megarl.capacity import Cluster, Layout, RunShape, arch_from_config, plan
    from megarl.capacity.hardware import GPUS
    from megarl.layout.sync_cost import delta_wire_fraction
    from hf_configs import QWEN25_7B

    assert delta_wire_fraction(0.01) == pytest.approx(0.03) and delta_wire_fraction(0.2) == pytest.approx(0.2625)
    assert delta_wire_fraction(0.99) == 1.0
    arch, lay, cluster = arch_from_config(QWEN25_7B), Layout(tp=2, rollout_tp=1), Cluster(8, 8, GPUS["h100-80gb"])
    full, delta = (plan(arch, lay, RunShape(weight_sync=mode, delta_changed_fraction=0.2), cluster) for mode in ("full", "delta"))
    moved = full["sync"]["megarl_bytes_per_gpu"]
    assert full["sync"]["bytes_per_sync_per_gpu"] == moved and full["sync"]["weight_sync_copy_bytes_per_gpu"] == 0
    assert delta["sync"]["bytes_per_sync_per_gpu"] == pytest.approx(0.2625 * moved)
    assert delta["sync"]["seconds"] == pytest.approx(0.2625 * full["sync"]["seconds"])
    copy_gib = 2 * moved / 2**30
    for phase in ("training", "rollout"):
        grew = delta["memory_gib"][phase]["total"] - full["memory_gib"][phase]["total"]
        assert grew == pytest.approx(copy_gib, abs=1e-5)
