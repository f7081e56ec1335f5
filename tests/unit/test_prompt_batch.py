"""data.prompts / rollout.engine=vllm: the config's rules and how sampled rows become a trainer batch.

The batch is built from Completion records as vLLM returns them (rollout/vllm_engine.py); the engine
itself is tested in test_vllm_engine.py and end to end in tests/e2e/test_vllm_cli.py.
"""
from __future__ import annotations

import pytest
import torch

from megatron_cispo.config import ConfigError
from megatron_cispo.rollout.prompt_sources import eos_ids, rows_to_batch
from megatron_cispo.rollout.task import group_advantages
from megatron_cispo.rollout.vllm_engine import Completion
from megatron_cispo.runner.experiment import load_experiment

SHIPPED = "yaml_configs/vllm_qwen2_tiny.yaml"


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from megatron_cispo.tools.make_tiny_hf import main

    out = tmp_path_factory.mktemp("m") / "qwen2"
    main(["--family", "qwen2", "--vocab", "16", str(out)])
    return out


def _load(model, *overrides):
    return load_experiment(SHIPPED, [f"model.hf_path={model}", *overrides], env={})


def test_the_shipped_yaml_loads_with_an_absolute_prompt_path(tiny_qwen2):
    cfg = _load(tiny_qwen2)
    assert cfg.rollout.engine == "vllm" and cfg.data.prompts.startswith("/")
    assert cfg.data.prompts.endswith("yaml_configs/data/add2/train.jsonl")
    assert cfg.data.eval_prompts.endswith("yaml_configs/data/add2/eval.jsonl")


def test_the_shipped_task_files_are_the_generators_and_the_held_out_rows_are_never_trained_on(tmp_path):
    from pathlib import Path

    from megatron_cispo.rollout.arith import EVAL_ROWS, write_add2

    train, held = write_add2(tmp_path)
    shipped = Path(__file__).resolve().parents[2] / "yaml_configs" / "data" / "add2"
    assert train.read_text() == (shipped / "train.jsonl").read_text()
    assert held.read_text() == (shipped / "eval.jsonl").read_text()
    held_rows, train_rows = held.read_text().splitlines(), train.read_text().splitlines()
    assert len(held_rows) == EVAL_ROWS and len(train_rows) == 10_000 - EVAL_ROWS
    assert not set(held_rows) & set(train_rows)


@pytest.mark.parametrize("overrides, message", [
    (["data.prompts=null", "data.reward=null", "data.eval_prompts=null"],
     "rollout.engine='vllm' samples prompts from a file: set data.prompts"),
    (["rollout.engine=hf"], "data.prompts is sampled by vLLM: set rollout.engine: vllm (got 'hf')"),
    (["data.reward=null"], "data.prompts needs data.reward"),
    (["rollout.credit=token"], "rollout.credit='token' needs the synthetic task's per-position correctness"),
    (["rollout.max_new_tokens=128"], "rollout.max_new_tokens=128 leaves no room for a prompt in model.seq_length=128"),
    (["data.max_prompt_tokens=126"], "data.max_prompt_tokens=126 + rollout.max_new_tokens=5 exceeds model.seq_length=128"),
    (["data.prompts=null", "data.reward=null", "rollout.engine=hf"], "data.eval_prompts holds out prompts of the data.prompts task"),
    (["run.eval_interval=-1"], "run.eval_interval must be >= 0, got -1"),
    (["rollout.eval_samples=0"], "rollout.eval_samples must be >= 1, got 0"),
    (["data.reward_timeout_s=0"], "data.reward_timeout_s must be finite and > 0, got 0"),
    (["data.reward_workers=0"], "data.reward_workers must be >= 1, got 0"),
    (["data.reward_budget_s=0"], "data.reward_budget_s must be finite and > 0 (or null), got 0"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens must be >= 1, got 0"),
])
def test_each_bad_combination_is_one_line(tiny_qwen2, overrides, message):
    with pytest.raises(ConfigError) as e:
        _load(tiny_qwen2, *overrides)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_vllm_needs_a_hugging_face_model():
    with pytest.raises(ConfigError, match="rollout.engine='vllm' samples with model.hf_path's family"):
        load_experiment(SHIPPED, ["model.hf_path=null"], env={})


def test_eos_ids_prefer_generation_config(tmp_path, tiny_qwen2):
    assert eos_ids(str(tiny_qwen2)) == [13]
    (tmp_path / "config.json").write_text('{"eos_token_id": 5}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    assert eos_ids(str(tmp_path)) == [7, 9]
    (tmp_path / "generation_config.json").unlink()
    assert eos_ids(str(tmp_path)) == [5]


def _c(ids, logps, reason="stop", kept=None):
    return Completion(token_ids=ids, logprobs=logps, finish_reason=reason, kept=kept)


def test_rows_become_right_padded_rows_with_the_completion_in_the_loss():
    prompts = [[10, 3, 12, 5, 11], [10, 1, 11]]
    comps = [_c([8, 13], [-0.1, -0.2]), _c([9], [-0.3], "length"),
             _c([2, 13], [-0.4, -0.5]), _c([1, 2, 3], [-0.6, -0.7, -0.8], "length")]
    rows = [(prompts[i // 2], c) for i, c in enumerate(comps)]
    info = {}
    b = rows_to_batch(rows, [1.0, 0.0, 0.0, 0.5], group_size=2, version=3, info=info)
    assert b.tokens.tolist() == [[10, 3, 12, 5, 11, 8, 13], [10, 3, 12, 5, 11, 9, 0],
                                 [10, 1, 11, 2, 13, 0, 0], [10, 1, 11, 1, 2, 3, 0]]
    assert b.lengths.tolist() == [7, 6, 5, 6]
    # targets tokens[1:]: a completion token at row position j is target j - 1
    assert b.loss_mask.int().tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]]
    assert b.rollout_logprobs[0, 4:].tolist() == pytest.approx([-0.1, -0.2])
    assert b.rollout_logprobs[3, 2:5].tolist() == pytest.approx([-0.6, -0.7, -0.8])
    assert b.rollout_logprobs[~b.loss_mask].abs().sum() == 0
    assert torch.equal(b.advantages, group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.5]), 2))
    assert info["rollout/truncated_frac"] == 0.5 and info["rollout/new_tokens_mean"] == 2.0
    assert b.version == 3 and b.keep is None and b.correct[:, 0].tolist() == [True, False, False, False]


def test_a_failed_reward_leaves_its_sample_out_and_moves_no_other_advantage():
    comps = [_c([1, 13], [-1.0, -1.0]) for _ in range(4)]
    rows = [([10, 11], c) for c in comps]
    info = {}
    b = rows_to_batch(rows, [1.0, None, 0.0, 0.0], group_size=4, version=0, info=info)
    assert not b.loss_mask[1].any() and b.loss_mask[[0, 2, 3]].any(1).all()
    assert b.rewards[1].isnan() and b.rewards[[0, 2, 3]].tolist() == [1.0, 0.0, 0.0]  # reward_mean: scored only
    assert info["reward/scored_frac"] == 0.75
    assert b.advantages[1] == 0
    ok = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3)
    assert torch.allclose(b.advantages[[0, 2, 3]], ok)


def test_kept_sets_land_on_the_completion_targets():
    comps = [_c([4, 13], [-0.5, -0.1], kept=[[4, 2], [13]]), _c([2], [-0.7], "length", kept=[[2, 4, 6]])]
    rows = [([10, 11], c) for c in comps]
    b = rows_to_batch(rows, [1.0, 0.0], group_size=2, version=0, info={})
    per_target = [b.keep.ids[b.keep.offsets[i]:b.keep.offsets[i + 1]].tolist() for i in range(b.keep.n)]
    t = b.tokens.shape[1] - 1
    assert per_target[:t] == [[], [2, 4], [13]] and per_target[t:] == [[], [2, 4, 6], []]
