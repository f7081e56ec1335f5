"""step/head.py's Head: decided once from the loss config and passed down; its rules, and the FusedHead
forward_with_head builds under it (the matmul dtype decided there, once, for every scorer)."""
import pytest
import torch
from torch import nn

from megatron_cispo.config import LossConfig
from megatron_cispo.step.head import FusedHead, Head, forward_with_head, score_output


class _OutputLayer(nn.Module):
    """A ColumnParallelLinear's calling convention: (hidden, weight=None, runtime_gather_output=None)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.sequence_parallel = False

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden @ (self.weight if weight is None else weight).t(), None


class _Model(nn.Module):
    """GPTModel's shape contract without megatron: [b, s, h] in, output layer on [s, b, h], [b, s, v] out."""

    def __init__(self, weight):
        super().__init__()
        self.output_layer = _OutputLayer(weight)

    def forward(self, x, position_ids, attention_mask):
        return self.output_layer(x.transpose(0, 1))[0].transpose(0, 1)


def test_head_of_a_loss_config_and_its_rules():
    assert Head.of(LossConfig(head="fused_grad", head_fp32=True)) == Head("fused_grad", True)
    assert Head.of(LossConfig()) == Head() == Head.coerce("logits")
    assert Head("fused_grad", True).without_grad() == Head("fused", True)
    assert Head("fused").without_grad() == Head("fused") and Head("logits").without_grad() == Head("logits")
    assert (Head("fused").fused, Head("fused").grad, Head("fused_grad").grad, Head().fused) == (True, False, True, False)
    with pytest.raises(ValueError, match=r"^head: expected one of logits, fused, fused_grad, got 'fuse'$"):
        Head("fuse")
    with pytest.raises(ValueError, match=r"^head fp32: only a fused head runs its own matmul"):
        Head("logits", fp32=True)


@pytest.mark.parametrize("hidden_dtype,weight_dtype,fp32,want", [
    (torch.bfloat16, torch.bfloat16, False, None), (torch.bfloat16, torch.bfloat16, True, torch.float32),
    (torch.float32, torch.bfloat16, False, torch.float32)])  # Float16Module's fp32 hidden, bf16 weight
def test_forward_with_head_decides_the_fused_matmul_dtype_once(hidden_dtype, weight_dtype, fp32, want):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(11, 4, generator=g).to(weight_dtype)
    model = _Model(weight)
    x = torch.randn(2, 5, 4, generator=g).to(hidden_dtype)
    output, fused = forward_with_head(model, Head("fused", fp32), x, None, None)
    assert fused == FusedHead(model.output_layer.weight, False, want)
    assert output.shape == (2, 5, 4) and torch.equal(output, x)  # the hidden states, [b, s, h]
    assert "forward" not in vars(model.output_layer)  # the patch is taken back
    targets = torch.randint(0, 11, (2, 5), generator=g)
    lp = score_output(output, fused, targets, temperature=1.0)
    ref = torch.log_softmax((x.to(want or hidden_dtype) @ weight.to(want or hidden_dtype).t()).float(), -1)
    atol = 1e-5 if (want or hidden_dtype) == torch.float32 else 2e-2  # bf16 logits round
    torch.testing.assert_close(lp, ref.gather(-1, targets[..., None])[..., 0], rtol=0, atol=atol)


def test_the_logits_head_returns_the_models_own_output():
    weight = torch.randn(11, 4)
    x = torch.randn(2, 5, 4)
    output, fused = forward_with_head(_Model(weight), "logits", x, None, None)
    assert fused is None and torch.equal(output, x @ weight.t())
