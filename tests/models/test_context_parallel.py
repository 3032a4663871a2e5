"""Context parallelism (`parallel.cp`): the 2*cp chunk split worked by hand, megarl's CP attention
math against per-sequence causal attention (one process, the all-gather simulated), the packed
layout under CP (routes split by CP, then by SP), the config refusals, and (torchrun, 4 ranks) every
family's log-probs against transformers at cp2 and cp2 x tp2 with sequence parallelism, the actor/critic
update and routing replay at cp2 x tp2 against one process, and a checkpoint moving from cp2 x tp2 to dp4."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megarl.config import ConfigError, load_config, validate
from megarl.engine import context_parallel as ecp
from megarl.engine.micro_batches import _packed
from megarl.models.context_parallel import _attend, cp_index, cp_plan, gathered_order
from megarl.models.moe_routing import ROUTES

from conftest import FAMILIES, FAMILIES_671B, REPO, make_model, torchrun

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cp_worker's transformers reference

# Beyond the qwen3 actor and critic of `update`: a softmax-routed MoE family and MLA (DeepSeek-V3,
# whose sigmoid-routed MoE has shared experts and a dense first layer), built without YaRN as
# make_model builds it, train at cp2 x tp2 like one process.
GRAD_FAMILIES = ("qwen3_moe", "deepseek_v3")


def test_cp_index_by_hand():
    # segments of 8 and 4 tokens at cp2: chunks of 2 and 1; rank r keeps chunks r and 3-r of each
    cu = [0, 8, 12]
    assert cp_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    # cp4 on one 16-token segment: chunk pairs (0,7) (1,6) (2,5) (3,4), two tokens each
    assert cp_index([0, 16], 4, 1).tolist() == [2, 3, 12, 13]
    assert cp_index([0, 16], 4, 3).tolist() == [6, 7, 8, 9]
    # the rank-major all-gather, put back in row order
    where = gathered_order(cu, 2)
    gathered = torch.cat([cp_index(cu, 2, r) for r in range(2)])
    assert torch.equal(gathered[where], torch.arange(12))
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 4"):
        cp_index([0, 6], 2, 0)


def test_padded_lengths_and_widths():
    assert [ecp.padded_length(n, 2) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert ecp.padded_length(5, 1) == 5  # cp1 unchanged
    assert ecp.width_multiple(1, 1) == 8 and ecp.width_multiple(2, 1) == 16  # what the engine used before
    assert ecp.width_multiple(1, 8) == 16 and ecp.width_multiple(2, 2) == 16 and ecp.width_multiple(1, 3) == 24


def test_packed_row_pads_each_sequence_inside_its_segment():
    mb, starts = _packed([[1, 2, 3], [4, 5, 6, 7, 8]], 16, torch.device("cpu"), seq_multiple=4)
    assert mb["input_ids"].tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0]]
    assert mb["packed_seq_params"].cu_seqlens_q.tolist() == [0, 4, 12, 16]  # 3 -> 4, 5 -> 8, a 4-token pad segment
    assert starts.tolist() == [0, 4]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    mb[ROUTES] = torch.arange(16).reshape(16, 1, 1)  # routing replay: one route per token of the row
    ecp.shard(mb, 2, 1)
    assert mb[ROUTES].flatten().tolist() == [1, 2, 6, 7, 8, 9, 13, 14]  # the tokens this rank routes
    assert mb["input_ids"].tolist() == [[2, 3, 6, 7, 8, 0, 0, 0]]  # chunks 1 and 2 of each segment (c = 1, 2, 1)
    assert mb["full_input_ids"].shape == (1, 16) and mb["cp_width"] == 16
    assert mb["packed_seq_params"].cu_seqlens_q_padded.tolist() == [0, 4, 12, 16]
    assert mb["cp_local_of"][[1, 2, 6, 0]].tolist() == [0, 1, 2, -1]
    # cp2 x tp2 with sequence parallelism: CP rank 1's 8 tokens, then TP rank 1's second SP block of
    # them (its routers see local tokens 4-7); splitting by SP first would give other tokens' routes
    again, _ = _packed([[1, 2, 3], [4, 5, 6, 7, 8]], 16, torch.device("cpu"), seq_multiple=4)
    again[ROUTES] = torch.arange(16).reshape(16, 1, 1)
    ecp.shard(again, 2, 1, sp_shard=(1, 2))
    assert again[ROUTES].flatten().tolist() == [8, 9, 13, 14]


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_attention_math_equals_per_sequence_causal_attention(cp):
    from megatron.core.packed_seq_params import PackedSeqParams

    torch.manual_seed(0)
    lengths = [2 * cp * 3, 2 * cp, 2 * cp * 3, 2 * cp * 2]  # two equal lengths share one SDPA call
    cu = torch.tensor([0, *lengths]).cumsum(0)
    heads, groups, dk, dv = 4, 2, 6, 5  # GQA, k/v head sizes differ (MLA)
    q, k = torch.randn(int(cu[-1]), heads, dk), torch.randn(int(cu[-1]), groups, dk)
    v = torch.randn(int(cu[-1]), groups, dv)
    scale = 1 / math.sqrt(dk)
    want = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        ks, vs = (t.repeat_interleave(heads // groups, 0) for t in (ks, vs))
        want.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1).reshape(e - s, -1))
    want = torch.cat(want)
    params = [PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu) for _ in range(cp)]
    idx = [cp_index(cu, cp, r) for r in range(cp)]
    k_all, v_all = torch.cat([k[i] for i in idx]), torch.cat([v[i] for i in idx])  # what the all-gather gives
    got = torch.zeros_like(want)
    for r in range(cp):
        got[idx[r]] = _attend(cp_plan(params[r], cp, r, q.device), q[idx[r]], k_all, v_all, heads, groups, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def _cfg(*overrides):
    return load_config(REPO / "configs" / "tiny_cpu.yaml", list(overrides))


def test_config_accepts_cp_and_refuses_what_is_not_built():
    assert validate(_cfg("parallel.cp=2", "model.sequence_packing=true"), world_size=2).dp == 1
    both = _cfg("parallel.cp=2", "parallel.tp=2", "model.sequence_packing=true")
    assert both.parallel.sequence_parallel and validate(both, world_size=4).dp == 1  # with SP, on by default at tp > 1
    for overrides, words in ((["model.sequence_packing=false"], "model.sequence_packing=true"),
                             (["model.sequence_packing=true", "parallel.pp=2"], "parallel.pp=1"),
                             (["model.sequence_packing=true", "actor.moe_aux_loss_coeff=0.01"], "actor.moe_aux_loss_coeff=0")):
        with pytest.raises(ConfigError, match=words) as err:
            validate(_cfg("parallel.cp=2", *overrides), world_size=4)
        assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cp2_and_cp2_x_tp2_logprobs_updates_replay_and_checkpoint(tmp_path, world_of_one):
    """One 4-rank launch (tests/models/cp_worker.py): cp2 (x dp2) and cp2 x tp2 with sequence
    parallelism. Every family's log-probs against transformers at both; the actor and critic update
    and routing replay (a MoE actor) at cp2 x tp2 against one process; its checkpoint loaded at dp4."""
    sys.path.insert(0, str(REPO / "tests" / "moe"))
    from replay_cases import batch_of, forward_and_update, make_models, recorded_results

    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.models.moe_routing import RouterOptions

    models = [make_model(tmp_path / a, a, vocab_size=301, tie=(a == "llama"), seed=i)
              for i, a in enumerate(FAMILIES + FAMILIES_671B)]
    # DeepSeek-V3's own rope: YaRN, whose cos/sin cache is built per CP rank (pinned index: cpu_compat seam 2)
    models.append(make_model(tmp_path / "deepseek_v3_yarn", "deepseek_v3", vocab_size=301, yarn_factor=4.0, seed=len(models)))
    rollout, actor = make_models(tmp_path / "replay")
    out = tmp_path / "cp.pt"
    cli_sequences = [[5, 17, 230, 4, 9, 88, 1], [300, 2, 41], list(range(40, 53))]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in cli_sequences))
    torchrun(4, ["tests/models/cp_worker.py", "--models", *map(str, models), "--train-model", str(models[2]),
                 "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--cli-dir", str(tmp_path),
                 "--grad-models", *(str(tmp_path / a) for a in GRAD_FAMILIES),
                 "--replay-models", str(rollout), str(actor)], timeout=900)
    r = torch.load(out, weights_only=False)
    # Routing replay at cp2 x tp2: each TP rank replays the routes of its SP block of its CP share
    # (split by CP first, then by SP), so the numbers are one process's.
    requests, results = recorded_results(rollout)
    engine = MegatronEngine(str(actor), world_of_one, EngineConfig(dtype="float32", routing=RouterOptions(replay=True),
                                                                  optim=OptimConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=0.0)))
    ref_logprobs, ref_norm, _ = forward_and_update(engine, batch_of(requests, results), num_global=len(results))
    got = r["replay"]
    assert (got["logprobs"] - ref_logprobs).abs().max() <= 1e-5
    assert got["grad_norm"] == pytest.approx(ref_norm, rel=1e-5) and got["gap"] <= 1e-5
    # megarl.tools.logprobs --cp 2 --tp 2 (llama) against transformers
    from cp_worker import hf_reference

    got = [json.loads(line)["logprobs"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    want, _ = hf_reference(str(models[0]), cli_sequences)
    assert [len(g) for g in got] == [len(s) - 1 for s in cli_sequences]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), w, rtol=0, atol=1e-4)
    assert list(r["logprobs"]) == ["cp2", "cp2xtp2"]
    for layout, by_family in r["logprobs"].items():
        # MoE (mixtral, qwen3_moe) and MLA (deepseek_v3, with YaRN too) included
        assert set(by_family) == set(FAMILIES + FAMILIES_671B) | {"deepseek_v3_yarn"}
        for family, diff in by_family.items():
            assert diff["logprobs"] < 1e-4 and diff["entropy"] < 1e-4, (layout, family, diff)
    for role in ("actor", "critic"):
        cp, ref = r["cp"][role], r["ref"][role]
        assert len(cp["grad_norms"]) == 2 and all(n > 0 for n in cp["grad_norms"])
        assert cp["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)  # loss scaling over dp x cp
        # counted once. abs 1e-6: actor/ppo_kl (~5e-4) is a mean of old - new log-probs of size
        # ~log(301) = 5.7, whose float32 spacing is 4.8e-7 (measured 2.8e-7 apart on main: 1e-7 was sub-ulp)
        assert cp["metrics"] == pytest.approx(ref["metrics"], rel=1e-4, abs=1e-6)
        for name, w in ref["weights"].items():
            torch.testing.assert_close(cp["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    # a MoE family and MLA: the actor's update at cp2 x tp2 (SP) equals one process's
    assert set(r["grads"]) == set(GRAD_FAMILIES)
    for family, got in r["grads"].items():
        cp, ref = got["cp"], got["ref"]
        assert len(cp["grad_norms"]) == 2 and all(n > 0 for n in cp["grad_norms"])
        assert cp["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), family
        for name, w in ref["weights"].items():
            torch.testing.assert_close(cp["weights"][name], w, rtol=1e-5, atol=1e-6, msg=f"{family} {name}")
    saved, loaded = r["cp"]["actor"]["weights"], r["ref"]["loaded"]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)  # cp2 x tp2 -> dp4 exactly
    second_cp, second_dp = r["cp"]["second"], r["ref"]["second"]
    assert second_dp["grad_norms"] == pytest.approx(second_cp["grad_norms"], rel=1e-5)
    for name, w in second_cp["weights"].items():
        torch.testing.assert_close(second_dp["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
