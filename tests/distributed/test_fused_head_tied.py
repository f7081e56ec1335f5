"""The fused head on a GPTModel with tied input/output embeddings: the output layer is bypassed
and the embedding weight GPTModel hands it is used, with the same logprobs and gradients as the
logits head (TP=2, so the weight is a vocabulary shard)."""
import torch

from megatron_cispo.testing import spawn


def tied_worker(tp: int):
    from megatron.core.models.gpt import GPTModel

    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, transformer_config
    from megatron_cispo.runner.specs import layer_spec
    from megatron_cispo.runner.weights import init_layout_independent
    from megatron_cispo.step.head import head_logprobs
    from megatron_cispo.step import Microbatch
    from megatron_cispo.step.forward import forward_step_for

    distributed.init_distributed(tp=tp)
    cfg = ModelConfig(vocab_size=32, seq_length=12, hidden_size=24, num_layers=1, num_attention_heads=4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (2, 12), generator=g)
    mb = Microbatch(input_ids=tokens[:, :-1], position_ids=torch.arange(11).expand(2, 11), targets=tokens[:, 1:],
                    loss_mask=torch.ones(2, 11, dtype=torch.bool), advantages=torch.zeros(2, 11))
    out = {}
    for head in ("logits", "fused"):
        model = GPTModel(config=transformer_config(cfg, tp=tp, pp=1), transformer_layer_spec=layer_spec(cfg),
                         vocab_size=32, max_sequence_length=12, share_embeddings_and_output_weights=True,
                         parallel_output=True)
        init_layout_independent(model, seed=1, std=0.2)
        seen = {}

        def loss_func(batch, output):
            seen["fused"] = batch.fused is not None
            lp = head_logprobs(batch, output, temperature=1.0, vocab_size=32, entropy=False)
            return lp, None

        output, loss = forward_step_for(loss_func, head=head)(iter([mb]), model)
        lp, _ = loss(output)
        (lp * torch.linspace(-1, 1, 11)).sum().backward()
        emb = model.embedding.word_embeddings.weight
        out[head] = {"lp": lp.detach(), "grad": emb.grad.clone(), "fused": seen["fused"],
                     "output_dim": output.shape[-1]}
    return out


def test_fused_head_uses_the_tied_embedding_and_matches_the_logits_head():
    for res in spawn(tied_worker, 2, (2,)):
        assert res["fused"]["fused"] and not res["logits"]["fused"]
        assert res["fused"]["output_dim"] == 24 and res["logits"]["output_dim"] == 16  # hidden vs vocab/tp
        torch.testing.assert_close(res["fused"]["lp"], res["logits"]["lp"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["fused"]["grad"], res["logits"]["grad"], rtol=1e-5, atol=1e-6)
