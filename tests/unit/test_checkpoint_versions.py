"""Checkpoint layouts per megatron-core release: where the common state lives (common.pt up to 0.18,
the shards' common_state from 0.19) is probed, not read from the version, and a 0.19+ checkpoint on a
release that can read neither itself nor through a common strategy (0.17, 0.18) is refused in one
line naming both versions. Writing and resuming across 0.16.1 and 0.19.2 for real:
tests/e2e/test_checkpoint_cross_version.py."""
import json
import sys
import types

import pytest

from megatron_cispo.config import ConfigError
from megatron_cispo.runner import checkpoint, checkpoint_files


def test_the_common_state_probe_agrees_with_the_release_that_moved_it():
    from megatron.core import package_info

    assert checkpoint_files.writes_common_pt() == ((int(package_info.MAJOR), int(package_info.MINOR)) < (0, 19))
    assert checkpoint_files.megatron_core_version() == package_info.__shortversion__  # no "+<git hash>"


def test_a_0_19_checkpoint_on_0_17_is_refused_in_one_line_naming_both_versions(tmp_path, monkeypatch):
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 2, "megatron_core": "0.19.2"}))  # no common.pt
    monkeypatch.setattr(checkpoint_files, "writes_common_pt", lambda: True)
    monkeypatch.setattr(checkpoint_files, "megatron_core_version", lambda: "0.17.1")
    # 0.17 and 0.18 have no TorchCommonLoadStrategy (and their load() takes no common strategy)
    monkeypatch.setitem(sys.modules, "megatron.core.dist_checkpointing.strategies.common",
                        types.ModuleType("megatron.core.dist_checkpointing.strategies.common"))
    with pytest.raises(ConfigError) as e:
        checkpoint._common_strategy(tmp_path, {"megatron_core": "0.19.2"})
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"run.resume: {tmp_path} was written by megatron-core 0.19.2"), said
    assert "megatron-core 0.17.1 reads only common.pt" in said and "0.16 or >= 0.19" in said, said


def test_a_common_pt_checkpoint_needs_no_common_strategy_on_any_release(tmp_path, monkeypatch):
    (tmp_path / checkpoint_files.COMMON).write_bytes(b"")
    for writes_common_pt in (True, False):
        monkeypatch.setattr(checkpoint_files, "writes_common_pt", lambda: writes_common_pt)
        assert checkpoint._common_strategy(tmp_path, {}) is None


def test_only_a_checkpoint_recorded_as_another_releases_is_called_cross_version(monkeypatch):
    # markers written before the version was recorded came from this code's common.pt layout: no note
    monkeypatch.setattr(checkpoint_files, "megatron_core_version", lambda: "0.16.1")
    assert not checkpoint._other_writer({"step": 2})
    assert not checkpoint._other_writer({"step": 2, "megatron_core": "0.16.1"})
    assert checkpoint._other_writer({"step": 2, "megatron_core": "0.19.2"})
