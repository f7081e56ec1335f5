"""Process groups handed to the step (step/groups.py), for the layout tests: new gloo groups with the
members of megatron's, and a watch on megatron's parallel_state getters called from our code."""


def own_groups():
    """A ProcessGroupCollection of new gloo groups with the members of megatron's (tp, pp, cp, tp_cp, dp,
    dp_cp): other objects than parallel_state's, with the same numbers as the result."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_cispo.step.groups import NEEDED

    theirs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(NEEDED))
    mine = {}
    for name in NEEDED:
        members = [None] * dist.get_world_size()
        dist.all_gather_object(members, dist.get_process_group_ranks(getattr(theirs, name)))
        for ranks in sorted({tuple(m) for m in members}):  # every rank creates every group, in one order
            group = dist.new_group(list(ranks))
            if dist.get_rank() in ranks:
                mine[name] = group
    return ProcessGroupCollection(**mine)


def watch_parallel_state(seen: list):
    """Record each call of a parallel_state getter from megatron_cispo's code (the caller's module):
    megatron-core's own calls pass. Returns the undo."""
    import inspect
    import sys

    from megatron.core import parallel_state as mpu

    originals = {name: fn for name, fn in vars(mpu).items()
                 if inspect.isfunction(fn) and name.startswith(("get_", "is_", "model_parallel_is"))}

    def watched(fn, name):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron_cispo."):
                seen.append(f"{caller}: {name}")
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(mpu, name, watched(fn, name))
    return lambda: [setattr(mpu, name, fn) for name, fn in originals.items()]
