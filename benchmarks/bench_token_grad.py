"""The per-chunk loss of loss.head=fused_grad (losses/token_grad.py): time of all of one
microbatch's coef_fn calls, whole-microbatch mode (the loss over [b, s] per chunk) against
chunk-local mode (the chunk's rows only); CISPO, b=1, 128-row chunks, one thread, CPU.

    python benchmarks/bench_token_grad.py 2048 8192 32768
Results: docs/benchmarks.md (bench_policy_step, the three loss heads).
"""
import sys
import time

import torch

from megatron_cispo.config import LossConfig, from_dict
from megatron_cispo.losses import token_weights
from megatron_cispo.losses.token_grad import chunk_coef_fn, microbatch_loss, rows_loss

ROWS = 128


def main(lengths):
    torch.set_num_threads(1)
    cfg = from_dict(LossConfig, {}, path="loss")
    for s in lengths:
        g = torch.Generator().manual_seed(0)
        lp = -torch.rand(1, s, generator=g) * 3
        mask = torch.ones(1, s, dtype=torch.bool)
        given = dict(advantages=torch.randn(1, generator=g), loss_mask=mask, ref_logprobs=None, keep=None,
                     old_logprobs=lp + 0.1 * torch.randn(1, s, generator=g),
                     rollout_logprobs=lp + 0.1 * torch.randn(1, s, generator=g))
        w, share, _ = token_weights(mask, cfg.loss_agg, cfg.max_len)

        def whole(lp_, ent):
            return microbatch_loss(cfg, lp_, given=dict(given, entropy=ent), agg_weight=w, agg_share=share,
                                   loss_scale=0.5)[0]

        def local(lp_, ent, pick):
            return rows_loss(cfg, lp_, ent, pick, given=given, agg_weight=w, loss_scale=0.5)
        rows = lp.t().reshape(-1)
        for name, fn in (("whole", chunk_coef_fn(whole, (1, s), device="cpu")),
                         ("local", chunk_coef_fn(local, (1, s), device="cpu", local=True))):
            t0 = time.perf_counter()
            with torch.no_grad():
                for r0 in range(0, s, ROWS):
                    fn(r0, min(s, r0 + ROWS), rows[r0:r0 + ROWS], None)
            print(f"s={s} {name}: {1e3 * (time.perf_counter() - t0):.1f} ms / microbatch ({-(-s // ROWS)} chunks)",
                  flush=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [2048, 8192, 32768])
