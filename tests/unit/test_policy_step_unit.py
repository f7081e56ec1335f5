"""Single-process checks of the policy-step pieces: the pi_old plan, input validation, reports."""
import types

import pytest
import torch

from megatron_cispo.config import LossConfig, from_dict
from megatron_cispo.step import Rollouts, StepConfig, check_megatron_config, plan_old_logprobs
from megatron_cispo.losses import Metrics
from megatron_cispo.step import reduce_metrics


def cfg(**over):
    return from_dict(LossConfig, over)


@pytest.mark.parametrize("loss,steps,have_old,expect", [
    ({"cispo": {"anchor": "rollout"}}, 4, False, "unused"),  # the rollout anchor never reads pi_old
    ({"cispo": {"anchor": "rollout"}}, 1, False, "unused"),
    ({"cispo": {"anchor": "old"}}, 1, False, "from_training_forward"),  # pi_old == pi_theta
    ({"cispo": {"anchor": "old"}}, 2, False, "pass"),
    ({"cispo": {"anchor": "old"}}, 2, True, "given"),
    ({"policy_loss": "ppo"}, 1, False, "from_training_forward"),
    ({"policy_loss": "ppo"}, 3, False, "pass"),
    ({"policy_loss": "rollout_is"}, 3, False, "unused"),
    # TIS multiplies by pi_old / pi_rollout, so the old anchor with TIS needs pi_old
    ({"cispo": {"anchor": "old"}, "tis": {"level": "token"}}, 3, False, "pass"),
])
def test_old_logprob_plan_consults_the_anchor(loss, steps, have_old, expect):
    assert plan_old_logprobs(cfg(**loss), StepConfig(), optimizer_steps=steps, have_old=have_old) == expect


def test_old_logprob_pass_can_be_forced():
    plan = plan_old_logprobs(cfg(), StepConfig(old_logprob_pass="always"), optimizer_steps=1, have_old=False)
    assert plan == "pass"


def _fake_chunk(per_token=True, average_in_collective=False, finalize=True, fp16=False, overlap=False):
    config = types.SimpleNamespace(calculate_per_token_loss=per_token, fp16=fp16, grad_scale_func=None,
                                   no_sync_func=None, finalize_model_grads_func=print if finalize else None)
    return types.SimpleNamespace(config=config, ddp_config=types.SimpleNamespace(
        average_in_collective=average_in_collective, overlap_grad_reduce=overlap))


@pytest.mark.parametrize("kw, message", [
    (dict(finalize=False), "no finalize_model_grads_func: .*skip the data-parallel gradient all-reduce"),
    (dict(fp16=True), "fp16 training needs the model config's grad_scale_func"),
    (dict(overlap=True), "overlap_grad_reduce=True needs the model config's no_sync_func"),
])
def test_a_missing_training_loop_hook_fails_and_says_how_to_set_it(kw, message):
    with pytest.raises(ValueError, match=message + ".*set_megatron_hooks"):
        check_megatron_config([_fake_chunk(**kw)])


def test_set_megatron_hooks_sets_what_megatron_lms_train_sets():
    from megatron.core.distributed import finalize_model_grads

    from megatron_cispo.step import set_megatron_hooks

    chunk = _fake_chunk(finalize=False, fp16=True, overlap=True)
    chunk.no_sync = object()
    set_megatron_hooks([chunk], types.SimpleNamespace(scale_loss=abs))
    assert chunk.config.finalize_model_grads_func is finalize_model_grads
    assert chunk.config.grad_scale_func is abs and chunk.config.no_sync_func is chunk.no_sync
    check_megatron_config([chunk])


def test_check_megatron_config_requires_per_token_loss():
    with pytest.raises(ValueError, match=r"calculate_per_token_loss=True \(got False\)"):
        check_megatron_config([_fake_chunk(per_token=False)])


def test_check_megatron_config_rejects_averaging_in_the_collective():
    with pytest.raises(ValueError, match=r"average_in_collective=False \(got True\)"):
        check_megatron_config([_fake_chunk(average_in_collective=True)])
    check_megatron_config([_fake_chunk()])  # the valid contract passes


def test_rollouts_validate_shapes_naming_both():
    tokens = torch.zeros(4, 9, dtype=torch.long)
    with pytest.raises(ValueError, match=r"rollouts.loss_mask has shape \(4, 9\); expected \[n, s\] = \(4, 8\)"):
        Rollouts(tokens=tokens, loss_mask=torch.ones(4, 9, dtype=torch.bool), advantages=torch.zeros(4))
    with pytest.raises(ValueError, match=r"rollouts.advantages has shape \(3,\)"):
        Rollouts(tokens=tokens, loss_mask=torch.ones(4, 8, dtype=torch.bool), advantages=torch.zeros(3))
    with pytest.raises(ValueError, match=r"rollouts.tokens must be an int"):
        Rollouts(tokens=tokens.float(), loss_mask=torch.ones(4, 8, dtype=torch.bool), advantages=torch.zeros(4))


def test_dp_shard_keeps_each_minibatch_made_of_the_same_global_sequences():
    n = 8
    batch = Rollouts(tokens=torch.arange(n)[:, None].repeat(1, 3), loss_mask=torch.ones(n, 2, dtype=torch.bool),
                     advantages=torch.arange(n).float())
    r0 = batch.dp_shard(dp_rank=0, dp=2, minibatches=2)
    r1 = batch.dp_shard(dp_rank=1, dp=2, minibatches=2)
    # minibatch 0 = global sequences 0..3, split over the two ranks; minibatch 1 = 4..7
    assert r0.advantages.tolist() == [0, 1, 4, 5]
    assert r1.advantages.tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="does not split into 3 minibatches over dp=2"):
        batch.dp_shard(dp_rank=0, dp=2, minibatches=3)


@pytest.mark.parametrize("kw,msg", [
    ({"micro_batch_size": 0}, "micro_batch_size must be >= 1, got 0"),
    ({"epochs": 0}, "epochs must be >= 1, got 0"),
    ({"minibatch_size": 0}, "minibatch_size must be >= 1 or None, got 0"),
    ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
    ({"old_logprob_pass": "never"}, "old_logprob_pass must be 'auto' or 'always', got 'never'"),
])
def test_step_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        StepConfig(**kw)


def _metrics(s, c, lo, hi, tokens) -> Metrics:
    return Metrics(sums={"r": (torch.tensor(s), torch.tensor(c))}, mins={"r_min": torch.tensor(lo)},
                   maxs={"r_max": torch.tensor(hi)}, totals={"tokens": torch.tensor(tokens)})


def test_microbatch_metrics_sum_means_and_keep_min_max_exact():
    a, b = _metrics(3.0, 2.0, 0.5, 2.0, 2.0), _metrics(1.0, 1.0, 0.25, 1.5, 2.0)
    merged = Metrics.merge([a, b])
    assert [merged.sums["r"][0].item(), merged.sums["r"][1].item()] == [4.0, 3.0]
    out = reduce_metrics([a, b])
    # the mean of means would be (1.5 + 1.0) / 2 = 1.25; the exact token mean is 4 / 3
    assert out == {"r": pytest.approx(4 / 3, abs=1e-12), "r_min": 0.25, "r_max": 2.0, "tokens": 4.0}
    assert a.sums["r"][0].item() == 3.0 and a.totals["tokens"].item() == 2.0  # inputs untouched


def test_loss_config_sections_must_be_section_dataclasses():
    with pytest.raises(ValueError, match=r"LossConfig.cispo must be a CispoConfig, got dict"):
        LossConfig(cispo={"anchor": "rollout"})


def test_registry_check_rejects_a_plugin_loss_anchored_on_rollout_with_tis(monkeypatch):
    from megatron_cispo.losses import check_loss_config, registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @registry.register_policy_loss("test_rollout_plugin", anchor="rollout")
    def _plugin(cfg, x):  # pragma: no cover - only its anchor matters here
        raise AssertionError

    cfg = from_dict(LossConfig, {"policy_loss": "test_rollout_plugin", "tis": {"level": "token"}})
    with pytest.raises(ValueError, match="policy_loss='test_rollout_plugin' cannot be combined with "
                                         "tis.level='token': the loss anchors on rollout_logprobs"):
        check_loss_config(cfg)
    check_loss_config(from_dict(LossConfig, {"policy_loss": "test_rollout_plugin"}))


class _GuardedCollectives:
    """Stands in for torch.distributed in step.reduce: a 2-rank group whose all_reduce refuses a
    tensor that is not on the metrics' device (NCCL rejects CPU tensors; gloo would not notice)."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, device):
        self.device, self.calls = torch.device(device), []

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return 2

    def all_reduce(self, t, op=None, group=None):
        assert t.device == self.device, f"a {t.device} tensor reached a collective; the metrics are on {self.device}"
        assert t.numel() > 0, "an empty tensor reached a collective"
        self.calls.append((op, t.dtype, t.numel()))


def test_metric_reduction_builds_every_buffer_on_the_metrics_device(monkeypatch):
    from megatron_cispo.losses import compute_policy_loss
    from megatron_cispo.step import reduce as step_reduce

    # "meta" stands in for cuda: a buffer built without the data's device lands on CPU and is caught.
    lp = torch.zeros(2, 3, device="meta")
    out = compute_policy_loss(LossConfig(), lp, advantages=torch.ones(2, device="meta"),
                              loss_mask=torch.ones(2, 3, device="meta"), old_logprobs=lp)
    guard = _GuardedCollectives("meta")
    monkeypatch.setattr(step_reduce, "dist", guard)
    sums, extremes = step_reduce.reduced_parts(Metrics.merge([out.metrics, out.metrics]), group=object())
    assert sums.device.type == extremes.device.type == "meta"
    assert [op for op, *_ in guard.calls] == [torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX]


def test_a_loss_with_no_metric_of_a_kind_issues_no_collective_for_it(monkeypatch):
    from megatron_cispo.step import reduce as step_reduce

    guard = _GuardedCollectives("cpu")
    monkeypatch.setattr(step_reduce, "dist", guard)
    only_sums = Metrics(sums={"r": (torch.tensor(3.0), torch.tensor(2.0))})
    assert reduce_metrics([only_sums], group=object()) == {"r": 1.5}
    assert [op for op, *_ in guard.calls] == [torch.distributed.ReduceOp.SUM]  # no empty MIN/MAX buffer
    guard.calls.clear()
    assert reduce_metrics([Metrics()], group=object()) == {}  # e.g. a plugin loss's empty Metrics()
    assert guard.calls == []


def test_the_fused_head_finds_the_output_layer_through_ddp_and_float16_module():
    from megatron_cispo.step.head import output_layer_of, unwrap

    class Float16Module(torch.nn.Module):  # megatron's name is what the head checks
        def __init__(self, module):
            super().__init__()
            self.module = module

    gpt = torch.nn.Module()
    gpt.output_layer = torch.nn.Linear(2, 3)
    ddp = torch.nn.Module()
    ddp.module = Float16Module(gpt)
    assert unwrap(ddp) == (gpt, True) and unwrap(gpt) == (gpt, False)
    assert output_layer_of(ddp) is gpt.output_layer and output_layer_of(torch.nn.Module()) is None


def _checks_per_policy_step():
    """Host-syncing Rollouts checks (__post_init__ runs them) during one policy_step of 2
    minibatches with a pi_old pass, on a batch with lengths, a float mask and kept sets."""
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.step import policy_step

    distributed.init_distributed()
    chunks = build_model(ModelConfig(vocab_size=8, seq_length=6, hidden_size=8, num_layers=1,
                                     num_attention_heads=2), tp=1, pp=1, seed=0)
    n, s = 4, 5
    tokens = torch.arange(n * (s + 1)).view(n, s + 1) % 8
    offsets = torch.arange(n * s + 1)  # every position keeps its target only
    ids = tokens[:, 1:].reshape(-1)
    batch = Rollouts(tokens=tokens, loss_mask=torch.ones(n, s), advantages=torch.randn(n),
                     lengths=torch.full((n,), s + 1), rollout_logprobs=torch.zeros(n, s), keep_ids=ids,
                     keep_offsets=offsets)
    calls = []
    original = Rollouts.__post_init__
    Rollouts.__post_init__ = lambda self: (calls.append(1), original(self))[1]
    try:
        policy_step(chunks, build_optimizer(chunks, lr=1e-3), batch, LossConfig(),
                    StepConfig(micro_batch_size=1, minibatch_size=2, old_logprob_pass="always"))
        shard = batch.dp_shard(dp_rank=1, dp=2)
        replaced = shard.replace(old_logprobs=torch.zeros(2, s))
        refused = None
        try:  # a changed mask is checked again
            shard.replace(loss_mask=torch.full((2, s), 0.5))
        except ValueError as e:
            refused = str(e)
    finally:
        Rollouts.__post_init__ = original
    return len(calls), replaced.old_logprobs.shape, refused


def test_rollouts_derived_from_a_checked_batch_are_not_checked_again():
    from megatron_cispo.testing import spawn

    checks, shape, refused = spawn(_checks_per_policy_step, 1, timeout_s=240)[0]
    assert checks == 1  # policy_step, dp_shard and replace(old_logprobs=) check nothing; replace(loss_mask=) does
    assert shape == (2, 5) and refused.startswith("rollouts.loss_mask must be bool or hold only 0 and 1")
