"""step/groups.py: the process groups the step is handed, and its one fallback to megatron's globals."""
import sys
from types import SimpleNamespace

import pytest

from megatron_cispo.step.groups import NEEDED, default_groups, is_last_stage, rank, size


def test_a_collection_handed_in_is_used_as_is():
    pg = SimpleNamespace(**dict.fromkeys(NEEDED, "a group"))
    assert default_groups(pg) is pg


def test_a_collection_without_a_group_the_step_needs_is_refused_naming_it():
    pg = SimpleNamespace(**dict.fromkeys(set(NEEDED) - {"dp_cp"}))
    with pytest.raises(ValueError, match=r"pg_collection lacks the process groups \['dp_cp'\]"):
        default_groups(pg)


def test_without_megatrons_parallel_state_every_group_is_one_rank(monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    pg = default_groups()
    assert all(getattr(pg, name) is None for name in NEEDED)
    assert size(pg.tp) == 1 and rank(pg.dp) == 0 and is_last_stage(pg)
    assert "megatron.core.parallel_state" not in sys.modules  # looked up, never imported
