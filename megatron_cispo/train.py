"""Run an RL experiment described by a YAML file (see docs/configuration.md).

    python -m megatron_cispo.train yaml_configs/demo_cpu.yaml run.steps=10        # one process
    torchrun --nproc-per-node 4 -m megatron_cispo.train yaml_configs/demo_cpu.yaml loss.cispo.anchor=old
    python -m megatron_cispo.train --check yaml_configs/gpu_template.yaml --world-size 16   # validate only

Exit codes: 0 done; 2 (EXIT_CONFIG) a bad config, reported once (by rank 0) with its key path
before any process group exists, so a typo never becomes a traceback from each rank; 3
(EXIT_NONFINITE) the run stopped after run.max_consecutive_skips optimizer steps in a row were
skipped for a non-finite loss or gradient, reported in one line by rank 0 (metrics.jsonl holds
those steps, their non-finite values as null); 4 (EXIT_PEER_LOST) a rank stopped answering for
longer than run.dist_timeout_s, named in one line by rank 0 (or, when rank 0 is the one, by the
first rank to notice; gloo only, see docs/troubleshooting.md for NCCL); 5 (EXIT_PREEMPTED) SIGTERM,
SIGINT (Ctrl-C) or SIGHUP: every rank finished the step and a checkpoint was written, rank 0 says
where; rerun with run.resume=true (a second Ctrl-C stops at once without one: 130); 6
(EXIT_SAVE_FAILED) a checkpoint could not be written (a full disk), rank 0 names the file and the
free space; 7 (EXIT_ROLLOUT_FAILED) the rollout engine (vLLM) failed mid-run or its MoE routes disagree
with the model (BadRoutes), rank 0 quotes its
error. A config that differs across ranks (an ${ENV} value) is an EXIT_CONFIG error
naming the keys and each rank's value; `--check` also refuses a run.run_dir that rank 0 would.
Bare torchrun prints rank 0's line, then its agent's log lines and a ChildFailedError traceback
whose summary lists each worker's exit code (about 40 lines), and exits 1 whatever they were. The
launch scripts (launch/run_torchrun.py) print rank 0's line only and exit with the workers' code
when every worker that failed returned the same one of REPORTED_EXIT_CODES, also when torchrun
itself got the SIGTERM or SIGINT.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .config import ConfigError
from .integrations.plugins import PluginImportError, load_plugins
from .runner.experiment import dump_yaml, load_experiment, resolve_world
from .runner.memory_plan import check_fits, format_plan, memory_plan
from .runner.rundir import check_run_dir

EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_PEER_LOST = 4
EXIT_PREEMPTED = 5
EXIT_SAVE_FAILED = 6
EXIT_ROLLOUT_FAILED = 7  # the rollout engine (vLLM) failed mid-run, or its MoE routes disagree with the model; rank 0 printed why
EXIT_INTERRUPTED = 130  # a second Ctrl-C: runner/preempt.py's os._exit code (128 + SIGINT, as a shell reports it)
# Exit codes whose reason rank 0 has printed in one line (launch/run_torchrun.py passes them on quietly).
REPORTED_EXIT_CODES = (EXIT_CONFIG, EXIT_NONFINITE, EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_SAVE_FAILED,
                       EXIT_ROLLOUT_FAILED, EXIT_INTERRUPTED)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="megatron_cispo.train", description="Run an RL experiment from YAML.")
    ap.add_argument("config", help="experiment YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loss.cispo.anchor=rollout run.steps=10")
    ap.add_argument("--check", action="store_true", help="validate the config (and layout), print it, run nothing")
    ap.add_argument("--world-size", type=int, default=None,
                    help="with --check: the number of processes to validate the layout for")
    ap.add_argument("--nnodes", type=int, default=None,
                    help="with --check: the nodes they run on (torchrun's --nnodes; default 1), to place the rollout "
                         "engines on run.gpus_per_node GPUs each")
    return ap.parse_intermixed_args(argv)  # overrides may follow --check/--world-size


# Every rank hits a config error alike, and rank 0 says it; torchrun stops the job at the first rank
# that exits, so the others give a rank 0 that lags (a loaded machine) this long to print first.
SPEAK_FIRST_S = 5.0


def _say_once(text: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(text, file=sys.stderr, flush=True)
    else:
        time.sleep(SPEAK_FIRST_S)


def _report(config: str, err: Exception) -> int:
    _say_once(f"config error in {config}: {err}")
    return EXIT_CONFIG


def _world_size(flag: int | None) -> int:
    """--world-size, else torchrun's WORLD_SIZE, else 1; ConfigError naming the one that is not an int >= 1."""
    where, text = "--world-size", str(flag)
    if flag is None:
        where, text = "WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(text)
    except ValueError:
        world = 0
    if world < 1:
        raise ConfigError(f"{where} must be an int >= 1 (the number of processes), got {text!r}")
    return world


def _nnodes(flag: int | None, world: int) -> int:
    """--nnodes, else torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, else 1."""
    if flag is not None:
        return flag
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return world // local if local > 0 and world % local == 0 else 1


def _check_placement(cfg, world: int, nnodes: int) -> str:
    """The engines' GPUs (rollout/placement.py): ConfigError for what cannot be placed; the comment line saying
    what was not checked ("" when all was)."""
    from .rollout.placement import gpus_problem, places_gpus

    try:
        problem = gpus_problem(cfg, world=world, nnodes=nnodes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if problem:
        raise ConfigError(problem)
    if cfg.run.gpus_per_node is None and places_gpus(cfg):
        return ("# not checked: which GPUs the rollout engines get on each node (set run.gpus_per_node); the run "
                "checks each node's own at start\n")
    return ""


def _check_sources(cfg) -> str:
    """--check: vLLM installed, data.prompts readable, data.reward importable (rollout.engine: vllm). Returns
    what it could not check, as a comment line ("" when everything was)."""
    from .rollout.prompt_sources import check_sources

    try:
        sources = check_sources(cfg, untokenized=True)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if sources is None and cfg.data.prompts is not None:
        return (f"# not checked: the prompts' tokenization, their lengths in tokens and the chat template (model.hf_path={cfg.model.hf_path} has no tokenizer "
                "files); the run checks them at start\n")
    return ""


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        world = _world_size(args.world_size)
        load_plugins()  # MEGATRON_CISPO_PLUGINS may register the loss the config names
        cfg = load_experiment(args.config, args.overrides)
        dp = resolve_world(cfg, world)  # load_experiment already ran the config's rules
        nnodes = _nnodes(args.nnodes, world)
        placed = _check_placement(cfg, world, nnodes)  # at --check and at start alike
        plan = memory_plan(cfg, world, nnodes=nnodes)
        check_fits(cfg, plan)  # run.gpu_memory_gb: at --check and at start alike
        if args.check:  # what rank 0 would refuse at start-up, said before any rank starts
            check_run_dir(cfg.run.run_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite)
            unchecked = placed + _check_sources(cfg)
    except (ConfigError, PluginImportError) as e:
        return _report(args.config, e)
    if args.check:
        print(dump_yaml(cfg), end="")
        print(format_plan(plan, cfg) + unchecked, end="")
        p = cfg.parallelism
        extra = (f" x cp {p.cp}" if p.cp > 1 else "") + (f" (ep {p.ep})" if p.ep > 1 else "")
        print(f"# ok: {world} processes = tp {p.tp} x pp {p.pp} x dp {dp}{extra}")
        return 0
    from .demo.report import finish_run
    from .runner.loop import NonFiniteStop, run
    from .rollout.prompt_sources import RolloutFailed
    from .mcore import MegatronCoreMissing
    from .runner.peers import PeerLost
    from .runner.checkpoint import SaveFailed
    from .runner.preempt import Preempted
    from .step.routing_replay import BadRoutes

    try:
        run(cfg, finish=finish_run)
    except ConfigError as e:  # raised by every rank alike (runtime layout, checkpoint layout)
        return _report(args.config, e)
    except MegatronCoreMissing as e:  # every rank alike, before any process group exists
        _say_once(str(e))
        return EXIT_CONFIG
    except NonFiniteStop:  # raised by every rank alike, after rank 0 printed why (before its peers exit)
        return EXIT_NONFINITE
    except PeerLost:  # the rank that said which rank stopped answering has printed it
        return EXIT_PEER_LOST
    except Preempted:  # rank 0 printed where the checkpoint is
        return EXIT_PREEMPTED
    except SaveFailed:  # rank 0 printed which file, why and the free space
        return EXIT_SAVE_FAILED
    except RolloutFailed:  # rank 0 printed the engine's error
        return EXIT_ROLLOUT_FAILED
    except BadRoutes as e:  # the sampler's MoE routes disagree with the model; the same on every rank
        _say_once(str(e))
        return EXIT_ROLLOUT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
