"""An override value is parsed as YAML, where ` #` starts a comment: a path or name keeps its whole
text, and any other value with a comment is refused in one line, never silently cut."""
from pathlib import Path

import pytest

from megatron_cispo.config import ConfigError, parse_override_value
from megatron_cispo.runner.experiment import load_experiment

DEMO = Path(__file__).resolve().parents[2] / "yaml_configs" / "demo_cpu.yaml"


def test_a_run_dir_with_a_hash_keeps_its_whole_text():
    cfg = load_experiment(DEMO, ["run.run_dir=runs/exp #1", "run.name=#2", "run.seed=7"])
    assert cfg.run.run_dir == "runs/exp #1" and cfg.run.name == "#2" and cfg.run.seed == 7
    assert parse_override_value("a#b") == "a#b" and parse_override_value("'a #b'") == "a #b"


@pytest.mark.parametrize("override", ["run.steps=5 # five", "rollout.top_p=0.5 #x", "loss.cispo.anchor=[old] #",
                                      "run.run_dir='runs/a' #1", "run.name=~ # x", 'run.name="b" #c'])
def test_a_comment_after_any_other_value_is_refused_in_one_line(override):
    with pytest.raises(ConfigError) as e:
        load_experiment(DEMO, [override])
    key, _, text = override.partition("=")
    assert str(e.value).startswith(f"{key}: {text!r} holds ' #'") and "\n" not in str(e.value)
