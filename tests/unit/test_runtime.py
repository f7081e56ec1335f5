"""The runner's runtime: the CPU compatibility layer (scoped, inert under CUDA, and enough for
megatron-core's CUDA calls), and the layout checks of init_distributed and the model builder."""
import pytest
import torch
from torch.autograd.function import BackwardCFunction

from megatron_cispo.runner.cpu_compat import CpuCompat
from megatron_cispo.runner.distributed import optional_backends
from megatron_cispo.runner.model import ModelConfig


def test_compat_redirects_cuda_factories_only_while_entered():
    compat = CpuCompat()
    with compat:
        assert compat.active
        assert torch.zeros(3, device="cuda").device.type == "cpu"
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.arange(3).cuda().device.type == "cpu"
        torch.cuda.synchronize()  # a no-op, not an error
    assert not compat.active
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        torch.zeros(3, device="cuda")


def _patched_objects():
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as A2A

    return (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,
            BackwardCFunction.apply, mappings._gather_along_first_dim, A2A.cuda_dtoh_stream,
            A2A.__dict__["_maybe_dtoh_and_synchronize"], getattr(moe_utils, "te_general_gemm", "unbound"))


def test_compat_restores_every_patch_on_exit():
    before = _patched_objects()
    with CpuCompat():
        assert torch.cuda.current_device() == 0
        assert _patched_objects() != before
    assert _patched_objects() == before


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """Like megatron's _AllToAll and SP linear backward: allocates on current_device()."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        out = torch.empty(g.shape, dtype=g.dtype, device=torch.cuda.current_device())
        return out.copy_(g * 2) + torch.zeros(g.shape, device="cuda")


def test_compat_covers_custom_backward_which_the_autograd_engine_runs_without_modes(monkeypatch):
    unpatched = BackwardCFunction.apply
    with CpuCompat():
        x = torch.ones(3, requires_grad=True)
        _AllocatesOnCudaInBackward.apply(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
        # without the BackwardCFunction patch the same backward fails, mode or no mode
        monkeypatch.setattr(BackwardCFunction, "apply", unpatched)
        with pytest.raises((RuntimeError, AssertionError)):
            _AllocatesOnCudaInBackward.apply(x).sum().backward()
        monkeypatch.undo()


def test_compat_lets_the_moe_router_gemm_run_without_transformer_engine():
    from megatron.core.transformer.moe import moe_utils

    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    with CpuCompat():
        logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
        logits.sum().backward()
    torch.testing.assert_close(logits, x @ w.t())
    torch.testing.assert_close(w.grad, torch.ones(5, 4).t() @ x.detach())


def test_compat_hands_alltoall_splits_on_as_host_sequences():
    from types import SimpleNamespace

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as A2A

    d = SimpleNamespace(drop_and_pad=False, cuda_dtoh_point="before_permutation_1",
                        input_splits=torch.tensor([3, 1]), output_splits=torch.tensor([2, 2]),
                        output_splits_tp=None)
    tokens = torch.tensor([4, 4])
    with CpuCompat():
        assert A2A._maybe_dtoh_and_synchronize(d, "before_ep_alltoall", tokens) is tokens
        assert torch.is_tensor(d.input_splits)  # not yet: only at the DtoH point
        A2A._maybe_dtoh_and_synchronize(d, "before_permutation_1", tokens)
    assert list(d.input_splits) == [3, 1] and list(d.output_splits) == [2, 2]
    assert not torch.is_tensor(d.input_splits) and d.output_splits_tp is None


def test_compat_is_inert_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original = torch.cuda.current_device
    with CpuCompat() as compat:
        assert not compat.active
        assert torch.cuda.current_device is original


def test_compat_is_not_reentrant():
    with CpuCompat() as compat:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            compat.__enter__()


def test_rng_tracker_forks_on_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    with CpuCompat():
        tracker = mrandom.get_cuda_rng_tracker()
        tracker.reset()
        tracker.add("test-stream", 123)
        torch.manual_seed(0)
        with tracker.fork("test-stream"):
            a = torch.rand(4)
        outside = torch.rand(4)
        tracker.reset()
        tracker.add("test-stream", 123)
        with tracker.fork("test-stream"):
            b = torch.rand(4)
        tracker.reset()
    torch.testing.assert_close(a, b)  # the stream is keyed by its seed
    torch.manual_seed(0)
    torch.testing.assert_close(outside, torch.rand(4))  # the default stream was left untouched


def test_grad_clipping_is_cpu_safe():
    from megatron.core.optimizer import optimizer as mopt

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    with CpuCompat():
        mopt.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    torch.testing.assert_close(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6)))


def test_init_distributed_rejects_a_layout_the_world_cannot_hold(monkeypatch):
    from megatron_cispo.runner import distributed

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by tp\*pp\*cp = 2\*1\*1"):
        distributed.init_distributed(tp=2)


def test_init_distributed_rejects_an_expert_layout_the_world_cannot_hold(monkeypatch):
    from megatron_cispo.runner import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by tp\*ep\*pp = 1\*4\*1"):
        distributed.init_distributed(ep=4)
    with pytest.raises(ValueError, match=r"ep must be a positive int, got 0"):
        distributed.init_distributed(ep=0)


def test_optional_backends_are_detected_without_raising():
    found = optional_backends()
    assert set(found) == {"apex", "transformer_engine"}
    assert all(isinstance(v, bool) for v in found.values())


def test_init_distributed_refuses_interleaving_over_two_gloo_stages(monkeypatch):
    from megatron_cispo.runner import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"vp=2 with pp=2 is not supported over gloo"):
        distributed.init_distributed(pp=2, vp=2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_moe_experts=0), r"model.num_moe_experts must be >= 1 or None \(dense\), got 0"),
    (dict(num_moe_experts=4, moe_router_topk=5), r"model.moe_router_topk must be in \[1, model.num_moe_experts=4\], got 5"),
    (dict(num_moe_experts=4, moe_router_topk=0), r"model.moe_router_topk must be in \[1, .*got 0"),
    (dict(num_moe_experts=4, moe_aux_loss_coeff=-0.1), r"model.moe_aux_loss_coeff must be finite and >= 0, got -0.1"),
    (dict(num_moe_experts=4, moe_z_loss_coeff=float("nan")), r"model.moe_z_loss_coeff must be finite and >= 0, got nan"),
    (dict(moe_aux_loss_coeff=0.01), r"model.moe_aux_loss_coeff=0.01 needs an MoE model"),
])
def test_model_config_rejects_bad_moe_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


@pytest.mark.parametrize("cfg,layout,message", [
    (dict(), dict(tp=1, ep=2), r"ep=2 \(expert parallelism\) needs an MoE model"),
    (dict(num_moe_experts=4), dict(tp=1, ep=3), r"model.num_moe_experts=4 is not divisible by ep=3"),
    (dict(num_moe_experts=4), dict(tp=2, ep=1), r"an MoE model with tp=2 needs sequence_parallel=True"),
    (dict(), dict(tp=1, sequence_parallel=True), r"sequence_parallel needs tp >= 2"),
    (dict(ffn_hidden_size=30, num_attention_heads=4, vocab_size=64), dict(tp=4),
     r"MLP width \(model\.ffn_hidden_size, default 4\*hidden\)=30 is not divisible by tp=4"),
])
def test_check_layout_rejects_what_megatron_cannot_split(cfg, layout, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**cfg).check_layout(pp=1, vp=None, **layout)


def test_check_layout_accepts_moe_with_ep_and_sequence_parallel():
    ModelConfig(num_moe_experts=4).check_layout(tp=2, pp=1, vp=None, ep=2, sequence_parallel=True)
    ModelConfig().check_layout(tp=2, pp=1, vp=None, cp=2, sequence_parallel=True)


def test_local_spec_norms_allow_sequence_parallelism_and_mark_their_parameters():
    from megatron.core.transformer import TransformerConfig

    from megatron_cispo.runner.specs import TorchNorm, layer_spec

    spec = layer_spec(ModelConfig(num_moe_experts=4))
    assert spec.submodules.input_layernorm is TorchNorm and spec.submodules.pre_mlp_layernorm is TorchNorm
    tcfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                             sequence_parallel=True)
    norm = TorchNorm(tcfg, 8)
    # finalize_model_grads sums the grads of parameters marked sequence_parallel over TP
    assert isinstance(norm, torch.nn.LayerNorm) and all(p.sequence_parallel for p in norm.parameters())


def test_moe_transformer_config_uses_alltoall_sequential_experts_and_no_aux_loss_when_off():
    from megatron_cispo.runner.model import transformer_config

    t = transformer_config(ModelConfig(num_moe_experts=4), tp=2, pp=1, ep=2, sequence_parallel=True)
    assert (t.num_moe_experts, t.moe_router_topk, t.expert_model_parallel_size) == (4, 2, 2)
    assert t.moe_token_dispatcher_type == "alltoall" and not t.moe_grouped_gemm
    assert t.moe_router_load_balancing_type == "none" and t.moe_z_loss_coeff is None
    assert t.calculate_per_token_loss and t.sequence_parallel and t.expert_tensor_parallel_size == 2
    on = transformer_config(ModelConfig(num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
                            tp=1, pp=1)
    assert (on.moe_router_load_balancing_type, on.moe_aux_loss_coeff, on.moe_z_loss_coeff) == ("aux_loss", 0.01, 1e-3)
    assert transformer_config(ModelConfig(), tp=1, pp=1).num_moe_experts is None
