"""Every value the reliability issue found passing `--check` and then crashing or training on
garbage gives one line naming the key path and the allowed range: at the CLI (exit 2), in the
config dataclasses built directly, and in the Rollouts a policy step consumes."""
import math

import pytest
import torch

from megatron_cispo.config import CispoConfig, KLConfig, LossConfig, PPOConfig, TISConfig
from megatron_cispo.logprobs import token_logprobs
from megatron_cispo.runner.experiment import ExperimentConfig, OptimizerConfig, ParallelConfig, RolloutConfig, \
    RunConfig
from megatron_cispo.runner.model import ModelConfig
from megatron_cispo.step import Rollouts, StepConfig
from megatron_cispo.testing import spawn
from megatron_cispo.train import EXIT_CONFIG, main

CONFIG = "yaml_configs/demo_cpu.yaml"


@pytest.mark.parametrize("args,message", [
    (["optimizer.adam_beta1=5"], r"optimizer.adam_beta1 must be in [0, 1), got 5.0"),
    (["optimizer.adam_beta1=-0.1"], r"optimizer.adam_beta1 must be in [0, 1), got -0.1"),
    (["optimizer.adam_beta2=1"], r"optimizer.adam_beta2 must be in [0, 1), got 1.0"),
    (["optimizer.weight_decay=-1"], "optimizer.weight_decay must be >= 0, got -1.0"),
    (["rollout.temperature=.inf"], "rollout.temperature must be finite and > 0, got inf"),
    (["--world-size", "-2"], "--world-size must be an int >= 1 (the number of processes), got '-2'"),
    (["--world-size", "0"], "--world-size must be an int >= 1 (the number of processes), got '0'"),
    (["loss.max_len=2.5"], "loss.max_len: expected int | None, got float 2.5"),
    (["rollout.digits=2.5"], "rollout.digits: expected int, got float 2.5"),
    (["run.steps=3.0"], "run.steps: expected int, got float 3.0"),
    (["run.resume='true'"], "run.resume: expected bool, got str 'true'"),
    (["loss.cispo.token_mask='false'"], "loss.cispo.token_mask: expected bool, got str 'false'"),
    (["loss.cispo.eps_low='0.2'"], "loss.cispo.eps_low: expected float, got str '0.2'"),
    (["parallelism.sequence_parallel=1"], "parallelism.sequence_parallel: expected bool, got int 1"),
    (["run.name=[1"], "run.name: '[1' is not a valid YAML value (expected ',' or ']', but got '<stream end>'); "
                      "to pass it as a string, quote it: '\"[1\"'"),
])
def test_a_bad_value_fails_check_with_one_line_naming_its_key_and_range(args, message, capsys):
    assert main(["--check", CONFIG, "--world-size", "2", *args]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith(f"config error in {CONFIG}: ") and err.count("\n") == 1 and message in err, err


def test_a_world_size_from_the_environment_that_is_not_an_int_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert main(["--check", CONFIG]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WORLD_SIZE must be an int >= 1 (the number of processes), got 'abc'" in err


def test_a_bad_value_fails_at_start_too_before_anything_runs(tmp_path, capsys):
    args = [CONFIG, "optimizer.adam_beta1=5", f"run.run_dir={tmp_path / 'run'}", "run.steps=1"]
    assert main(args) == EXIT_CONFIG
    assert "optimizer.adam_beta1 must be in [0, 1), got 5.0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("make,message", [
    # a str is not a bool: "false" used to switch the mask on
    (lambda: CispoConfig(token_mask="false"), "CispoConfig.token_mask: expected bool, got str 'false'"),
    (lambda: CispoConfig(eps_low="0.2"), "CispoConfig.eps_low: expected float, got str '0.2'"),
    (lambda: CispoConfig(eps_high=True), "CispoConfig.eps_high: expected float, got bool True"),
    (lambda: PPOConfig(dual_clip="3"), r"PPOConfig.dual_clip: expected float | None, got str '3'"),
    (lambda: TISConfig(cap=None), "TISConfig.cap: expected float, got NoneType None"),
    (lambda: KLConfig(coef=math.inf), "KLConfig.coef must be finite and >= 0, got inf"),
    (lambda: LossConfig(max_len=2.5), "LossConfig.max_len: expected int | None, got float 2.5"),
    (lambda: LossConfig(max_len=True), "LossConfig.max_len: expected int | None, got bool True"),
    (lambda: LossConfig(head_fp32=1), "LossConfig.head_fp32: expected bool, got int 1"),
    (lambda: LossConfig(kl={"coef": 0.1}), "LossConfig.kl must be a KLConfig, got dict; write KLConfig(...)"),
    (lambda: OptimizerConfig(adam_beta1=5.0), r"optimizer.adam_beta1 must be in [0, 1), got 5.0"),
    (lambda: OptimizerConfig(adam_beta2=1.0), r"optimizer.adam_beta2 must be in [0, 1), got 1.0"),
    (lambda: OptimizerConfig(weight_decay=-1.0), "optimizer.weight_decay must be >= 0, got -1.0"),
    (lambda: OptimizerConfig(warmup_steps=2.5), "OptimizerConfig.warmup_steps: expected int, got float 2.5"),
    (lambda: RolloutConfig(temperature=math.inf), "rollout.temperature must be finite and > 0, got inf"),
    (lambda: RolloutConfig(digits=2.5), "RolloutConfig.digits: expected int, got float 2.5"),
    (lambda: ParallelConfig(tp=2.0), "ParallelConfig.tp: expected int, got float 2.0"),
    (lambda: ParallelConfig(sequence_parallel="false"), "ParallelConfig.sequence_parallel: expected bool, got str"),
    (lambda: StepConfig(micro_batch_size=2.0), "StepConfig.micro_batch_size: expected int, got float 2.0"),
    (lambda: StepConfig(temperature=math.inf), "temperature must be finite, got inf"),
    (lambda: RunConfig(resume="false"), "RunConfig.resume: expected bool, got str 'false'"),
    (lambda: RunConfig(overwrite=1), "RunConfig.overwrite: expected bool, got int 1"),
    (lambda: ModelConfig(vocab_size=2.5), "ModelConfig.vocab_size: expected int, got float 2.5"),
    (lambda: ExperimentConfig(run={"steps": 3}), "ExperimentConfig.run must be a RunConfig, got dict"),
])
def test_config_dataclasses_built_directly_are_type_strict_and_name_the_field(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_int_is_still_a_float_and_the_yaml_defaults_still_build():
    assert CispoConfig(eps_low=1, eps_high=4).eps_high == 4.0  # YAML `eps_high: 4`
    assert OptimizerConfig(lr=1, adam_beta1=0).lr == 1
    assert RolloutConfig(temperature=1).temperature == 1
    assert StepConfig(temperature=2).temperature == 2
    assert main(["--check", CONFIG, "--world-size", "2"]) == 0


def _rollouts(**over):
    fields = dict(tokens=torch.zeros(2, 4, dtype=torch.int64), loss_mask=torch.ones(2, 3, dtype=torch.bool),
                  advantages=torch.ones(2))
    return Rollouts(**{**fields, **over})


@pytest.mark.parametrize("over,message", [
    ({"advantages": torch.tensor([True, False])},
     "rollouts.advantages must be a floating tensor (fp32), got torch.bool"),
    ({"advantages": torch.tensor([1, 0])}, "rollouts.advantages must be a floating tensor (fp32), got torch.int64"),
    ({"rollout_logprobs": torch.zeros(2, 3, dtype=torch.int32)},
     "rollouts.rollout_logprobs must be a floating tensor (fp32), got torch.int32"),
    # a 0.5 weight used to count its token as fully trained
    ({"loss_mask": torch.full((2, 3), 0.5)}, "rollouts.loss_mask must be bool or hold only 0 and 1, got a "
                                             "torch.float32 mask with other values"),
    ({"loss_mask": torch.full((2, 3), 2, dtype=torch.uint8)}, "rollouts.loss_mask must be bool or hold only 0 and 1"),
    ({"loss_mask": torch.full((2, 3), math.nan)}, "rollouts.loss_mask must be bool or hold only 0 and 1"),
    ({"tokens": torch.zeros(2, 4, dtype=torch.uint8)},
     "rollouts.tokens must be an int64 or int32 [n, s+1] tensor of token ids, got torch.uint8 (2, 4)"),
    ({"tokens": torch.zeros(2, 4, dtype=torch.bool)}, "rollouts.tokens must be an int64 or int32"),
    ({"tokens": torch.zeros(2, 4)}, "rollouts.tokens must be an int64 or int32"),
])
def test_rollouts_refuse_inputs_that_would_train_on_garbage(over, message):
    with pytest.raises(ValueError) as info:
        _rollouts(**over)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_rollouts_accept_0_1_masks_of_any_number_dtype_and_int32_ids():
    _rollouts(loss_mask=torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))
    _rollouts(loss_mask=torch.ones(2, 3, dtype=torch.uint8), tokens=torch.zeros(2, 4, dtype=torch.int32))
    assert _rollouts(tokens=torch.zeros(0, 4, dtype=torch.int64), loss_mask=torch.ones(0, 3, dtype=torch.bool),
                     advantages=torch.ones(0)).tokens.shape == (0, 4)  # an empty shard builds


def _policy_step_on_zero_rows():
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model, build_optimizer
    from megatron_cispo.step import policy_step

    distributed.init_distributed(tp=1, pp=1)
    chunks = build_model(ModelConfig(vocab_size=8, seq_length=4, hidden_size=8, num_layers=1,
                                     num_attention_heads=2), tp=1, pp=1, seed=0)
    empty = _rollouts(tokens=torch.zeros(0, 4, dtype=torch.int64), loss_mask=torch.ones(0, 3, dtype=torch.bool),
                      advantages=torch.ones(0))
    try:
        policy_step(chunks, build_optimizer(chunks, lr=1e-3), empty, LossConfig(), StepConfig())
    except ValueError as e:
        return str(e)
    return None


def test_policy_step_on_zero_rows_is_a_clear_error():
    message = spawn(_policy_step_on_zero_rows, 1, timeout_s=240)[0]
    assert message == "policy_step got no rows to train on (n=0 per rank, minibatch_size=None, dp=1)"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_narrow_integer_targets_score_like_int64_ones(dtype):
    logits = torch.randn(4, 7, requires_grad=True)
    ids = torch.tensor([0, 6, 3, 5])
    torch.testing.assert_close(token_logprobs(logits, ids.to(dtype)), token_logprobs(logits, ids), rtol=0, atol=0)


def _loss_inputs(**over):
    from megatron_cispo.losses import compute_policy_loss

    given = dict(advantages=torch.ones(2), loss_mask=torch.ones(2, 3, dtype=torch.bool),
                 old_logprobs=torch.zeros(2, 3), rollout_logprobs=torch.zeros(2, 3))
    return compute_policy_loss(LossConfig(), torch.zeros(2, 3, requires_grad=True), **{**given, **over})


@pytest.mark.parametrize("over,message", [
    # an int64 pi_old used to be upcast and trained on as if it were a logprob
    ({"old_logprobs": torch.zeros(2, 3, dtype=torch.int64)}, "old_logprobs must be a floating tensor (fp32), "
                                                             "got torch.int64"),
    ({"rollout_logprobs": torch.zeros(2, 3, dtype=torch.int64)}, "rollout_logprobs must be a floating tensor"),
    ({"ref_logprobs": torch.zeros(2, 3, dtype=torch.int32)}, "ref_logprobs must be a floating tensor"),
    ({"advantages": torch.ones(2, dtype=torch.int64)}, "advantages must be a floating tensor (fp32), got torch.int64"),
    # a NaN mask entry is != 0, so the token used to count as trained
    ({"loss_mask": torch.tensor([[1.0, 0.0, math.nan], [1.0, 1.0, 1.0]])},
     "loss_mask must be bool or hold only 0 and 1, got a torch.float32 mask with other values"),
    ({"loss_mask": torch.full((2, 3), 0.5)}, "loss_mask must be bool or hold only 0 and 1"),
    ({"old_logprobs": torch.zeros(2, 3, device="meta")},
     "old_logprobs is on meta but logprobs on cpu; put every tensor on one device"),
])
def test_the_policy_loss_refuses_inputs_that_would_train_on_garbage(over, message):
    with pytest.raises(ValueError) as info:
        _loss_inputs(**over)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_policy_loss_accepts_a_0_1_float_mask_and_runs_on_meta_tensors_for_shapes():
    assert float(_loss_inputs(loss_mask=torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])).denominator) == 4
    from megatron_cispo.losses import compute_policy_loss

    lp = torch.zeros(2, 3, device="meta")  # shape tracing: nothing reads the values, nothing is refused
    out = compute_policy_loss(LossConfig(), lp, advantages=torch.ones(2, device="meta"),
                              loss_mask=torch.ones(2, 3, device="meta"), old_logprobs=lp)
    assert out.loss.device.type == "meta"


def test_rollouts_on_the_meta_device_are_refused_naming_the_field():
    meta = dict(device="meta")
    for over in ({}, {"lengths": torch.full((2,), 4, **meta)}):
        with pytest.raises(ValueError) as info:
            Rollouts(tokens=torch.zeros(2, 4, dtype=torch.int64, **meta), loss_mask=torch.ones(2, 3, **meta),
                     advantages=torch.ones(2, **meta), **over)
        assert str(info.value).startswith("rollouts.tokens is on the meta device (shapes, no values)"), info.value


@pytest.mark.parametrize("op", ["token_logprobs", "fused_token_logprobs"])
def test_the_logprob_ops_refuse_meta_tensors_and_float_masks_naming_the_argument(op):
    from megatron_cispo.fused_head import fused_token_logprobs

    def call(device="cpu", mask=None, targets_device=None):
        ids = torch.zeros(3, 2, dtype=torch.int64, device=targets_device or device)
        if op == "token_logprobs":
            return token_logprobs(torch.zeros(3, 2, 5, device=device), ids, mask=mask)
        return fused_token_logprobs(torch.zeros(3, 2, 4, device=device), torch.zeros(5, 4, device=device), ids,
                                    mask=mask)
    first = "vocab_parallel_logits" if op == "token_logprobs" else "hidden"
    cases = [(dict(device="meta"), f"{first} is on the meta device (shapes, no values)"),
             (dict(targets_device="meta"), "targets is on meta but"),
             (dict(mask=torch.tensor([[1.0, math.nan]] * 3)),
              "mask: expected bool of shape (3, 2), found torch.float32")]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            call(**kwargs)
        assert message in str(info.value) and "\n" not in str(info.value), info.value
