"""rollout/group_filter.refill (rollout.filter_groups) with made-up groups: what has signal, how the
batch is refilled, the bound on rounds, and the counts."""
from megatron_cispo.rollout.group_filter import Group, has_signal, refill, zero_signal_frac


def _g(i, rewards):
    return Group(prompt=i, completions=[None] * len(rewards), rewards=rewards)


def test_signal_needs_two_scored_rewards_that_differ():
    assert has_signal([0.0, 1.0]) and has_signal([None, 0.5, 0.0])
    assert not has_signal([1.0, 1.0]) and not has_signal([0.0, None]) and not has_signal([None, None])
    assert zero_signal_frac([_g(0, [1, 1]), _g(1, [0, 1])]) == 0.5


def test_groups_without_signal_are_replaced_by_new_prompts_in_order():
    asked = []
    supply = iter(range(100, 200))

    def more(n):
        asked.append(n)
        return [_g(next(supply), [0.0, 1.0] if k % 2 == 0 else [0.0, 0.0]) for k in range(n)]

    first = [_g(0, [1.0, 1.0]), _g(1, [0.0, 1.0]), _g(2, [0.0, 0.0]), _g(3, [1.0, 0.0])]
    groups, counts = refill(first, more, want=4, max_rounds=3)
    assert [g.prompt for g in groups] == [1, 3, 100, 102] and asked == [2, 1]
    assert counts == {"rollout/filter_dropped_groups": 3.0, "rollout/filter_rounds": 2.0,
                      "rollout/filter_extra_prompts": 3.0, "rollout/filter_short_groups": 0.0}


def test_the_bound_on_rounds_holds_and_dropped_groups_fill_what_is_left():
    groups, counts = refill([_g(0, [1.0, 1.0]), _g(1, [0.0, 1.0])], lambda n: [_g(9, [0.0, 0.0])] * n, want=2,
                            max_rounds=2)
    assert [g.prompt for g in groups] == [1, 0] and counts["rollout/filter_rounds"] == 2.0
    assert counts["rollout/filter_short_groups"] == 1.0 and counts["rollout/filter_extra_prompts"] == 2.0
    nothing, counts = refill([_g(0, [1.0, 1.0])], lambda n: [], want=1, max_rounds=0)
    assert [g.prompt for g in nothing] == [0] and counts["rollout/filter_short_groups"] == 1.0  # a step with no signal
