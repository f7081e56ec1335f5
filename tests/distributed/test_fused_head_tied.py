"""The fused head on a GPTModel with tied input/output embeddings: the output layer is bypassed
and the embedding weight GPTModel hands it is used, with the same logprobs and gradients as the
logits head (TP=2, so the weight is a vocabulary shard). From megatron-core 0.18 the bypass is
GPTModel.forward's output_processor, and the output layer is left alone; before, its forward is
patched for the one call."""
import pytest
import torch

from megatron_cispo.testing import spawn


def _has_output_processor_by_version() -> bool:
    """What the release notes say (PR #4686, in 0.18), read independently of the head's probe."""
    import megatron.core.package_info as info

    return tuple(int(p) for p in info.__version__.split(".")[:2]) >= (0, 18)


def tied_worker(tp: int):
    from megatron.core.models.gpt import GPTModel

    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, transformer_config
    from megatron_cispo.runner.specs import layer_spec
    from megatron_cispo.base.weights import init_layout_independent
    from megatron_cispo.step import head as head_module
    from megatron_cispo.step import Microbatch
    from megatron_cispo.step.forward import forward_step_for
    from megatron_cispo.step.head import head_logprobs

    distributed.init_distributed(tp=tp)
    cfg = ModelConfig(vocab_size=32, seq_length=12, hidden_size=24, num_layers=1, num_attention_heads=4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (2, 12), generator=g)
    mb = Microbatch(input_ids=tokens[:, :-1], position_ids=torch.arange(11).expand(2, 11), targets=tokens[:, 1:],
                    loss_mask=torch.ones(2, 11, dtype=torch.bool), advantages=torch.zeros(2, 11))
    probe = head_module.takes_output_processor
    # "fused_patch": the same tier forced onto the layer.forward patch, where output_processor exists
    heads = ("logits", "fused") + (("fused_patch",) if probe(GPTModel) else ())
    out = {}
    for head in heads:
        model = GPTModel(config=transformer_config(cfg, tp=tp, pp=1), transformer_layer_spec=layer_spec(cfg),
                         vocab_size=32, max_sequence_length=12, share_embeddings_and_output_weights=True,
                         parallel_output=True)
        init_layout_independent(model, seed=1, std=0.2)
        seen = {"layer_calls": 0}
        layer = model.output_layer
        layer.register_forward_pre_hook(lambda *_: seen.update(layer_calls=seen["layer_calls"] + 1))
        model.decoder.register_forward_hook(lambda *_: seen.update(patched="forward" in vars(layer)))
        model.register_forward_pre_hook(lambda m, a, kw: seen.update(processor="output_processor" in kw),
                                        with_kwargs=True)

        def loss_func(batch, output):
            seen["fused"] = batch.fused is not None
            lp = head_logprobs(batch, output, temperature=1.0, vocab_size=32, entropy=False)
            return lp, None

        if head == "fused_patch":
            head_module.takes_output_processor = lambda _: False
        try:
            output, loss = forward_step_for(loss_func, head=head.split("_")[0])(iter([mb]), model)
        finally:
            head_module.takes_output_processor = probe
        lp, _ = loss(output)
        (lp * torch.linspace(-1, 1, 11)).sum().backward()
        emb = model.embedding.word_embeddings.weight
        out[head] = {"lp": lp.detach(), "grad": emb.grad.clone(), "fused": seen["fused"],
                     "output_dim": output.shape[-1], "probe": probe(GPTModel), "processor": seen["processor"],
                     "layer_calls": seen["layer_calls"], "patched": seen["patched"],
                     "restored": "forward" not in vars(layer)}
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(tied_worker, 2, (2,))


def test_fused_head_uses_the_tied_embedding_and_matches_the_logits_head(results):
    for res in results:
        assert res["fused"]["fused"] and not res["logits"]["fused"]
        assert res["fused"]["output_dim"] == 24 and res["logits"]["output_dim"] == 16  # hidden vs vocab/tp
        torch.testing.assert_close(res["fused"]["lp"], res["logits"]["lp"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["fused"]["grad"], res["logits"]["grad"], rtol=1e-5, atol=1e-6)


def test_fused_head_path_on_this_tier(results):
    new = _has_output_processor_by_version()
    for res in results:
        fused, logits = res["fused"], res["logits"]
        assert fused["probe"] == new
        # 0.18+: GPTModel gets output_processor, never calls the output layer, whose forward is
        # never replaced; before: no output_processor, the patched layer runs once, then is restored.
        assert (fused["processor"], fused["layer_calls"], fused["patched"]) == ((True, 0, False) if new
                                                                               else (False, 1, True))
        assert fused["restored"] and logits["restored"]
        assert (logits["processor"], logits["layer_calls"], logits["patched"]) == (False, 1, False)
        if new:  # both mechanisms on one tier: the same numbers, bit for bit
            patch = res["fused_patch"]
            assert (patch["processor"], patch["layer_calls"], patch["patched"]) == (False, 1, True)
            assert torch.equal(patch["lp"], fused["lp"]) and torch.equal(patch["grad"], fused["grad"])
