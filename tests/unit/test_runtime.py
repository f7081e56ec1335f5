"""The CPU compatibility layer: scoped, inert under CUDA, and enough for megatron-core's CUDA calls."""
import pytest
import torch

from megatron_cispo.runner.cpu_compat import CpuCompat
from megatron_cispo.runner.distributed import optional_backends


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


def test_compat_restores_every_patch_on_exit():
    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state)
    with CpuCompat():
        assert torch.cuda.current_device() == 0
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state) == before


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


def test_optional_backends_are_detected_without_raising():
    found = optional_backends()
    assert set(found) == {"apex", "transformer_engine"}
    assert all(isinstance(v, bool) for v in found.values())


def test_init_distributed_refuses_interleaving_over_two_gloo_stages(monkeypatch):
    from megatron_cispo.runner import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"vp=2 with pp=2 is not supported over gloo"):
        distributed.init_distributed(pp=2, vp=2)
