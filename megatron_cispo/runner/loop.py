"""The trainer loop of the fully-async demo: sample (stale), one policy step, weight sync, log.

    run(load_experiment("yaml_configs/demo_cpu.yaml"))   # under torchrun, via megatron_cispo.train

Each step t: the sampler produces the global batch with policy version max(0, t - staleness);
this rank trains on its DP shard with exactly one optimizer step (policy_step); the trainer's
new weights go to the sampler as version t + 1 (`sampler.push`: streamed to vLLM in buckets, or gathered).
A step whose loss or gradient is non-finite is skipped by policy_step on every rank; after
run.max_consecutive_skips of them in a row the run stops with NonFiniteStop. On SIGTERM, SIGINT
(Ctrl-C) or SIGHUP every rank finishes the step, a checkpoint is written and the run stops with
Preempted (runner/preempt.py); a failed rollout engine stops the run with RolloutFailed; a rank that stops answering is named by PeerLost (runner/peers.py,
gloo). A resume checks the checkpoint's config against this one (runner/resume_check.py).
With run.export_hf the model is written as a Hugging Face directory (hf/export.py) after every
checkpoint and at the end; run.steps=0 exports the loaded model and trains nothing.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError
from . import checkpoint, checkpoint_files, peers, preempt, resume_check, rundir
from .experiment import ExperimentConfig, dump_yaml
from ..step.policy_step import NONFINITE_CHECKS
from .metrics import MetricsWriter, headline, say
from ..rollout.prompt_sampler import PromptSampler
from ..rollout.prompt_sources import RolloutFailed, check_sources
from ..rollout.task_sampler import TaskSampler


class NonFiniteStop(RuntimeError):
    """run.max_consecutive_skips optimizer steps in a row were skipped for a non-finite loss or
    gradient; raised alike on every rank (policy_step's metrics are global) after rank 0 has
    printed the message, one line, to stderr."""


def _set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _record(step: int, batch, metrics: dict, cfg: ExperimentConfig, lr: float, dt: float, elapsed: float) -> dict:
    scored = ~batch.rewards.isnan()  # a prompt-file reward that failed is NaN (not scored, not in the loss)
    rec = {"step": step + 1, "reward_mean": batch.rewards[scored].mean().item(),
           "exact_match": (batch.rewards[scored] == 1).float().mean().item(),  # 1 only for an exact answer
           "position_acc": batch.correct.float().mean().item(),
           **headline(metrics, cfg.loss.policy_loss),
           "policy_version_lag": step - batch.version, "sampler_version": batch.version, "lr": lr}
    versions = batch.sample_versions if batch.sample_versions is not None else torch.full((1,), batch.version)
    lag = step - versions  # per sample: how many optimizer steps the trainer is past the weights that made it
    rec.update({"rollout/lag_mean": lag.double().mean().item(), "rollout/lag_max": int(lag.max())})
    rec["tokens_per_s"] = rec.get("tokens", 0.0) / dt
    rec.update({"step_time_s": dt, "elapsed_s": elapsed})
    rec.update(batch.info)  # the sampler's own: vLLM's sync, rollout and reward figures
    rec.update(sorted(metrics.items()))
    return rec


def _stop_message(cfg: ExperimentConfig, step: int, skips: int, metrics: dict) -> str:
    cause = next((k for k in NONFINITE_CHECKS if metrics.get(f"step/nonfinite_{k}")), "loss or gradient")
    last = step + 1 - skips
    return (f"[{cfg.label}] stopped at step {step + 1}: {skips} optimizer steps in a row were skipped because of "
            f"non-finite {cause} (run.max_consecutive_skips={cfg.run.max_consecutive_skips}); the "
            f"weights are {f'those after step {last}' if last else 'the initial ones'}. Check the rewards, "
            f"advantages and model, lower optimizer.lr, or raise run.max_consecutive_skips")


@dataclass
class _Trainer:
    """What set-up builds for the steps: this rank's model chunks, optimizer, sampler and DP shard."""

    cfg: ExperimentConfig
    env: Any  # runner.distributed's Env: rank, world_size, device, backend, health, timeout_s
    chunks: list
    optimizer: Any
    sampler: Any  # TaskSampler or PromptSampler
    step_cfg: Any
    dp_rank: int
    dp: int
    writer: Optional[MetricsWriter] = None  # rank 0 only
    finish: Optional[Callable] = None  # rank 0's end of a run that trained (run's finish=)


def run(cfg: ExperimentConfig, *, finish: Optional[Callable] = None) -> None:
    """Run the experiment in this process (one rank of the job); collective over the world. finish:
    rank 0's end of a run that trained, finish(cfg, run_dir, seconds) (train.py: demo/report.py's summary
    and figure).

    Raises ConfigError (the same on every rank) for a layout or checkpoint that cannot be used,
    and NonFiniteStop (likewise) after run.max_consecutive_skips skipped steps in a row, Preempted
    (likewise) after SIGTERM, SIGINT or SIGHUP, SaveFailed (likewise) when a checkpoint could not be
    written, PeerLost when a rank stopped answering (gloo).
    """
    if cfg.model.dtype == "bf16" and not torch.cuda.is_available():
        raise ConfigError("model.dtype: 'bf16' needs CUDA (megatron's mixed-precision optimizer wraps only "
                          "CUDA tensors); use fp32 on CPU. rollout.precision=bf16 still gives a bf16 sampler")
    if cfg.model.hf_path is not None:  # what config.json alone cannot show (--check passed), before anything is written
        from ..hf.load import check_weights

        try:
            check_weights(cfg.model.arch)  # the safetensors headers: every tensor present, with its shape
        except ValueError as e:
            raise ConfigError(f"model.hf_path: {e}") from None
    try:  # rollout.engine=vllm: vLLM installed, data.prompts readable (kept for the sampler), data.reward importable
        prompts = check_sources(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from . import distributed

    # from here a signal stops the run after a step, with a checkpoint; after SIGHUP the console is run_dir/console.log
    preempt.install(console_log=Path(cfg.run.run_dir) / "console.log")
    try:
        env = _init_distributed(cfg)
    except BaseException:
        preempt.uninstall()
        raise
    owned = trainer = None
    try:
        # Before anything is written: one job per run_dir, and a fresh run never mixes with an old one.
        owned = rundir.claim_for_job(cfg.run.run_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite,
                                     has_checkpoint=lambda d: checkpoint.last_complete(d) is not None)
        trainer = _set_up(cfg, env, prompts)
        start, last = _resume(trainer)
        if env.rank == 0:
            trainer.writer = _open_log(trainer, start, last, owned.moved_to)
        trainer.finish = finish
        _train(trainer, start)
    except RuntimeError as e:  # a collective timed out: name the rank that stopped answering
        stopped = (NonFiniteStop, preempt.Preempted, checkpoint.SaveFailed, peers.PeerLost, RolloutFailed)
        if not isinstance(e, stopped) and not preempt.requested():
            peers.explain_lost_peer(e, env.health, rank=env.rank, timeout_s=env.timeout_s)
        raise
    finally:
        preempt.uninstall()
        if trainer is not None:
            trainer.sampler.close()  # vLLM's and the reward's processes
        if owned is not None:
            owned.release()
        distributed.shutdown()


def _init_distributed(cfg: ExperimentConfig):
    """Collective: the process groups, after every rank has checked that it resolved the same config."""
    from . import distributed

    p = cfg.parallelism
    try:
        return distributed.init_distributed(tp=p.tp, pp=p.pp, vp=p.vp, cp=p.cp, ep=p.ep, seed=cfg.run.seed,
                                            timeout_s=cfg.run.dist_timeout_s, config_text=dump_yaml(cfg))
    except ConfigError:  # the config differs across ranks; it names the keys
        raise
    except ValueError as e:  # a layout this runtime cannot run; raised identically on every rank
        raise ConfigError(f"parallelism: {e}") from e


def _set_up(cfg: ExperimentConfig, env, prompts=None) -> _Trainer:
    """Build this rank's model chunks (seeded by run.seed, the same on every layout), optimizer and sampler."""
    from megatron.core import parallel_state as mpu

    from .model import build_model, build_optimizer
    from ..step import StepConfig

    p, o = cfg.parallelism, cfg.optimizer
    torch.manual_seed(cfg.run.seed)
    chunks = build_model(cfg.model, tp=p.tp, pp=p.pp, vp=p.vp, cp=p.cp, ep=p.ep,
                         sequence_parallel=p.sequence_parallel, seed=cfg.run.seed, distributed_optimizer=o.distributed)
    optimizer = build_optimizer(chunks, lr=o.lr, optimizer=o.name, weight_decay=o.weight_decay,
                                clip_grad=o.clip_grad, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
                                bf16=cfg.model.dtype == "bf16", distributed=o.distributed)
    if prompts is None:  # the synthetic task (an engine without prompt files: rollout/engine.py)
        sampler = TaskSampler(cfg, rank=env.rank, device=env.device)
    else:  # data.prompts, as run() read and checked it
        sampler = PromptSampler(cfg, rank=env.rank, device=env.device, sources=prompts)
    step_cfg = StepConfig(micro_batch_size=p.micro_batch_size, temperature=cfg.rollout.temperature,
                          max_tokens_per_microbatch=p.max_tokens_per_microbatch)
    return _Trainer(cfg=cfg, env=env, chunks=chunks, optimizer=optimizer, sampler=sampler, step_cfg=step_cfg,
                    dp_rank=mpu.get_data_parallel_rank(), dp=mpu.get_data_parallel_world_size())


def _resume(t: _Trainer):
    """Collective: (first step, checkpoint resumed from or None). Loads the newest intact checkpoint
    with run.resume, on any layout (dist_checkpointing reshards the model and optimizer); otherwise
    the sampler receives the initial weights as policy version 0."""
    last = checkpoint.resume_point(t.cfg.run.run_dir) if t.cfg.run.resume else None  # verified, or the one before
    if last is None:
        t.sampler.push(0, t.chunks)
        return 0, None
    # Every rank reads the same file (run_dir is shared), so a refusal is the same ConfigError everywhere.
    changes = resume_check.resume_changes(checkpoint_files.read_config(last), t.cfg, path=last)
    start = checkpoint.load(last, chunks=t.chunks, optimizer=t.optimizer, shared={"sampler": t.sampler})
    t.sampler.resumed(start, t.chunks)
    if changes and t.env.rank == 0:
        say(resume_check.changed_settings_warning(last, changes, start))
    return start, last


def _open_log(t: _Trainer, start: int, last, moved_to) -> MetricsWriter:
    """Rank 0: the metrics writer, run_dir/config.yaml, and the line saying what runs where."""
    cfg, p, env = t.cfg, t.cfg.parallelism, t.env
    writer = MetricsWriter(cfg.run.run_dir, label=cfg.label, total_steps=cfg.run.steps,
                           log_interval=cfg.run.log_interval, start_step=start, tensorboard=cfg.run.tensorboard)
    _record_config(writer.dir, dump_yaml(cfg), start)
    resumed = f", resumed from {last}" if last is not None else ""
    if moved_to is not None:
        resumed += f"; the earlier run in {cfg.run.run_dir} was moved to {moved_to}"
    lag = "at most " if cfg.rollout.mode == "async" else ""
    cp_ep = (f" x cp {p.cp}" if p.cp > 1 else "") + (f" (ep {p.ep})" if p.ep > 1 else "")
    say(f"[{cfg.label}] world {env.world_size} = tp {p.tp} x pp {p.pp} x dp {t.dp}{cp_ep} on {env.backend}; "
        f"{cfg.run.steps} steps, sampler lags {lag}{cfg.rollout.staleness} versions in "
        f"{cfg.rollout.precision}{resumed}", sys.stdout)
    return writer


_HISTORY_NAME = re.compile(r"start_(\d+)_at_step_\d+\.yaml")


def _record_config(run_dir, text: str, start: int) -> None:
    """run_dir/config.yaml is this start's config; config_history/start_<n>_at_step_<start>.yaml keeps
    every start's, each written once ("x": never over an earlier one)."""
    (run_dir / "config.yaml").write_text(text)
    history = run_dir / "config_history"
    history.mkdir(exist_ok=True)
    # a name this code did not write (start_x_..., a copy) does not count: it must not stop the run
    starts = (_HISTORY_NAME.fullmatch(p.name) for p in history.iterdir())
    n = 1 + max((int(m[1]) for m in starts if m), default=0)
    with open(history / f"start_{n:03d}_at_step_{start:06d}.yaml", "x") as f:
        f.write(text)


def _train(t: _Trainer, start: int) -> None:
    """Collective: steps start .. run.steps - 1, each followed by the stopping checks; rank 0 finishes the log."""
    cfg = t.cfg
    t_start, skips = time.perf_counter(), 0
    if cfg.data.eval_prompts and start == 0 and cfg.run.steps > 0:  # the weights training starts from
        evaluated = t.sampler.evaluate(0)
        if t.writer is not None:
            t.writer.log({"step": 0, **evaluated, "elapsed_s": time.perf_counter() - t_start})
    for step in range(start, cfg.run.steps):
        t0 = time.perf_counter()
        batch, metrics, lr = _step(t, step)
        if _eval_due(cfg, step + 1):
            metrics = {**metrics, **t.sampler.evaluate(step + 1)}
        if t.writer is not None:
            now = time.perf_counter()
            t.writer.log(_record(step, batch, metrics, cfg, lr, now - t0, now - t_start))
        skips = skips + 1 if metrics["step/skipped_nonfinite"] else 0
        if cfg.run.max_consecutive_skips and skips >= cfg.run.max_consecutive_skips:
            _stop(t, NonFiniteStop(_stop_message(cfg, step, skips, metrics)))
        _checkpoint_or_preempt(t, step)
        del batch  # else the next step samples and trains beside this global batch (runner/memory_plan.py)
    end, ckpt = max(start, cfg.run.steps), cfg.run.checkpoint_interval  # end: the weights' step
    if cfg.run.export_hf and not (start < end and ckpt and end % ckpt == 0):
        try:  # the last step's export, unless its checkpoint just wrote it (run.steps=0: the loaded model)
            _export_hf(t, end)
        except checkpoint.SaveFailed as e:
            _stop(t, e)
    if t.writer is not None:
        t.writer.close()
        if cfg.run.steps == 0:  # nothing trained: no metrics to summarise
            say(f"[{cfg.label}] run.steps=0: wrote {hf_dir(cfg.run.run_dir, end)}", sys.stdout)
        else:
            seconds = time.perf_counter() - t_start
            if t.finish is not None:
                t.finish(cfg, t.writer.dir, seconds)
            else:
                say(f"[{cfg.label}] done in {seconds:.0f}s; wrote {t.writer.dir}/metrics.jsonl", sys.stdout)


def _eval_due(cfg: ExperimentConfig, done: int) -> bool:
    """Whether the weights after `done` steps are evaluated (data.eval_prompts, run.eval_interval, the last step)."""
    every = cfg.run.eval_interval
    return bool(cfg.data.eval_prompts) and (done == cfg.run.steps or (every > 0 and done % every == 0))


def hf_dir(run_dir, step: int) -> Path:
    """Where run.export_hf writes the model after `step` optimizer steps: run_dir/hf/step_<step>/."""
    return Path(run_dir) / "hf" / f"step_{step}"


def _export_hf(t: _Trainer, step: int) -> None:
    """Collective: the model as a Hugging Face directory (runner/export.py); SaveFailed on every rank if not written."""
    from .export import export_chunks

    export_chunks(t.chunks, t.cfg.model.arch, hf_dir(t.cfg.run.run_dir, step), step=step,
                  bucket_bytes=t.cfg.rollout.sync_bucket_bytes)


def _step(t: _Trainer, step: int):
    """Collective: sample the global batch, one policy step on this rank's DP shard, weight sync;
    returns (batch, metrics, lr)."""
    from ..step import Rollouts, policy_step

    lr = t.cfg.optimizer.lr_at(step, t.cfg.run.steps)
    _set_lr(t.optimizer, lr)
    batch = t.sampler.rollouts(step)
    if batch.info.get("rollout/filter_short_groups") == t.cfg.rollout.prompts_per_step:  # filter_groups: no signal
        t.sampler.push(step + 1, t.chunks)  # the weights unchanged: Adam's momentum alone would move them
        return batch, {"step/skipped_no_signal": 1.0, "step/skipped_nonfinite": 0.0, "step/optimizer_steps": 0.0}, lr
    # One minibatch per step, so this is the contiguous split of the batch over DP.
    shard = Rollouts(**batch.rollout_fields()).dp_shard(dp_rank=t.dp_rank, dp=t.dp, minibatches=1)
    local = Rollouts(**{k: v.to(t.env.device) for k, v in shard.select(slice(None)).items()})
    metrics = policy_step(t.chunks, t.optimizer, local, t.cfg.loss, t.step_cfg, vocab_size=t.cfg.model.vocab_size,
                          pg_collection=t.env.groups)
    t.sampler.push(step + 1, t.chunks)  # the explicit weight sync (rollout.sync)
    return batch, metrics, lr


def _checkpoint_or_preempt(t: _Trainer, step: int) -> None:
    """Collective: a checkpoint after step `step` every run.checkpoint_interval steps, and when any
    rank has been signalled (then Preempted); SaveFailed when the checkpoint could not be written."""
    cfg = t.cfg
    signum = preempt.agreed(t.env.device)  # a signal on any rank: all stop after this step
    saved = None
    if signum or cfg.run.checkpoint_interval and (step + 1) % cfg.run.checkpoint_interval == 0:
        if signum:
            preempt.pause_for_tests()
        try:
            saved = checkpoint.save(cfg.run.run_dir, step + 1, chunks=t.chunks, optimizer=t.optimizer,
                                    shared={"sampler": t.sampler}, keep=cfg.run.checkpoint_keep,
                                    config=dump_yaml(cfg))
            if cfg.run.export_hf:
                _export_hf(t, step + 1)
        except checkpoint.SaveFailed as e:
            _stop(t, e)
    if signum:
        _stop(t, preempt.Preempted(preempt.stop_message(cfg.label, step + 1, saved, signum)))


def _stop(t: _Trainer, error: Exception) -> None:
    """Collective: rank 0 closes the log and prints `error`'s one line; then every rank raises it."""
    if t.writer is not None:
        t.writer.close()
        say(str(error))
    if isinstance(error, NonFiniteStop):
        dist.barrier()  # the other ranks exit only after rank 0 has said why
    raise error
