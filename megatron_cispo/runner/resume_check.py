"""What a resume may change: each config key's rule when run.resume continues a checkpoint that was
saved with other settings (the table is in docs/reliability.md).

    applied = resume_changes(checkpoint_files.read_config(path), cfg, path=path)  # ConfigError if refused
    if applied: print(changed_settings_warning(path, applied, start))              # rank 0, one line

Refused: what the checkpoint's state was made for (the model's tensors, the optimizer's kind) and
the seed the run so far was drawn from. Applied without a word: bookkeeping and the layout (which
the load reshards to); run.steps too, unless a decaying learning-rate schedule stretches over it.
Everything else (optimizer settings, loss, rollout) applies from the next step, with one warning
line naming each change.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, to_dict
from .consistency import flatten

# (dotted key or section prefix, why a change is refused); the first match wins, so exceptions go first
_APPLIED = ("model.moe_aux_loss_coeff", "model.moe_z_loss_coeff")  # loss coefficients, not the model's shape
_REFUSED = (
    ("model.", "the checkpoint holds the saved model's tensors"),
    ("optimizer.name", "the checkpoint's optimizer state belongs to the saved optimizer"),
    ("run.seed", "the initial weights and every batch so far were drawn from the saved seed"),
)
# bookkeeping and layout: how the run is carried out, not what it computes
_SILENT = ("parallelism.", "run.steps", "run.run_dir", "run.name", "run.log_interval", "run.checkpoint_interval",
           "run.checkpoint_keep", "run.resume", "run.overwrite", "run.tensorboard", "run.max_consecutive_skips",
           "run.dist_timeout_s")


def _matches(key: str, rule: str) -> bool:
    return key.startswith(rule) if rule.endswith(".") else key == rule


def rule_for(key: str) -> str:
    """'refuse', 'silent' or 'warn' for a changed dotted key."""
    if any(key == k for k in _APPLIED):
        return "warn"
    if any(_matches(key, r) for r, _ in _REFUSED):
        return "refuse"
    return "silent" if any(_matches(key, r) for r in _SILENT) else "warn"


def _lr_follows_steps(flat: dict) -> bool:
    """Whether optimizer.lr_at depends on run.steps: a cosine or linear decay to a min_lr below lr
    (warmup and the constant schedule depend on the step only)."""
    return flat.get("optimizer.schedule", "constant") != "constant" and flat.get("optimizer.min_lr") != flat.get(
        "optimizer.lr")


def resume_changes(saved_text: str | None, cfg, *, path: Path) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) of every changed key to warn about; ConfigError naming every
    refused one. `saved_text`: the checkpoint's config.yaml (None: saved before checkpoints held one,
    nothing to compare). Keys only one side knows (another version of this code) are not compared."""
    if saved_text is None:
        return []
    try:
        saved = flatten(yaml.safe_load(saved_text))
    except yaml.YAMLError as e:
        raise ConfigError(f"run.resume: {path}/config.yaml is not valid YAML ({e}); move the checkpoint aside") from None
    now = flatten(to_dict(cfg))
    changed = [(k, saved[k], now[k]) for k in now if k in saved and saved[k] != now[k]]
    refused = [(k, old, new) for k, old, new in changed if rule_for(k) == "refuse"]
    if refused:
        whys = {next(why for r, why in _REFUSED if _matches(k, r)) for k, _, _ in refused}
        keys = ", ".join(f"{k} (saved {old!r}, now {new!r})" for k, old, new in refused)
        raise ConfigError(f"run.resume: {path} cannot continue with changed {keys}: {'; '.join(sorted(whys))}. "
                          "Resume with the saved values, or start a new run (another run.run_dir)")
    # run.steps is bookkeeping, except that a decaying schedule's learning rate is a function of it
    steps_warn = _lr_follows_steps(saved) or _lr_follows_steps(now)
    return [(k, old, new) for k, old, new in changed if rule_for(k) == "warn" or (k == "run.steps" and steps_warn)]


def changed_settings_warning(path: Path, changes: list[tuple[str, Any, Any]], start: int) -> str:
    """The one warning line for applied changes."""
    listed = ", ".join(f"{k} {old!r} -> {new!r}" + (" (the learning-rate decay now spans the new run.steps)"
                                                    if k == "run.steps" else "") for k, old, new in changes)
    return (f"warning: resuming {path} with changed settings, applied from step {start + 1}: {listed} "
            "(run_dir/config_history/ keeps each start's config)")
