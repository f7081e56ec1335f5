"""The Megatron-LM drop-in's get_logprobs at TP=2 over gloo, against log_softmax of the full
vocabulary on one process.

- logits head: each rank's stand-in GPTModel returns its [b, s, v/2] shard of one full logits
  tensor; values, and the gradient of the shard (fp32 and bf16);
- fused head: the stand-in's output_layer holds a [v/2, h] weight shard; values, and the
  gradients of the hidden states and of the weight shard;
- a real megatron-core GPTModel, as Megatron-LM wraps it: DDP(GPTModel) in fp32 (its forward
  takes no fp32_output) and DDP(Float16Module(GPTModel)) in bf16, both heads, against the same
  model's gathered logits.
One 2-rank launch; the models' pg_collection.tp is megatron's TP group (parallel_state).
"""
import sys
import types

import pytest
import torch

from megatron_cispo.testing import spawn

B, S, H, V = 2, 7, 8, 22  # V/2 = 11 columns per rank
TEMPERATURE = 0.8


def _get_attr_wrapped_model(model, attr):
    """Megatron-LM's helper: the attribute of the first module in the wrapper chain that has it."""
    while not hasattr(model, attr) and hasattr(model, "module"):
        model = model.module
    return getattr(model, attr)


def _install_rl_utils(args):
    """The megatron.rl.rl_utils helpers get_logprobs looks up (no Megatron-LM checkout here)."""
    rl = types.ModuleType("megatron.rl.rl_utils")
    rl.get_args = lambda: args
    rl.get_attr_wrapped_model = _get_attr_wrapped_model
    rl.is_pp_last_stage = lambda pp: pp.rank() == pp.size() - 1
    rl.get_default_packed_seq_params = lambda **kw: None
    sys.modules["megatron.rl"] = types.ModuleType("megatron.rl")
    sys.modules["megatron.rl.rl_utils"] = rl


class _Layer(torch.nn.Module):
    """ColumnParallelLinear without gather: hidden [s, b, h] -> (logits [s, b, v/tp], bias)."""

    def __init__(self, weight_shard):
        super().__init__()
        self.weight, self.sequence_parallel = torch.nn.Parameter(weight_shard), False

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight if weight is None else weight), None


class _GPT:
    """GPTModel's last stage with its forward signature: logits [s, b, v/tp] -> [b, s, v/tp]."""

    def __init__(self, pg_collection, *, logits=None, hidden=None, layer=None):
        self.config = types.SimpleNamespace(flash_decode=False)
        self.pg_collection, self.logits, self.hidden, self.output_layer = pg_collection, logits, hidden, layer

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output=None, *, inference_params=None, loss_mask=None, padding_mask=None):
        assert runtime_gather_output is False
        logits = self.logits if self.output_layer is None else self.output_layer(self.hidden)[0]
        return logits.transpose(0, 1).contiguous()


class _DDP:
    def __init__(self, module):
        self.module, self.config = module, module.config

    def __call__(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)


def _reference(logits_bsv, tokens, weights):
    """fp64 logprobs of tokens[:, 1:] from full logits [b, s, v] (a leaf's graph), and (lp * w).sum()."""
    lp = torch.log_softmax(logits_bsv[:, :-1].double() / TEMPERATURE, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return lp, (lp * weights).sum()


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _standin_cases(mlm, pg, rank):
    from megatron_cispo.config import LossConfig

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, S), generator=g)
    weights = torch.linspace(-1, 1, B * (S - 1)).view(B, S - 1)
    full = torch.randn(S, B, V, generator=g) * 3  # [s, b, v], as the output layer makes them
    hidden, weight = torch.randn(S, B, H, generator=g), torch.randn(V, H, generator=g) / H ** 0.5
    cols = slice(rank * V // 2, (rank + 1) * V // 2)
    out = {}
    mlm.configure(LossConfig(head="logits"), temperature=TEMPERATURE)
    for dtype in (torch.float32, torch.bfloat16):
        x = full.to(dtype)
        ref_in = x.double().requires_grad_()
        ref_lp, ref_loss = _reference(ref_in.transpose(0, 1), tokens, weights)
        ref_loss.backward()
        shard = x[..., cols].clone().requires_grad_()
        lp = mlm.get_logprobs(_GPT(pg, logits=shard), tokens, None)
        (lp.double() * weights).sum().backward()
        out[("logits", str(dtype))] = {
            "dtype": str(lp.dtype), "shape": tuple(lp.shape),
            # the result is rounded to the logits' dtype: half a spacing of that dtype, relative
            "lp_rel": ((lp.double() - ref_lp).abs() / ref_lp.abs()).max().item(),
            "grad_rel": _rel(shard.grad, ref_in.grad[..., cols]), "grad_dtype": str(shard.grad.dtype)}
    mlm.configure(LossConfig(head="fused"), temperature=TEMPERATURE)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_loss = _reference((h64 @ w64.t()).transpose(0, 1), tokens, weights)
    ref_loss.backward()
    h = hidden.clone().requires_grad_()
    model = _GPT(pg, hidden=h, layer=_Layer(weight[cols].clone()))
    lp = mlm.get_logprobs(_DDP(model), tokens, None)  # the output layer is found through the wrapper
    (lp.double() * weights).sum().backward()
    out[("fused", "torch.float32")] = {
        "dtype": str(lp.dtype), "shape": tuple(lp.shape), "lp_abs": (lp.double() - ref_lp).abs().max().item(),
        "grad_hidden_rel": _rel(h.grad, h64.grad), "grad_weight_rel": _rel(model.output_layer.weight.grad, w64.grad[cols]),
        "weight_shard": tuple(model.output_layer.weight.shape)}
    return out


def _real_model_cases(mlm):
    """get_logprobs on megatron-core's GPTModel in Megatron-LM's wrappers, both heads, against the
    same model's gathered logits."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_cispo.config import LossConfig
    from megatron_cispo.runner.model import ModelConfig, build_model

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (B, 12), generator=g)
    pos = torch.arange(12).expand(B, 12)
    out = {}
    for dtype in ("fp32", "bf16"):
        cfg = ModelConfig(vocab_size=32, seq_length=12, hidden_size=24, num_layers=1, num_attention_heads=4,
                          dtype=dtype, init_std=0.2)
        if dtype == "fp32":  # Megatron-LM's fp32 chain: DDP(GPTModel)
            model, = build_model(cfg, tp=2, pp=1, seed=3)
        else:  # bf16: DDP(Float16Module(GPTModel)), as Megatron-LM's get_model builds it
            gpt, = build_model(cfg, tp=2, pp=1, seed=3, wrap_ddp=False)
            model = DistributedDataParallel(
                config=gpt.config, module=Float16Module(gpt.config, gpt),
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, average_in_collective=False))
        sys.modules["megatron.rl.rl_utils"].get_args().bf16 = dtype == "bf16"
        gpt = model
        while hasattr(gpt, "module"):
            gpt = gpt.module
        with torch.no_grad():
            full = gpt(tokens, pos, None, runtime_gather_output=True)  # [b, s, v], the model dtype
        ref_lp, _ = _reference(full.float(), tokens, torch.zeros(B, 11))
        for head in ("logits", "fused"):
            mlm.configure(LossConfig(head=head), temperature=TEMPERATURE)
            lp = mlm.get_logprobs(model, tokens, pos, no_grad=True)
            out[("real", dtype, head)] = {"dtype": str(lp.dtype), "shape": tuple(lp.shape),
                                          "lp_rel": ((lp.double() - ref_lp).abs() / ref_lp.abs()).max().item()}
    return out


def _worker():
    from megatron.core import parallel_state as mpu

    from megatron_cispo.integrations import megatron_lm as mlm
    from megatron_cispo.runner import distributed

    distributed.init_distributed(tp=2)
    _install_rl_utils(types.SimpleNamespace(fp16=False, bf16=False, rl_sequence_packing_max_sequences_per_bin=8))
    pg = types.SimpleNamespace(tp=mpu.get_tensor_model_parallel_group(), pp=mpu.get_pipeline_model_parallel_group())
    try:
        return {**_standin_cases(mlm, pg, mpu.get_tensor_model_parallel_rank()), **_real_model_cases(mlm)}
    finally:
        mlm.configure(None)


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 2, timeout_s=300)


# fp32: fp32 math; bf16: the result is rounded to bf16, at most half a spacing, 2**-8 relative
@pytest.mark.parametrize("dtype,tol", [("torch.float32", 1e-5), ("torch.bfloat16", 2.0 ** -8)])
def test_logits_head_at_tp2_matches_full_vocab_log_softmax_values_and_shard_grads(results, dtype, tol):
    for rank, res in enumerate(results):
        r = res[("logits", dtype)]
        assert r["dtype"] == dtype and r["shape"] == (B, S - 1), (rank, r)
        assert r["lp_rel"] <= tol, (rank, r)  # rounding to the logits' dtype only
        assert r["grad_dtype"] == dtype and r["grad_rel"] < (1e-5 if dtype == "torch.float32" else 1e-2), (rank, r)


def test_fused_head_at_tp2_matches_full_vocab_values_and_hidden_and_weight_shard_grads(results):
    for rank, res in enumerate(results):
        r = res[("fused", "torch.float32")]
        assert r["dtype"] == "torch.float32" and r["shape"] == (B, S - 1) and r["weight_shard"] == (V // 2, H), r
        assert r["lp_abs"] < 1e-5 and r["grad_hidden_rel"] < 1e-5 and r["grad_weight_rel"] < 1e-5, (rank, r)


@pytest.mark.parametrize("head", ["logits", "fused"])
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 2.0 ** -8)])
def test_real_gptmodel_in_megatron_lm_wrappers_at_tp2(results, head, dtype, tol):
    # fp32: no Float16Module, so fp32_output would have been a TypeError in GPTModel.forward;
    # bf16: a bf16 result shows Float16Module got fp32_output=False (True upcasts the output)
    for rank, res in enumerate(results):
        r = res[("real", dtype, head)]
        assert r["dtype"] == ("torch.float32" if dtype == "fp32" else "torch.bfloat16"), (rank, r)
        assert r["shape"] == (B, 11) and r["lp_rel"] <= tol, (rank, r)
