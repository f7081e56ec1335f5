"""loss.head=fused_grad through policy_step on every layout, against loss.head=logits on one process.

The reference is the logits head, single process, padded rows. Every launch runs the same cases
with the fused_grad head (gradient computed in the forward, losses/token_grad.py) and must give
the same loss, metrics and post-step parameters: padded and packed on one process, TP 2 with
sequence parallelism (packed) and without (padded), PP 2, CP 2 (packed THD bins) and DP 2. One
case (sequence TIS with pi_old from the training forward) must fall back to the fused head, and
head/fused_grad_fallback says so.
A GPTModel with tied embeddings (TP 2, one microbatch normalised on its own) gets the same loss,
metrics and gradients from both heads.
"""
import pytest
import torch

from megatron_cispo.testing import spawn
from test_packed_step import _assert_matches, worker

CASES = {
    # name: (loss overrides, StepConfig kwargs)
    # two optimizer steps: pi_old from a forward-only pass (plain fused logprobs under fused_grad)
    "cispo_old_two_steps_seq_mean_token_mean": (
        {"cispo": {"anchor": "old"}, "loss_agg": "seq_mean_token_mean"}, {"minibatch_size": 4}),
    "cispo_rollout_token_mean": ({"cispo": {"anchor": "rollout"}}, {}),
    # one optimizer step: pi_old is the training forward's own detached lp
    "ppo_kl_k3_entropy_seq_mean_token_sum": (
        {"policy_loss": "ppo", "kl": {"coef": 0.2, "estimator": "k3"}, "entropy_coef": 0.05,
         "loss_agg": "seq_mean_token_sum"}, {}),
    "ppo_two_steps_kl_k2_entropy": (
        {"policy_loss": "ppo", "kl": {"coef": 0.2, "estimator": "k2"}, "entropy_coef": -0.05},
        {"minibatch_size": 4}),
    # reads the current policy's sequence total: falls back to the fused head
    "fallback_sequence_tis_old_from_forward": (
        {"cispo": {"anchor": "old"}, "tis": {"level": "sequence", "cap": 1.5}}, {}),
}
FALLBACK = {"fallback_sequence_tis_old_from_forward"}
FUSED_GRAD = {name: ({**loss, "head": "fused_grad"}, step) for name, (loss, step) in CASES.items()}
KEY = "head/fused_grad_fallback"


def run(layout: dict, packed: bool, table):
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("dp", 1)
    return spawn(worker, world, (layout, packed, tuple(table), False, table))


@pytest.fixture(scope="module")
def reference():
    return run({}, False, CASES)[0]


@pytest.mark.parametrize("layout, packed", [
    ({}, False), ({}, True), ({"tp": 2, "sp": True}, True), ({"tp": 2}, False), ({"pp": 2}, True),
    ({"cp": 2}, True), ({"dp": 2}, False),
], ids=["one_padded", "one_packed", "tp2_sp_packed", "tp2_padded", "pp2_packed", "cp2_packed", "dp2_padded"])
def test_fused_grad_step_matches_the_logits_head(reference, layout, packed):
    results = run(layout, packed, FUSED_GRAD)
    for res in results:
        for case, out in res.items():
            # 1 per microbatch that fell back, as a fraction of microbatches x DP x CP ranks
            assert out["metrics"].pop(KEY) == (1.0 if case in FALLBACK else 0.0), case
    _assert_matches(reference, results, CASES)


def tied_worker(tp: int):
    """A GPTModel with tied embeddings (GPTModel hands the fused head the embedding weight), one
    microbatch without the policy step's normalisation fields (compute_policy_loss's own
    aggregation): make_loss_func's loss and every parameter's gradient, per head."""
    from megatron.core.models.gpt import GPTModel

    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, transformer_config
    from megatron_cispo.runner.specs import layer_spec
    from megatron_cispo.base.weights import init_layout_independent
    from megatron_cispo.step import Microbatch
    from megatron_cispo.step.forward import forward_step_for, make_loss_func

    distributed.init_distributed(tp=tp)
    cfg = ModelConfig(vocab_size=32, seq_length=12, hidden_size=24, num_layers=1, num_attention_heads=4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (2, 12), generator=g)
    mask = torch.rand(2, 11, generator=g) > 0.2
    mb = Microbatch(input_ids=tokens[:, :-1], position_ids=torch.arange(11).expand(2, 11), targets=tokens[:, 1:],
                    loss_mask=mask, advantages=torch.randn(2, 11, generator=g),
                    rollout_logprobs=-3.5 + 0.3 * torch.randn(2, 11, generator=g))
    out = {}
    for head in ("logits", "fused_grad"):
        model = GPTModel(config=transformer_config(cfg, tp=tp, pp=1), transformer_layer_spec=layer_spec(cfg),
                         vocab_size=32, max_sequence_length=12, share_embeddings_and_output_weights=True,
                         parallel_output=True)
        init_layout_independent(model, seed=1, std=0.2)
        loss_cfg = from_dict(LossConfig, {"cispo": {"anchor": "rollout"}, "loss_agg": "seq_mean_token_mean",
                                          "entropy_coef": 0.1, "head": head})
        loss_func = make_loss_func(loss_cfg, vocab_size=32)
        output, loss = forward_step_for(loss_func, head=head)(iter([mb]), model)
        value, denominator, metrics = loss(output)
        value.backward()
        out[head] = {"loss": value.detach(), "denominator": denominator, "metrics": metrics.values(),
                     "output_dim": output.shape[-1],
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


def test_fused_grad_on_tied_embeddings_matches_the_logits_head():
    for res in spawn(tied_worker, 2, (2,)):
        want, got = res["logits"], res["fused_grad"]
        torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=1e-6)
        assert got["output_dim"] == 24 and want["output_dim"] == 16  # hidden states vs vocab / tp
        assert got["denominator"] == want["denominator"]
        assert got["metrics"].pop(KEY) == 0.0 and set(got["metrics"]) == set(want["metrics"])
        for key, value in want["metrics"].items():
            torch.testing.assert_close(got["metrics"][key], value, rtol=0, atol=1e-6, msg=key)
        assert "embedding.word_embeddings.weight" in got["grads"] and "output_layer.weight" not in got["grads"]
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
