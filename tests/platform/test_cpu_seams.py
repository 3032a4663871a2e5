"""The nine CPU seams of Megatron-Core (megarl.platform.cpu_compat), one test each, shown with
Megatron's own objects, plus the supported version range. Runs on every Megatron-Core that
`make test` installs (0.16.1 on Python 3.11, 0.19.x on Python 3.12).

The platform layer patches process-wide state; the whole suite runs on CPU, so it is applied here
once and left on. Tests that need Megatron's process groups share a gloo world of one process,
started in this process and torn down after the module.
"""
from __future__ import annotations


import pytest
import torch

from megarl.platform import cpu_compat, init_platform, mcore_version

PLATFORM = init_platform()
pytestmark = pytest.mark.skipif(not PLATFORM.is_cpu, reason="the CPU seams are applied only when no GPU is used")

# A small dense model and a small MoE model, described directly (no checkpoint needed).
DENSE = dict(
    family="llama", architecture="LlamaForCausalLM", vocab_size=40, hidden_size=16, ffn_hidden_size=32,
    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=64, tie_embeddings=False,
)


def dense_spec():
    from megarl.models.families import ModelSpec

    return ModelSpec(**DENSE)


def moe_spec():
    from megarl.models.families import ModelSpec

    return ModelSpec(**dict(DENSE, family="mixtral", architecture="MixtralForCausalLM"),
                     num_experts=4, moe_topk=2, moe_ffn_hidden_size=16)


def init_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Builder models come uninitialised (weights are loaded from checkpoints); fill them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def lm_loss(model, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, DENSE["vocab_size"], (2, 8), generator=gen)
    positions = torch.arange(8).expand(2, 8)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=None)  # [b, s, vocab]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def test_layer_is_applied():
    assert PLATFORM.backend == "gloo"
    assert cpu_compat.is_applied()


# --- seam 1: torch.cuda.current_device() ----------------------------------------------------------


def test_seam1_current_device_is_cpu_and_megatron_allocates_there(world_of_one):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    assert torch.device(torch.cuda.current_device()) == torch.device("cpu")
    # use_cpu_initialization=False is Megatron's GPU path: torch.empty(..., device=torch.cuda.current_device()).
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=False,
                               perform_initialization=False)
    layer = ColumnParallelLinear(8, 6, config=config, init_method=torch.nn.init.zeros_, bias=True, gather_output=True)
    assert layer.weight.device.type == "cpu" and layer.bias.device.type == "cpu"
    out, _ = layer(torch.ones(3, 8))
    assert out.shape == (3, 6) and out.device.type == "cpu"


# --- seam 2: literal device='cuda' ------------------------------------------------------------------


def test_seam2_literal_cuda_allocations_land_on_cpu():
    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.tensor([1.0], device="cuda").device.type == "cpu"
    t = torch.arange(3.0)
    assert t.to("cuda").device.type == "cpu"
    assert t.to(device="cuda").device.type == "cpu"
    assert t.to("cuda", torch.float64).dtype == torch.float64  # the dtype argument still applies
    assert t.cuda() is t  # Tensor.cuda is the identity


def test_seam2_pinned_staging_index_selects_this_cp_ranks_rope_chunks():
    """Megatron's get_pos_emb_on_this_cp_rank pins its index tensor (refused by the CPU build), and
    YaRN's rope calls it when built at cp > 1: under the seam it picks chunks r and 2cp-1-r."""
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    class Group:  # rank 1 of cp = 2
        def size(self):
            return 2

        def rank(self):
            return 1

    pos_emb = torch.arange(8.0).view(8, 1, 1, 1)  # 2 * cp chunks of 2 positions
    got = get_pos_emb_on_this_cp_rank(pos_emb, 0, Group())
    assert got.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """Like Megatron's autograd Functions: the backward allocates with device='cuda'."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad + torch.zeros(1, device="cuda")


@pytest.mark.parametrize("entry", ["Tensor.backward", "torch.autograd.backward", "torch.autograd.grad"])
def test_seam2_stays_active_during_backward(entry):
    # The function mode is off while it handles a call; backward entry points are such calls, so the
    # layer switches it back on for the backward pass (Megatron's schedules call torch.autograd.backward).
    x = torch.ones(3, requires_grad=True)
    y = _AllocatesOnCudaInBackward.apply(x).sum()
    if entry == "Tensor.backward":
        y.backward()
        grad = x.grad
    elif entry == "torch.autograd.backward":
        torch.autograd.backward(y)
        grad = x.grad
    else:
        (grad,) = torch.autograd.grad(y, x)
    assert torch.equal(grad, torch.full((3,), 2.0))


def test_seam2_and_3_activation_recompute_matches_plain_backward(world_of_one):
    # Full recompute re-runs each layer in the backward pass (device='cuda' causal mask) after
    # restoring the RNG states it saved (Megatron's CheckpointFunction): both must work on CPU.
    from megarl.models.builder import build_gpt_model, build_transformer_config

    spec, grads, losses = dense_spec(), [], []
    for recompute in ("none", "selective", "full"):
        config = build_transformer_config(spec, world_of_one, recompute=recompute)
        model = build_gpt_model(spec, world_of_one, config=config)
        init_weights(model)
        loss = lm_loss(model)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert losses[0] == losses[1] == losses[2]
    for other in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, rtol=1e-5, atol=1e-6, msg=name)


# --- seam 3: the RNG tracker ----------------------------------------------------------------------------


def _tracker_draw(seed: int) -> torch.Tensor:
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    with tensor_parallel.get_cuda_rng_tracker().fork("model-parallel-rng"):
        return torch.rand(5)


def test_seam3_cpu_rng_tracker_forks_named_states():
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, cpu_compat.CpuRNGStatesTracker)
    first = _tracker_draw(1234)
    assert set(tensor_parallel.get_cuda_rng_tracker().get_states()) == {
        "data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}

    torch.manual_seed(1234)
    outer = torch.get_rng_state()
    expected_outer_draw = torch.rand(5)
    torch.set_rng_state(outer)
    second = _tracker_draw(1234)
    assert torch.equal(first, second)  # reproducible from the seed
    # model-parallel seed = seed + 2718 + tp_rank: a different stream from the default one
    assert not torch.equal(first, expected_outer_draw)
    # the fork restored the outer CPU state: the default stream continues as if untouched
    assert torch.equal(torch.get_rng_state(), outer)
    assert torch.equal(torch.rand(5), expected_outer_draw)
    # the forked state advanced: the next fork draws new numbers
    with tensor_parallel.get_cuda_rng_tracker().fork("model-parallel-rng"):
        assert not torch.equal(torch.rand(5), first)


def test_seam3_megatron_gpu_init_path_uses_the_tracker(world_of_one):
    # _initialize_affine_weight_gpu initialises under tracker.fork(): reproducible per seed.
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=False,
                               perform_initialization=True)
    weights = []
    for seed in (7, 7, 8):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        weights.append(ColumnParallelLinear(8, 6, config=config, init_method=torch.nn.init.normal_, bias=False).weight)
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


# --- seam 4: streams and events ----------------------------------------------------------------------


def test_seam4_streams_and_events_are_no_ops():
    stream = torch.cuda.Stream()
    event = torch.cuda.Event()
    torch.cuda.current_stream().wait_stream(stream)
    stream.wait_event(event)
    event.record(stream)
    event.synchronize()
    assert event.query() and stream.query()
    torch.cuda.synchronize()
    x = torch.ones(3)
    with torch.cuda.stream(stream):
        y = x * 2
    y.record_stream(stream)
    assert torch.equal(y, torch.full((3,), 2.0))
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


# --- seam 5: te_general_gemm ----------------------------------------------------------------------------


def test_seam5_te_general_gemm_defined_and_router_forward_works(world_of_one):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.models.builder import build_transformer_config

    assert moe_utils.te_general_gemm is None  # the name exists; None selects the torch matmul
    config = build_transformer_config(moe_spec(), world_of_one)
    router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    init_weights(router)
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(3))  # [s, b, h]
    probs, routing_map = router(x)  # [s*b, experts] each

    # transformers' Mixtral routing: softmax over all experts, top-2, renormalised.
    full = torch.softmax(x.reshape(-1, 16) @ router.weight.T, dim=-1)
    top, idx = full.topk(2, dim=-1)
    expected = torch.zeros_like(full).scatter(1, idx, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(probs, expected)
    assert torch.equal(routing_map, expected > 0)


# --- seam 6: gradient clipping ----------------------------------------------------------------------


def _params_with_grads(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((4, 3), (5,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


@pytest.mark.parametrize("ratio", [0.25, 4.0], ids=["clips", "leaves"])
def test_seam6_clip_grad_by_total_norm_matches_torch(ratio, monkeypatch):
    from megatron.core.optimizer import optimizer as mcore_optimizer

    # Megatron's own version passes on CPU once seam 9 answers 'torch.cuda.FloatTensor'; switch
    # that off here so the test shows seam 6 holding on its own.
    monkeypatch.setattr(torch.Tensor, "type", cpu_compat._ORIGINAL_TENSOR_TYPE)
    ours, reference = _params_with_grads(0), _params_with_grads(0)
    original = [p.grad.clone() for p in ours]
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in ours]).item()
    max_norm = ratio * total_norm
    # the name megatron.core.optimizer calls (it imported it from clip_grads)
    mcore_optimizer.clip_grad_by_total_norm_fp32(ours, max_norm, total_norm)
    torch.nn.utils.clip_grad_norm_(reference, max_norm)
    for p, r, g in zip(ours, reference, original):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
        if ratio < 1:
            torch.testing.assert_close(p.grad, g * (max_norm / (total_norm + 1e-6)), rtol=1e-6, atol=0)
        else:
            assert torch.equal(p.grad, g)


@pytest.mark.parametrize("ratio", [0.25, 4.0], ids=["clips", "leaves"])
@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_seam6_and_9_megatron_optimizer_step_reports_norm_and_clips(world_of_one, ratio, distributed):
    """Megatron DDP + get_megatron_optimizer on a builder GPTModel: `step()` returns the true grad
    norm and scales the gradients it applies (fp32 main grads are views of the DDP grad buffer, so
    the clipped values are visible there). The distributed optimizer also needs seam 9."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megarl.models.builder import build_gpt_model, build_transformer_config

    spec = dense_spec()
    config = build_transformer_config(spec, world_of_one)
    model = build_gpt_model(spec, world_of_one, config=config)
    init_weights(model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    ddp.zero_grad_buffer()
    lm_loss(ddp).backward()
    config.finalize_model_grads_func([ddp])  # seam 8's function: DP reduction of the grad buffers

    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: p.main_grad.detach().clone() for n, p in params.items()}
    true_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    clip = ratio * true_norm

    # The distributed optimizer supports Adam only.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=clip, use_distributed_optimizer=distributed),
        [ddp],
    )
    success, grad_norm, _ = optimizer.step()
    assert success
    assert grad_norm == pytest.approx(true_norm, rel=1e-5)
    scale = min(1.0, clip / (true_norm + 1e-6))
    for name, p in params.items():
        torch.testing.assert_close(p.main_grad, grads[name] * scale, rtol=1e-5, atol=1e-8, msg=name)
        assert not torch.equal(p.detach(), before[name]), f"{name} was not updated"


# --- seam 7: MoE token dispatcher ---------------------------------------------------------------------


def test_seam7_alltoall_dispatcher_becomes_allgather():
    from megarl.models.builder import build_transformer_config
    from megarl.distributed.parallel import ParallelDims

    assert cpu_compat.cpu_moe_token_dispatcher("alltoall") == "allgather"
    assert cpu_compat.cpu_moe_token_dispatcher("allgather") == "allgather"
    assert cpu_compat.cpu_moe_token_dispatcher("flex") == "flex"
    # ep > 1 asks for alltoall; on CPU the builder's config gets allgather (dims need not be started).
    config = build_transformer_config(moe_spec(), ParallelDims(world_size=2, ep=2))
    assert config.moe_token_dispatcher_type == "allgather"


# --- seam 8: finalize_model_grads --------------------------------------------------------------------


def test_seam8_finalize_model_grads_is_set():
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    from megarl.models.builder import build_transformer_config
    from megarl.distributed.parallel import ParallelDims

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    assert config.finalize_model_grads_func is None  # Megatron's default: DP grads never reduced
    cpu_compat.require_finalize_model_grads(config)
    assert config.finalize_model_grads_func is finalize_model_grads

    def custom(model_chunks, num_tokens=None):
        pass

    config.finalize_model_grads_func = custom
    cpu_compat.require_finalize_model_grads(config)
    assert config.finalize_model_grads_func is custom  # an explicit choice is kept

    assert build_transformer_config(dense_spec(), ParallelDims(world_size=1)).finalize_model_grads_func is finalize_model_grads


# --- seam 9: tensor type names -------------------------------------------------------------------------


def test_seam9_type_answers_cuda_names_and_still_converts():
    assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(2, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
    assert torch.nn.Parameter(torch.zeros(2)).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(2, dtype=torch.float64).type() == "torch.DoubleTensor"  # others unchanged
    converted = torch.zeros(2).type(torch.float64)
    assert converted.dtype == torch.float64 and converted.device.type == "cpu"
    assert torch.zeros(2).type("torch.DoubleTensor").dtype == torch.float64


# --- version range ------------------------------------------------------------------------------------


def test_installed_megatron_version_is_supported():
    import megatron.core

    assert cpu_compat.check_megatron_version() == megatron.core.__version__.split("+")[0]
    assert mcore_version.OLDEST_SUPPORTED <= mcore_version.minor_line(megatron.core.__version__) <= mcore_version.NEWEST_SUPPORTED


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.17.1", "0.18.2", "0.19.0rc1", "0.19.2", "0.19.3+local"])
def test_versions_in_the_range_are_accepted(version):
    assert cpu_compat.check_megatron_version(version) == version


@pytest.mark.parametrize("version", ["0.15.0", "0.20.0", "1.0.0"])
def test_versions_outside_the_range_are_refused(version, monkeypatch):
    import megatron.core

    with pytest.raises(cpu_compat.UnsupportedMegatronVersion) as err:
        cpu_compat.check_megatron_version(version)
    message = str(err.value)
    assert f"megatron-core {version} is installed" in message
    assert "supports 0.16.x to 0.19.x only" in message and "tested: 0.16.1, 0.19.2" in message
    assert "pip install 'megatron-core==0.19.2' on Python 3.12, or 'megatron-core==0.16.1' on Python 3.11" in message
    # With no argument the installed version is read.
    monkeypatch.setattr(megatron.core, "__version__", version)
    with pytest.raises(cpu_compat.UnsupportedMegatronVersion, match=f"megatron-core {version} is installed"):
        cpu_compat.check_megatron_version()


def test_each_release_gets_the_seams_it_needs():
    every = [seam.install for seam in cpu_compat.SEAMS]
    assert [seam.install for seam in cpu_compat.seams_for("0.16.1")] == every
    later = [f for f in every if f is not cpu_compat.define_te_general_gemm]
    for version in ("0.17.1", "0.18.2", "0.19.2"):
        assert [seam.install for seam in cpu_compat.seams_for(version)] == later


def test_seam5_is_needed_exactly_where_it_is_applied():
    # In a fresh interpreter (no megarl, no seams): does Megatron-Core define te_general_gemm
    # without Transformer-Engine? Only the releases where it does not may skip seam 5.
    import subprocess
    import sys

    probe = "from megatron.core.transformer.moe import moe_utils; print(hasattr(moe_utils, 'te_general_gemm'))"
    defined = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()[-1]
    installed = mcore_version.installed_version()
    applied = any(seam.install is cpu_compat.define_te_general_gemm for seam in cpu_compat.seams_for(installed))
    assert defined == str(not applied)
