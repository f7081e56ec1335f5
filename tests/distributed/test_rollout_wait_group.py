"""data.reward_budget_s: the other ranks wait for rank 0's batch in a group of their own, whose timeout
is the trainer's collective timeout plus the reward budget. Here the trainer's timeout is 2 s and rank 0
takes 3.5 s to score: the wait in that group gets the batch, where the default group would have
timed out (so the test fails if the group were built with the default timeout)."""
import datetime
import time

import torch.distributed as dist

from megatron_cispo.testing import spawn

DIST_TIMEOUT_S = 2


def waiting_worker(budget_s):
    from megatron_cispo.rollout.prompt_sampler import rollout_wait_group

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S))
    group = rollout_wait_group(DIST_TIMEOUT_S, budget_s)
    box = [None]
    if dist.get_rank() == 0:
        time.sleep(3.5)  # a reward slower than the trainer's collective timeout
        box[0] = {"batch": list(range(5))}
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0], group is None


def test_the_wait_for_rank_0s_batch_outlasts_the_collective_timeout_by_the_reward_budget():
    results = spawn(waiting_worker, 2, args=(5.0,), timeout_s=120)
    assert results == [({"batch": [0, 1, 2, 3, 4]}, False)] * 2
