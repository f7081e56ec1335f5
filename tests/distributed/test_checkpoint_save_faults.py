"""checkpoint.save on 2 gloo ranks with a failure injected into rank 0's writes (the disk filling up
under its shard, common.pt (megatron-core 0.16-0.18; 0.19+ has none), metadata.json or sampler.pt):
every rank raises the same SaveFailed, in one line naming the file, and the temporary directory is
gone; nobody waits in a collective alone. A failure while
pruning, after the checkpoint is in place, is a warning. No root needed: the errors are injected (a
real full disk is tests/e2e/test_checkpoint_faults.py, which needs a tmpfs mount). checkpoint.load that
fails on one rank only stops every rank with that rank's line."""
import errno
from pathlib import Path

from megatron_cispo.testing import spawn

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "yaml_configs" / "demo_cpu.yaml")
TINY = ["rollout.prompts_per_step=8", "rollout.group_size=4", "parallelism.micro_batch_size=8",
        "rollout.precision=fp32", "run.tensorboard=false", "parallelism.tp=1"]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
TORN = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")  # torch.save, disk full
# (case, what raises on rank 0, the error, the file named): its shard (which holds the common state
# with megatron-core 0.19+; torch.distributed.checkpoint names no file), its own files
CASES = [("shard_oserror", "shard", ENOSPC, ""), ("metadata_oserror", "metadata", ENOSPC, "metadata.json"),
         ("sampler_runtime", "durable", TORN, "sampler.pt")]
COMMON_PT_CASES = [("common_oserror", "common", ENOSPC, "common.pt"), ("common_runtime", "common", TORN, "common.pt")]


def _cases():
    from megatron_cispo.runner import checkpoint_files

    return COMMON_PT_CASES + CASES if checkpoint_files.writes_common_pt() else CASES


def _inject(where, error):
    """Make rank 0's `where` write raise `error`; returns the undo."""
    from megatron.core.dist_checkpointing import core
    from torch.distributed.checkpoint import FileSystemWriter

    from megatron_cispo.base import files
    from megatron_cispo.runner import checkpoint_files, checkpoint_save

    owner, name = {"shard": (FileSystemWriter, "write_data"), "common": (checkpoint_save, "write_common_pt"),
                   "metadata": (core, "save_config"), "durable": (files, "write_durable"),
                   "prune": (checkpoint_files, "prune")}[where]
    original = owner.__dict__.get(name)  # a class may inherit it (FileSystemWriter.write_data)

    def fail(*args, **kwargs):
        if where == "durable" and Path(args[0]).name != "sampler.pt":  # common.pt is written through it too
            return original(*args, **kwargs)
        raise error

    setattr(owner, name, fail)
    return lambda: setattr(owner, name, original) if original is not None else delattr(owner, name)


def save_worker(run_dir, cases):
    import contextlib
    import io

    import torch.distributed as dist

    from megatron_cispo.runner import loop
    from megatron_cispo.runner import checkpoint, checkpoint_files
    from megatron_cispo.runner.experiment import dump_yaml, load_experiment

    cfg = load_experiment(DEMO, [*TINY, f"run.run_dir={run_dir}"])
    t = loop._set_up(cfg, loop._init_distributed(cfg))
    out = []
    for step, (case, where, error, _) in enumerate(cases, start=1):
        undo = _inject(where, error) if dist.get_rank() == 0 else (lambda: None)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                path = checkpoint.save(run_dir, step, chunks=t.chunks, optimizer=t.optimizer,
                                       shared={"sampler": t.sampler}, keep=5, config=dump_yaml(cfg))
            said = ("saved", str(path), err.getvalue())
        except checkpoint.SaveFailed as e:
            said = ("failed", str(e), err.getvalue())
        finally:
            undo()
        out.append((case, *said, checkpoint_files.tmp_dir(run_dir, step).exists(),
                    (checkpoint_files.step_dir(run_dir, step) / checkpoint_files.MARKER).is_file()))
    return out


def test_a_failed_write_of_rank_0s_own_files_stops_every_rank_alike_and_a_failed_prune_only_warns(tmp_path):
    cases = [*_cases(), ("prune_oserror", "prune", ENOSPC, "")]
    ranks = spawn(save_worker, 2, (tmp_path / "run", cases), timeout_s=240)
    for (case, where, error, name), *per_rank in zip(cases, *ranks):
        said = {r[1:3] for r in per_rank}
        assert len(said) == 1 or where == "prune", (case, per_rank)  # the same on every rank
        kind, text, _, tmp_left, complete = per_rank[0][1:]
        if where == "prune":  # after the rename: the checkpoint is in place, rank 0 warns
            assert kind == "saved" and complete and not tmp_left, per_rank
            assert "warning: checkpoint" in per_rank[0][3] and "OSError: [Errno 28]" in per_rank[0][3], per_rank
            continue
        assert kind == "failed" and not tmp_left and not complete, (case, per_rank)
        assert "\n" not in text and text.startswith(f"checkpoint of step "), text
        assert name in text and type(error).__name__ in text and "MiB are free" in text, (case, text)
        assert str(error) in text and "(rank" not in text, (case, text)  # rank 0's own error, said as such


LOAD_CASES = [("none", None, None), ("rank1_runtime", 1, RuntimeError("boom in load_state_dict")),
              ("rank0_keyerror", 0, KeyError("optimizer.state.momentum_buffer"))]


def load_worker(run_dir):
    import torch.distributed as dist

    from megatron_cispo.config import ConfigError
    from megatron_cispo.runner import loop
    from megatron_cispo.runner import checkpoint
    from megatron_cispo.runner.experiment import dump_yaml, load_experiment

    cfg = load_experiment(DEMO, [*TINY, f"run.run_dir={run_dir}"])
    t = loop._set_up(cfg, loop._init_distributed(cfg))
    loop._resume(t)  # a fresh run: the sampler gets version 0
    loop._step(t, 0)  # one step, so that the optimizer has state (Adam's moments) to save and load
    path = checkpoint.save(run_dir, 1, chunks=t.chunks, optimizer=t.optimizer, shared={"sampler": t.sampler},
                           keep=2, config=dump_yaml(cfg))
    out = []
    for case, rank, error in LOAD_CASES:
        original = checkpoint.load_optimizer_state
        if rank == dist.get_rank():
            def fail(*args, error=error):
                raise error
            checkpoint.load_optimizer_state = fail
        try:
            out.append((case, "loaded", checkpoint.load(path, chunks=t.chunks, optimizer=t.optimizer,
                                                        shared={"sampler": t.sampler})))
        except ConfigError as e:
            out.append((case, "refused", str(e)))
        finally:
            checkpoint.load_optimizer_state = original
    return out


def test_a_load_that_fails_on_one_rank_stops_every_rank_with_that_ranks_line_and_the_right_cause(tmp_path):
    ranks = spawn(load_worker, 2, (tmp_path / "run",), timeout_s=240)
    got = dict(zip([c for c, _, _ in LOAD_CASES], zip(*ranks)))
    assert all(r[1:] == ("loaded", 1) for r in got["none"]), got
    for case in ("rank1_runtime", "rank0_keyerror"):
        assert len({r[1:] for r in got[case]}) == 1 and got[case][0][1] == "refused", got[case]  # alike everywhere
    one = got["rank1_runtime"][0][2]
    assert one.startswith("run.resume: cannot load the model and optimizer from ") and "\n" not in one, one
    assert one.endswith("RuntimeError: boom in load_state_dict (on rank 1)") and "another model" not in one, one
    key = got["rank0_keyerror"][0][2]
    assert "KeyError: optimizer.state.momentum_buffer; it was saved by another model or optimizer" in key, key
