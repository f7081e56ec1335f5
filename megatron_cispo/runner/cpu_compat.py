"""The CPU compatibility layer: scoped patches that let megatron-core 0.16-0.19 run on CPU over gloo.

    with CpuCompat():        # entered by runner.distributed.init_distributed on a CPU-only host
        ...                  # GPTModel, DDP, the optimizer and the 1F1B schedule, on gloo

Only the runner and the test harness enter it; no library module imports it. It rewrites
`device="cuda"` arguments process-wide while active, so library code must never rely on it:
tensors belong on the data's device. A no-op when CUDA is available.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

from ..mcore import import_failed

_MISSING = object()


def _eager(model=None, **_):
    """torch.compile's signature, returning the function itself (as a decorator, too)."""
    return model if model is not None else _eager


def import_megatron_core() -> None:
    """Import megatron.core; on a host without CUDA, without compiling its fused kernels.

    megatron-core binds `jit_fuser = torch.compile` when megatron/core/jit.py loads and decorates
    its fused kernels with it during the package import; the first torch.compile call imports
    TorchDynamo and Inductor, about 60% of the megatron-core import (benchmarks/bench_startup.py).
    Without CUDA, megatron loads here with torch.compile as the identity, so jit_fuser stays the
    identity and those kernels run eagerly; torch.compile itself is restored at once. Call it
    before the first megatron import of a process; a no-op when CUDA is available.
    """
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return
    compile_ = torch.compile
    torch.compile = _eager
    try:
        import megatron.core  # noqa: F401 - loaded for its side effect: jit_fuser bound to _eager
    except ModuleNotFoundError as e:
        if e.name not in ("megatron", "megatron.core"):  # a dependency: say which, in one line
            raise import_failed("megatron.core", e) from None
        # not installed at all: mcore.require_names, next, says so in one line
    finally:
        torch.compile = compile_


def _is_accel(device) -> bool:
    """True for a device argument that names CUDA: "cuda", "cuda:0", torch.device, or an int."""
    if device is None or isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare int is a CUDA ordinal in torch's factories
    return torch.device(device).type == "cuda"


class _RedirectCudaDevice(TorchFunctionMode):
    """Rewrites `device=` keyword arguments naming CUDA to CPU, `.cuda()` to a no-op, and a CPU tensor's
    `.type()` name to the CUDA one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_accel(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            # megatron's optimizers sort parameters by `param.type() == "torch.cuda.FloatTensor"` (and the
            # half types); a CPU tensor answers as the CUDA tensor it stands in for
            return "torch.cuda." + func(*args).rsplit(".", 1)[-1]
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, int, torch.device)) \
                and _is_accel(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _clip_grads_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU-safe stand-in for megatron's clip_grad_by_total_norm_fp32 (which asserts CUDA)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            g.detach().mul_(clip_coeff)


def _set_present_states(original):
    """megatron-core's DistributedOptimizer._set_main_param_and_optimizer_states (0.16 and 0.19) copies
    every tensor of the live state into place, "step" included, which torch's Adam keeps per parameter
    (no Apex or TE: on CPU) but a fully_reshardable checkpoint does not hold; load_state_dict has set
    it already from the saved param groups. Copy the tensors the checkpoint has."""
    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        live = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            if isinstance(value, torch.Tensor):
                live[key].copy_(value)
    return set_states


class _NoStream:
    """torch.cuda.current_stream() on a CPU host: work is already ordered, so waits are no-ops.
    megatron-core 0.19's start_grad_sync waits on it every step (for CUDA-graph wgrad events)."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


def _in_redirect_mode(apply):
    """Wrap BackwardCFunction.apply, which the autograd engine calls to run a custom Function's
    backward, so that the backward runs under the redirect mode: the engine runs backward with an
    empty torch-function mode stack, so entering the mode around Tensor.backward does not help.
    Tensor and grad-accumulator hooks still run without it."""

    def wrapped(self, *args):
        with _RedirectCudaDevice():
            return apply(self, *args)

    return wrapped


def _alltoall_splits_to_host(self, point, tokens_per_expert=None):
    """CPU stand-in for MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: no streams; at
    the DtoH point hand the split sizes on as numpy, as the CUDA path does (all_to_all_single
    takes sequences of ints, not tensors)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _gather_uneven_on_gloo(gather_along_first_dim):
    """Wrap mappings._gather_along_first_dim: gloo's all_gather needs equal sizes, so pad every
    rank's piece to the largest, gather, and cut the padding off."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1:
            return gather_along_first_dim(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    return gather


class CpuCompat(contextlib.AbstractContextManager):
    """Scoped patches that make megatron-core 0.16-0.19 run on CPU over gloo.

    Covers: `device="cuda"` factories (schedules' token counters, causal masks, grad-norm
    buffers), also inside custom autograd Functions' backward; `torch.cuda.current_device/
    synchronize`; the model-parallel RNG tracker (backed by the CPU generator); grad clipping; the
    distributed optimizer's checkpoint load without Apex or TE (its per-parameter "step");
    and for MoE: the router's TE GEMM hook, the alltoall dispatcher's CUDA streams, and uneven
    TP all-gathers, which gloo lacks. Never active when CUDA is available: then entering is a
    no-op and `active` stays False.
    """

    def __init__(self):
        self.active = False
        self._saved: list[tuple[object, str, object]] = []
        self._mode: _RedirectCudaDevice | None = None

    def _patch(self, owner, name, value):
        self._saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def __enter__(self):
        if self.active:
            raise RuntimeError("CpuCompat is already active; it is not re-entrant")
        if torch.cuda.is_available():
            return self
        from megatron.core.optimizer import optimizer as mcore_optimizer
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.tensor_parallel import mappings
        from megatron.core.tensor_parallel import random as mcore_random
        from megatron.core.transformer.moe import moe_utils, token_dispatcher

        self._patch(torch.cuda, "current_device", lambda: 0)
        self._patch(torch.cuda, "synchronize", lambda *a, **k: None)
        self._patch(torch.cuda, "current_stream", lambda *a, **k: _NoStream())
        self._patch(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
        self._patch(torch.cuda, "set_rng_state", lambda s, *a, **k: torch.set_rng_state(s))
        self._patch(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
        self._patch(mcore_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        self._patch(mcore_random, "_set_cuda_rng_state", lambda s, *a, **k: torch.set_rng_state(s))
        self._patch(mcore_optimizer, "clip_grad_by_total_norm_fp32", _clip_grads_cpu)
        self._patch(DistributedOptimizer, "_set_main_param_and_optimizer_states",
                    _set_present_states(DistributedOptimizer._set_main_param_and_optimizer_states))
        # backward of mappings._AllToAll (ep) and layers.LinearWithGradAccumulationAndAsyncCommunication (sp)
        self._patch(BackwardCFunction, "apply", _in_redirect_mode(BackwardCFunction.apply))
        if not hasattr(moe_utils, "te_general_gemm"):
            # moe_utils.RouterGatingLinearFunction reads te_general_gemm, which is unbound without TE
            self._patch(moe_utils, "te_general_gemm", None)
        # MoEAlltoAllTokenDispatcher.__init__ makes torch.cuda.Stream() unless this is set
        self._patch(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
        # MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: CUDA streams and events
        self._patch(token_dispatcher.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize",
                    _alltoall_splits_to_host)
        # mappings._gather_along_first_dim with output_split_sizes (alltoall dispatcher, tp x ep > 1)
        self._patch(mappings, "_gather_along_first_dim", _gather_uneven_on_gloo(mappings._gather_along_first_dim))
        self._mode = _RedirectCudaDevice()
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for owner, name, value in reversed(self._saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
        self.active = False
        return False
