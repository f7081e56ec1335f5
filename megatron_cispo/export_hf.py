"""Export a checkpoint of a Hugging Face run as a model directory that transformers, vLLM and SGLang load.

    python -m megatron_cispo.export_hf runs/hf_qwen2_tiny runs/qwen2_trained             # newest complete checkpoint
    python -m megatron_cispo.export_hf runs/hf_qwen2_tiny runs/qwen2_step10 --step 10    # that step's

One process (not torchrun), whatever layout saved the checkpoint: the run's config.yaml (kept in the
checkpoint) is read with every parallel size set to 1, the model is built from model.hf_path's
config.json (no weights read: the source's weights may be gone), its state loaded from the checkpoint
(dist_checkpointing reshards it), and OUT written as run.export_hf writes run_dir/hf/step_<N>/
(hf/export.py; the tokenizer files model.hf_path still has are copied). The whole model is held in
CPU memory, twice while writing. OUT must lie outside model.hf_path, and an existing OUT is replaced
only if it is an export (hf/export.check_out).
Exit codes: 0 written; 2 bad input, 6 OUT could not be written (a full disk): one line on stderr, and
nothing written (an existing OUT is left as it was).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .config import ConfigError

EXIT_BAD_INPUT = 2
EXIT_SAVE_FAILED = 6  # as megatron_cispo.train's
SINGLE = ["parallelism.tp=1", "parallelism.pp=1", "parallelism.vp=null", "parallelism.cp=1", "parallelism.ep=1",
          "parallelism.sequence_parallel=false"]


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint to export: --step's, or the newest one that checkpoint_files.verify passes."""
    from .runner import checkpoint_files as files_

    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {run_dir}: no such directory")
    if step is not None:
        path = files_.step_dir(run_dir, step)
        if not path.is_dir():
            have = ", ".join(str(files_.step_of(p)) for p in files_.complete(run_dir)) or "none"
            raise ConfigError(f"--step {step}: {path} does not exist (complete checkpoints: steps {have})")
        why = files_.verify(path)
        if why is not None:
            raise ConfigError(f"--step {step}: the checkpoint is unusable, {why}")
        return path
    for path in reversed(files_.step_dirs(run_dir)):
        if files_.verify(path) is None:
            return path
    raise ConfigError(f"{files_.root(run_dir)}: no complete checkpoint (the run writes them every "
                      "run.checkpoint_interval steps)")


def _config(path: Path):
    """The run's experiment config, on one process; ConfigError for a run that is not an HF run."""
    from .runner import checkpoint_files as files_
    from .runner.experiment import load_experiment

    if files_.read_config(path) is None:
        raise ConfigError(f"{path}: no {files_.CONFIG} (written before checkpoints held the run's config)")
    cfg = load_experiment(path / files_.CONFIG, SINGLE)
    if cfg.model.hf_path is None:
        raise ConfigError(f"{path / files_.CONFIG}: model.hf_path is not set; only a run of a Hugging Face model "
                          "exports (the synthetic GPT has no HF architecture)")
    return cfg


def export(run_dir, out, *, step: int | None = None) -> tuple[Path, int]:
    """Write OUT from RUN_DIR's checkpoint; returns (checkpoint, its step). ConfigError for bad input."""
    from .hf.export import check_out
    from .runner.export import export_chunks
    from .runner import checkpoint, distributed
    from .runner.cpu_compat import import_megatron_core
    from .runner.model import build_model

    run_dir, out = Path(run_dir), Path(out)
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError("export_hf runs in one process: start it with python -m, not torchrun")
    import_megatron_core()  # verify() reads dist_checkpointing's metadata
    path = _checkpoint(run_dir, step)
    cfg = _config(path)
    try:
        check_out(out, cfg.model.hf_path)
    except ValueError as e:
        raise ConfigError(f"OUT {e}") from None
    # a one-process group still listens on MASTER_PORT: a free one, so that exports (and a training
    # job) on the same machine do not collide on the default 29500
    os.environ.setdefault("MASTER_PORT", str(distributed.free_port()))
    distributed.init_distributed(seed=cfg.run.seed)
    try:
        chunks = build_model(cfg.model, tp=1, pp=1, wrap_ddp=False, load_weights=False)
        done = checkpoint.load_model(path, chunks=chunks)
        export_chunks(chunks, cfg.model.arch, out, step=done)
    finally:
        distributed.shutdown()
    return path, done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_cispo.export_hf", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="the run's directory (holds checkpoints/)")
    ap.add_argument("out", help="the Hugging Face directory to write (an earlier export there is replaced whole)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    args = ap.parse_args(argv)
    from .mcore import MegatronCoreMissing
    from .runner.checkpoint_save import SaveFailed

    try:
        path, step = export(args.run_dir, args.out, step=args.step)
    except (ConfigError, MegatronCoreMissing) as e:
        print(f"export_hf: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except SaveFailed as e:
        print(f"export_hf: {e}", file=sys.stderr, flush=True)
        return EXIT_SAVE_FAILED
    print(f"wrote {args.out} from {path} (step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
