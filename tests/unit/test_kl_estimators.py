"""Which KL each kl.estimator's gradient follows, by exact enumeration (no sampling).

A policy pi_theta over a 4-token vocabulary, single tokens and two-token sequences. The expected
gradient E_{y~q}[grad(sum_t term_t)] of our per-token KL term (losses.common.kl_penalty) is
computed exactly as grad(sum_y q(y) sum_t term_t) with q held fixed, for q = pi (on-policy) and
q = pi_rollout != pi, and compared with the gradient of the KL it should follow, also exact.
docs/algorithm.md ("KL estimators") states the results these tests prove.
"""
from __future__ import annotations

import pytest
import torch

from megatron_cispo.config import KLConfig, LossConfig
from megatron_cispo.losses import compute_policy_loss, required_inputs
from megatron_cispo.losses.common import kl_penalty
from megatron_cispo.losses.metrics import Metrics

V = 4
F64 = torch.float64  # exact enough that "equal" means equal up to rounding


def _logits(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed), dtype=F64) * 1.3


def _term(estimator: str, is_weight: bool, lp: torch.Tensor, ref: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Our per-token KL term (kl.coef = 1) at every position of lp [n, s]."""
    cfg = KLConfig(coef=1.0, estimator=estimator, is_weight=is_weight)
    return kl_penalty(cfg, lp, ref, torch.ones_like(lp, dtype=torch.bool), Metrics(), rollout=q)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dimension, from log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def _grad(value: torch.Tensor, theta: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, theta)])


# ----------------------------------------------------------------------------- single tokens
class Token:
    """pi = softmax(theta), pi_ref and pi_rollout fixed; the V tokens are the V samples."""

    def __init__(self) -> None:
        self.theta = _logits(0).requires_grad_()
        self.ref = torch.log_softmax(_logits(1), -1)
        self.rollout = torch.log_softmax(_logits(2), -1)

    def pi(self) -> torch.Tensor:
        return torch.log_softmax(self.theta, -1)

    def expected_grad(self, estimator: str, is_weight: bool, on_policy: bool) -> torch.Tensor:
        lp = self.pi()
        q = lp.detach() if on_policy else self.rollout
        term = _term(estimator, is_weight, lp[None], self.ref[None], q[None])[0]
        return _grad((q.exp() * term).sum(), [self.theta])

    def grad_kl(self, reverse: bool) -> torch.Tensor:
        """reverse: grad KL(pi || pi_ref); else grad KL(pi_ref || pi)."""
        lp = self.pi()
        return _grad(_kl(lp, self.ref) if reverse else _kl(self.ref, lp), [self.theta])


@pytest.fixture
def tok() -> Token:
    return Token()


def test_on_policy_k1_gradient_is_zero_in_expectation(tok):
    torch.testing.assert_close(tok.expected_grad("k1", False, True), torch.zeros(V, dtype=F64), rtol=0, atol=1e-14)


def test_on_policy_k2_gradient_is_reverse_kl_and_k3_gradient_is_forward_kl(tok):
    reverse, forward = tok.grad_kl(reverse=True), tok.grad_kl(reverse=False)
    assert (reverse - forward).abs().max() > 0.1  # the two KLs' gradients differ here
    torch.testing.assert_close(tok.expected_grad("k2", False, True), reverse)
    torch.testing.assert_close(tok.expected_grad("k3", False, True), forward)


def test_off_policy_the_plain_estimators_follow_neither_kl(tok):
    reverse, forward = tok.grad_kl(reverse=True), tok.grad_kl(reverse=False)
    k1, k2, k3 = (tok.expected_grad(k, False, False) for k in ("k1", "k2", "k3"))
    assert k1.abs().max() > 0.05                     # no longer zero: E_rollout[grad log pi] != 0
    assert (k2 - reverse).abs().max() > 0.05 and (k3 - forward).abs().max() > 0.05
    # Exactly the on-policy gradients with each token reweighted by pi_rollout / pi (docs/algorithm.md).
    p = tok.pi().detach()
    d = tok.ref - p
    for got, coef in ((k1, torch.ones(V, dtype=F64)), (k2, -d), (k3, 1 - d.exp())):
        # E_pi[(pi_rollout / pi) * coef * grad log pi]
        torch.testing.assert_close(got, _grad((p.exp() * (tok.rollout - p).exp() * coef * tok.pi()).sum(),
                                              [tok.theta]))


@pytest.mark.parametrize("estimator", ["k3", "k1"])
@pytest.mark.parametrize("on_policy", [True, False])
def test_is_weight_gives_the_reverse_kl_gradient_on_and_off_policy(tok, estimator, on_policy):
    torch.testing.assert_close(tok.expected_grad(estimator, True, on_policy), tok.grad_kl(reverse=True))


@pytest.mark.parametrize("estimator", ["k3", "k1"])
def test_is_weight_value_is_unbiased_for_reverse_kl_off_policy_and_is_what_policy_kl_reports(tok, estimator):
    lp, q = tok.pi().detach(), tok.rollout
    m = Metrics()
    cfg = KLConfig(coef=1.0, estimator=estimator, is_weight=True)
    term = kl_penalty(cfg, lp[None], tok.ref[None], torch.ones(1, V, dtype=torch.bool), m, rollout=q[None])[0]
    torch.testing.assert_close((q.exp() * term).sum(), _kl(lp, tok.ref))
    torch.testing.assert_close(m.values()["policy/kl"], term.mean().float())
    plain = kl_penalty(KLConfig(coef=1.0, estimator=estimator), lp[None], tok.ref[None],
                       torch.ones(1, V, dtype=torch.bool), Metrics())[0]
    assert abs((q.exp() * plain).sum() - _kl(lp, tok.ref)) > 0.05  # without the weight it is biased


def test_is_weight_without_rollout_logprobs_is_an_error_and_k2_is_refused():
    lp = torch.log_softmax(_logits(0), -1)[None]
    with pytest.raises(ValueError, match=r"^kl\.is_weight=True needs rollout_logprobs"):
        kl_penalty(KLConfig(coef=1.0, is_weight=True), lp, lp, torch.ones_like(lp, dtype=torch.bool), Metrics())
    with pytest.raises(ValueError, match=r"^KLConfig\.is_weight=True needs estimator 'k3' or 'k1'"):
        KLConfig(is_weight=True, estimator="k2")


# ----------------------------------------------------------------------------- two-token sequences
class Seq:
    """pi(y1) = softmax(theta1), pi(y2 | y1) = softmax(theta2[y1]); pi_ref and pi_rollout fixed."""

    def __init__(self) -> None:
        self.theta = [_logits(10).requires_grad_(), _logits(11, V).requires_grad_()]
        self.ref = [torch.log_softmax(_logits(12), -1), torch.log_softmax(_logits(13, V), -1)]
        self.rollout = [torch.log_softmax(_logits(14), -1), torch.log_softmax(_logits(15, V), -1)]
        y1, y2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
        self.y1, self.y2 = y1.reshape(-1), y2.reshape(-1)  # all V^2 sequences

    def pi(self) -> list[torch.Tensor]:
        return [torch.log_softmax(t, -1) for t in self.theta]

    def per_token(self, logs: list[torch.Tensor]) -> torch.Tensor:
        """[V^2, 2]: log p(y1), log p(y2 | y1) of every sequence."""
        return torch.stack([logs[0][self.y1], logs[1][self.y1, self.y2]], -1)

    def expected_grad(self, estimator: str, is_weight: bool, on_policy: bool) -> torch.Tensor:
        lp = self.per_token(self.pi())
        q = lp.detach() if on_policy else self.per_token(self.rollout)
        term = _term(estimator, is_weight, lp, self.per_token(self.ref), q)
        return _grad((q.sum(-1).exp() * term.sum(-1)).sum(), self.theta)

    def grad_sequence_kl(self) -> torch.Tensor:
        """grad KL(pi || pi_ref) over whole sequences: the prefix's distribution is differentiated too."""
        lp, ref = self.per_token(self.pi()).sum(-1), self.per_token(self.ref).sum(-1)
        return _grad((lp.exp() * (lp - ref)).sum(), self.theta)

    def grad_token_kls(self, reverse: bool, contexts: list[torch.Tensor]) -> torch.Tensor:
        """sum_t E_{y<t ~ contexts}[grad KL_t], each token's conditional KL with its context fixed."""
        pi = self.pi()
        kl = (lambda p, r: _kl(p, r)) if reverse else (lambda p, r: _kl(r, p))
        c1 = contexts[0].exp().detach()
        return _grad(kl(pi[0], self.ref[0]) + (c1 * kl(pi[1], self.ref[1])).sum(), self.theta)


@pytest.fixture
def seq() -> Seq:
    return Seq()


def test_on_policy_k2_is_the_sum_of_per_token_conditional_kl_gradients_not_the_sequence_kl(seq):
    got = seq.expected_grad("k2", False, True)
    torch.testing.assert_close(got, seq.grad_token_kls(True, seq.pi()))
    assert (got - seq.grad_sequence_kl()).abs().max() > 0.02  # the prefix's score-function term is missing


def test_on_policy_k3_is_the_per_token_forward_kl_gradient_and_k1_is_zero(seq):
    torch.testing.assert_close(seq.expected_grad("k3", False, True), seq.grad_token_kls(False, seq.pi()))
    torch.testing.assert_close(seq.expected_grad("k1", False, True), torch.zeros(V + V * V, dtype=F64), rtol=0, atol=1e-14)


@pytest.mark.parametrize("estimator", ["k3", "k1"])
def test_off_policy_is_weight_corrects_each_token_but_contexts_stay_the_samplers(seq, estimator):
    got = seq.expected_grad(estimator, True, False)
    # The per-token conditional reverse KLs, with each prefix distributed as pi_rollout samples it.
    torch.testing.assert_close(got, seq.grad_token_kls(True, seq.rollout))
    assert (got - seq.grad_token_kls(True, seq.pi())).abs().max() > 0.02
    # On-policy the same option gives exactly the on-policy k2 gradient (contexts from pi).
    torch.testing.assert_close(seq.expected_grad(estimator, True, True), seq.expected_grad("k2", False, True))

def test_compute_policy_loss_applies_the_is_weight_and_drops_a_nonfinite_sampler_logprob():
    cfg = LossConfig(kl=KLConfig(coef=0.1, estimator="k3", is_weight=True))
    assert "rollout_logprobs" in required_inputs(cfg)
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 5, generator=g) - 0.1
    old, ref = lp + 0.1 * torch.randn(2, 5, generator=g), lp + 0.3 * torch.randn(2, 5, generator=g)
    rollout = (lp + 0.2 * torch.randn(2, 5, generator=g)).index_put((torch.tensor([0]), torch.tensor([1])),
                                                                    torch.tensor(-float("inf")))
    mask, adv = torch.ones(2, 5, dtype=torch.bool), torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match=r"^kl\.is_weight=True needs rollout_logprobs"):
        compute_policy_loss(cfg, lp, advantages=adv, loss_mask=mask, old_logprobs=old, ref_logprobs=ref)
    a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    out = compute_policy_loss(cfg, a, advantages=adv, loss_mask=mask, old_logprobs=old, rollout_logprobs=rollout,
                              ref_logprobs=ref)
    out.loss.backward()
    assert out.metrics.values()["policy/nonfinite_dropped"] == 1
    valid = torch.isfinite(rollout)
    w = (b - torch.where(valid, rollout, 0.0)).exp()
    k3 = (ref - b).exp() - (ref - b) - 1
    pg = -(old.sub(b).neg().detach().exp().clamp(0.0, 5.0) * adv[:, None]) * b  # CISPO on the old anchor
    (torch.where(valid, pg + 0.1 * w * k3, 0.0).sum() / valid.sum()).backward()
    torch.testing.assert_close(a.grad, b.grad)
