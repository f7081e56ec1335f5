"""docs/integration.md section 3 stays true: its code is docs/examples/fork_step.py's (which
tests/e2e/test_fork_example.py runs), and its Rollouts table lists every field with its shape."""
import dataclasses
import re
import textwrap
from pathlib import Path

from megatron_cispo.step import Rollouts

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "integration.md").read_text()
FORK = DOC[DOC.index("## 3. An in-house fork"):DOC.index("## Custom losses")]
EXAMPLE = (ROOT / "docs" / "examples" / "fork_step.py").read_text()


def _example_blocks() -> dict[str, str]:
    found = re.findall(r"^( *)# --- doc: ([\w-]+)\n(.*?)^\1# --- end\n", EXAMPLE, re.S | re.M)
    return {name: textwrap.dedent(body) for _, name, body in found}


def test_the_fork_recipes_code_blocks_are_the_example_scripts_verbatim():
    blocks = _example_blocks()
    assert set(blocks) == {"set-up", "model", "step"}
    quoted = re.findall(r"```python\n(.*?)```", FORK, re.S)
    assert quoted == [blocks["set-up"], blocks["model"], blocks["step"]]


def _rollouts_table() -> dict[str, str]:
    """field -> its 'shape, dtype' cell, from the table under '### Rollouts'."""
    table = FORK[FORK.index("### Rollouts"):]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M)
    return dict(rows)


def test_the_rollouts_table_lists_every_field_with_the_shape_its_field_doc_gives():
    table = _rollouts_table()
    fields = {f.name: f.metadata["doc"] for f in dataclasses.fields(Rollouts)}
    assert list(table) == list(fields), "docs/integration.md's Rollouts table and step/rollouts.py differ"
    for name, doc in fields.items():
        shape = re.match(r"\[[^\]]*\]", doc).group(0)  # every field doc opens with its shape
        assert table[name].startswith(f"`{shape}`"), (name, table[name], shape)


# (field, config, text of its 'needed when' cell): required_inputs(config) must contain the field,
# and a config without the setting must not (so each row names a real reason).
NEEDED = [
    ("rollout_logprobs", {"cispo": {"anchor": "rollout"}}, "`cispo.anchor=rollout`"),
    ("rollout_logprobs", {"policy_loss": "rollout_is"}, "`rollout_is`"),
    ("rollout_logprobs", {"tis": {"level": "token"}}, "`tis.*`"),
    ("rollout_logprobs", {"correction": {"mis": [0.5, 2.0]}}, "`correction.mis`"),
    ("rollout_logprobs", {"correction": {"geo_rs": [0.5, 2.0]}}, "`geo_rs`"),
    ("rollout_logprobs", {"correction": {"m2po": 0.04}}, "`m2po`"),
    ("rollout_logprobs", {"correction": {"opsm": 1e-3}}, "`correction.opsm` with `opsm_ref=rollout`"),
    ("rollout_logprobs", {"kl": {"coef": 0.1, "is_weight": True}}, "`kl.is_weight`"),
    ("old_logprobs", {}, "the old anchor (`cispo` by default"),
    ("old_logprobs", {"policy_loss": "ppo"}, "`ppo`"),
    ("old_logprobs", {"cispo": {"anchor": "rollout"}, "correction": {"opsm": 1e-3, "opsm_ref": "old"}},
     "`correction.opsm` with `opsm_ref=old`"),
    ("ref_logprobs", {"kl": {"coef": 0.1}}, "`kl.coef > 0`"),
]


def test_each_reason_the_rollouts_table_gives_for_a_logprob_field_is_one_required_inputs_has():
    from megatron_cispo.config import LossConfig, from_dict
    from megatron_cispo.losses import required_inputs

    table = FORK[FORK.index("### Rollouts"):]
    cells = {name: cell for name, cell in re.findall(r"^\| `(\w+)` \|[^|]+\| ([^|]+) \|", table, re.M)}
    rollout_anchor = required_inputs(from_dict(LossConfig, {"cispo": {"anchor": "rollout"}}))
    assert rollout_anchor == {"rollout_logprobs"}  # the baseline the old_logprobs reasons add to
    for name, overrides, text in NEEDED:
        assert text in cells[name], (name, text)
        assert name in required_inputs(from_dict(LossConfig, overrides)), (name, overrides)
    assert "old_logprobs" not in required_inputs(from_dict(LossConfig, {"cispo": {"anchor": "rollout"},
                                                                         "correction": {"opsm": 1e-3}}))
    assert "ref_logprobs" not in required_inputs(LossConfig()) and "rollout_logprobs" not in required_inputs(LossConfig())
