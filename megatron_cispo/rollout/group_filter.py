"""rollout.filter_groups: dynamic sampling (DAPO's). A group whose scored rewards are all equal has zero
advantage for every sample, so it adds nothing to the step but its tokens; such groups are dropped and
more prompts are sampled to refill the batch, up to rollout.filter_max_rounds extra rounds.

    groups, counts = refill(first, more, want=prompts_per_step, max_rounds=3)
    # first: [Group] of the step's prompts; more(n) -> [Group] of n new prompts (generated and scored)

When the rounds run out the batch is filled with dropped groups (zero advantage: they move nothing) so
that its shape stays what the layout divides, and counts["rollout/filter_short_groups"] says how many.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Group:
    prompt: object                   # the Prompt it sampled
    completions: list                # its group_size Completions
    rewards: list[Optional[float]]   # one per completion, None where the reward failed


def has_signal(rewards: list[Optional[float]]) -> bool:
    """Whether a group's scored rewards differ (two or more scored, not all equal): only then is any
    sample's advantage non-zero."""
    scored = [r for r in rewards if r is not None]
    return len(scored) >= 2 and max(scored) > min(scored)


def zero_signal_frac(groups: list[Group]) -> float:
    return sum(not has_signal(g.rewards) for g in groups) / max(1, len(groups))


def refill(first: list[Group], more: Callable[[int], list[Group]], *, want: int, max_rounds: int
           ) -> tuple[list[Group], dict[str, float]]:
    """`want` groups: those of `first` with signal, then those of up to max_rounds calls of more(shortfall),
    then (the rounds spent) dropped groups; and the counts (groups dropped, rounds, prompts sampled
    beyond `first`, groups without signal kept to fill the batch)."""
    kept = [g for g in first if has_signal(g.rewards)]
    dropped = [g for g in first if not has_signal(g.rewards)]
    rounds = extra = 0
    while len(kept) < want and rounds < max_rounds:
        new = more(want - len(kept))
        rounds, extra = rounds + 1, extra + len(new)
        kept += [g for g in new if has_signal(g.rewards)]
        dropped += [g for g in new if not has_signal(g.rewards)]
    short = max(0, want - len(kept))
    counts = {"rollout/filter_dropped_groups": float(len(dropped) - short), "rollout/filter_rounds": float(rounds),
              "rollout/filter_extra_prompts": float(extra), "rollout/filter_short_groups": float(short)}
    return kept[:want] + dropped[:short], counts
