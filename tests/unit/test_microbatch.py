"""make_loss_func / make_forward_step take a step.Microbatch, and (as before 0.1) a dict of its fields."""
import warnings

import pytest
import torch

from megatron_cispo.config import CispoConfig, LossConfig
from megatron_cispo.step import Microbatch, make_loss_func
from megatron_cispo.step.microbatch import as_microbatch


def _fields(b=2, s=5, v=7):
    g = torch.Generator().manual_seed(0)
    return dict(targets=torch.randint(0, v, (b, s), generator=g), loss_mask=torch.ones(b, s),
                advantages=torch.randn(b, s, generator=g), rollout_logprobs=-torch.rand(b, s, generator=g) - 1,
                seq_index=torch.arange(b)[:, None].expand(b, s), n_seqs=b), torch.randn(b, s, v, generator=g)


def test_a_dict_microbatch_gives_the_same_loss_and_gradient_as_a_microbatch():
    loss_func = make_loss_func(LossConfig(cispo=CispoConfig(anchor="rollout")))
    fields, logits = _fields()
    results = []
    for mb in (Microbatch(**fields), dict(fields)):
        x = logits.clone().requires_grad_()
        loss, tokens, _ = loss_func(mb, x)
        loss.backward()
        results.append((loss.detach(), int(tokens), x.grad))
    (l1, n1, g1), (l2, n2, g2) = results
    assert n1 == n2 == 10 and l1.item() != 0
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)


def test_a_dicts_own_keys_are_left_out_with_one_warning_and_another_type_is_refused():
    fields, _ = _fields()
    with pytest.warns(UserWarning, match=r"\['attention_mask', 'old_logprob'\] are not Microbatch fields"):
        mb = as_microbatch({**fields, "old_logprob": fields["advantages"], "attention_mask": None})
    assert mb.old_logprobs is None and mb.targets is fields["targets"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same keys again: no second warning
        as_microbatch({**fields, "old_logprob": fields["advantages"], "attention_mask": None})
    with pytest.raises(TypeError, match="must be a megatron_cispo.step.Microbatch"):
        as_microbatch([1, 2])


def test_the_global_normalisation_without_n_seqs_is_refused_naming_it():
    """With agg_weight the loss sums sequence quantities by seq_index over n_seqs slots; n_seqs left
    out (None, not given) is a clear error, not an index error deep in a scatter-add."""
    loss_func = make_loss_func(LossConfig(cispo=CispoConfig(anchor="rollout")))
    fields, logits = _fields()
    del fields["n_seqs"]
    b, s = fields["targets"].shape
    norm = dict(agg_weight=torch.full((b, s), 0.1), agg_share=torch.full((b, s), 0.1), loss_scale=1.0,
                num_tokens=torch.tensor(b * s))
    assert Microbatch(**fields).n_seqs is None
    with pytest.raises(ValueError, match=r"agg_weight needs seq_index and n_seqs .*n_seqs=None"):
        loss_func(Microbatch(**fields, **norm), logits)
    loss, tokens, _ = loss_func(Microbatch(**fields, **norm, n_seqs=b), logits)  # given: fine
    assert int(tokens) == b * s and torch.isfinite(loss)
