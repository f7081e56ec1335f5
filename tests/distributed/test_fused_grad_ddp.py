"""fused_grad_logprobs under megatron-core's DistributedDataParallel (dp 2, gloo): the output
weight's main_grad after backward and the gradient sync equals the logits head's, with
overlap_grad_reduce on and off, for a weight that is also the input embedding (tied): fused_grad
adds its fp32 sum into main_grad and hands DDP's hook a zero grad, so the hook still fires (and
with overlap starts the bucket's reduce) and the embedding's part is not dropped."""
import torch

from megatron_cispo.testing import spawn

S, B, H, V = 5, 2, 16, 40


def _worker(overlap: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_cispo.fused_grad import fused_grad_logprobs
    from megatron_cispo.runner import distributed

    env = distributed.init_distributed()
    g = torch.Generator().manual_seed(7 + env.rank)  # each DP rank its own data
    ids = torch.randint(0, V, (S, B), generator=g)
    targets = torch.randint(0, V, (S, B), generator=g)
    adv = torch.randn(S, B, generator=g)

    class Head(torch.nn.Module):  # a tied embedding / output weight
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(V, H, generator=torch.Generator().manual_seed(3)) / 4)

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, calculate_per_token_loss=True)
    ddp = DistributedDataParallel(config=cfg, module=Head(), ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, average_in_collective=False))
    weight = ddp.module.weight
    out = {}
    for head in ("logits", "fused_grad"):
        ddp.zero_grad_buffer()
        hidden = torch.nn.functional.embedding(ids, weight) * 1.5  # the weight's other use
        if head == "logits":
            lp = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, targets[..., None]).squeeze(-1)
            loss = (-adv * lp).sum()
        else:
            lp, _, z = fused_grad_logprobs(hidden, weight, targets, lambda r0, r1, lp, ent: (
                -adv.reshape(-1)[r0:r1], None), chunk_rows=3)
            loss = (-adv * lp).sum() + z
        loss.backward()
        ddp.finish_grad_sync()
        out[head] = weight.main_grad.clone()
    return out


def test_main_grad_equals_the_logits_heads_with_and_without_overlapped_reduce():
    for overlap in (False, True):
        res = spawn(_worker, 2, (overlap,))
        for r in res:
            assert r["logits"].abs().max() > 0
            torch.testing.assert_close(r["fused_grad"], r["logits"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res[0]["fused_grad"], res[1]["fused_grad"], rtol=0, atol=0)  # reduced
