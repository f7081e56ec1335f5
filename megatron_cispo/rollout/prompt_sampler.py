"""The prompt sampler: data.prompts sampled by the engine (vLLM) on the trainer's synced weights, scored by
data.reward. Its weights side is prompt_weights.py, its async side prompt_async.py, its held-out
evaluation prompt_eval.py.

    sampler = PromptSampler(cfg, rank=env.rank, device=env.device)   # every rank
    sampler.push(version, chunks)                                      # after each step: the new version
    batch = sampler.rollouts(step)                                     # collective: rank 0 samples, all get it

Rank 0 runs vLLM in its own process (rollout/vllm_engine.py; rollout.engines > 1: replica k beside node k %
nodes' first rank, rollout/node_engines.py) and the reward in another (rollout/rewards.py); the global batch
is broadcast to every rank, which keeps its DP shard. Step t samples with policy version max(0, t -
rollout.staleness), loaded into the running engine (prefix cache reset) whenever the version changes.
rollout.sync=stream streams it in named buckets from one rank per stage (rollout/weight_stream.py) through
vLLM's weight-transfer API; the lagged versions are kept sharded, each rank its own shards, in the parameters'
dtype, and so are they in checkpoints. rollout.sync=disk gathers every version whole on rank 0 and writes it
as an fp32 HF directory (hf/export.py) for vLLM to reload. Every rank advances the prompt stream alike
(rollout.filter_groups' refills: rank 0 alone), and the checkpoint holds rank 0's position, so a resumed run
continues the stream exactly. A sample whose reward failed is left out of the loss.

rollout.mode=async: rank 0 generates and scores the next steps' batches on a thread (rollout/async_feed.py)
while the trainer trains; push() streams each new version into the engine at once, between two
generations, and keeps no versions. Only rank 0 takes prompts; its checkpoint holds the position after
the last batch trained (or dropped), so batches in flight at a stop are generated again on resume, with
the checkpoint's weights: none lost, none trained twice.
"""
from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..base.console import say
from .engine import Sampling
from .node_engines import NodeHosts, open_node_pool
from .prompt_sources import Sources, _pause_for_tests, _seed, eos_ids, open_prompts, rows_to_batch
from .prompt_async import PromptAsync
from .prompt_eval import PromptEval
from .prompt_weights import EngineWeights
from .sampler import Batch, Sampler
from .vllm_options import engine_len


def rollout_wait_group(dist_timeout_s: float, reward_budget_s: Optional[float]):
    """Collective (every rank, at once): with data.reward_budget_s, the process group in which the other
    ranks wait for rank 0's batch, its timeout run.dist_timeout_s plus that budget, so that scoring may
    outlast the trainer's collective timeout; gloo, on the host (the batch travels as a pickled object
    either way). None (the default group) without a budget or on one rank."""
    if reward_budget_s is None or not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=dist_timeout_s + reward_budget_s))


class PromptSampler(EngineWeights, PromptAsync, PromptEval, Sampler):
    def __init__(self, cfg, *, rank: int, device: torch.device | str = "cpu", sources: Optional[Sources] = None):
        """sources: data.prompts and data.eval_prompts as check_sources read them (read here when None)."""
        super().__init__(cfg.model, cfg.rollout, seed=cfg.run.seed, device=device)
        if sources is None:
            sources = Sources(open_prompts(cfg), open_prompts(cfg, held_out=True) if cfg.data.eval_prompts else None)
        self.stream, self.held_out = sources.prompts, sources.eval
        self.eos = eos_ids(cfg.model.hf_path)
        self.reward = self.eval_reward = None  # rank 0: the RewardRunners (training, data.eval_prompts)
        # Rank 0 samples while the other ranks wait in the batch's broadcast, which fails after
        # run.dist_timeout_s: each engine call may take half of it, a step's rollout 90% in all; with
        # data.reward_budget_s the scoring has that budget and the wait a group whose timeout adds it.
        self.limit_s = 0.9 * cfg.run.dist_timeout_s
        self.reward_budget_s = cfg.data.reward_budget_s
        self._init_weights(cfg, rank, rollout_wait_group(cfg.run.dist_timeout_s, self.reward_budget_s))
        # rollout.engines > 1, local placement: replica k on node k % nodes, hosted there by its first rank
        spread = cfg.rollout.placement == "local" and cfg.rollout.engines > 1
        self.hosts = NodeHosts.open(cfg.rollout.engines) if spread else None
        self.log = Path(cfg.run.run_dir) / "vllm.log"    # the engine process's output (appended on a resume)
        self._tmp = Path(cfg.run.run_dir) / "vllm_weights"  # the synced version vLLM reloads (rank 0)
        self.feed = None  # rollout.mode=async, rank 0: the AsyncFeed generating ahead
        self._pushed: tuple[dict, Optional[str]] = ({}, None)  # async: the last push's metrics, or its failure
        self._trained_prompts: Optional[dict] = None  # async, rank 0: the stream's state after the last batch taken
        self._dropped_said = False
        if rank == 0 and self.cfg.sync == "disk":
            shutil.rmtree(self._tmp, ignore_errors=True)  # a killed run's export
            self._tmp.mkdir(parents=True)

    # -- rank 0 ---------------------------------------------------------------------------------------
    def _scores(self, prompts, completions, budget_s: float, group: Optional[int] = None,
                held_out: bool = False) -> tuple[list, dict]:
        """data.reward of `completions` (`group` per prompt, default rollout.group_size): (rewards, None where
        one failed; the step's reward/ counts), the first failure said in one line. held_out: the eval's own
        reward worker (in async mode the feed's thread scores with the other meanwhile)."""
        from .rewards import RewardRunner

        name = "eval_reward" if held_out else "reward"
        if getattr(self, name) is None:
            setattr(self, name, RewardRunner(self.exp.data.reward, timeout_s=self.exp.data.reward_timeout_s,
                                             workers=self.exp.data.reward_workers))
        runner = getattr(self, name)
        g = group or self.cfg.group_size
        records = [p.record for p in prompts for _ in range(g)]
        ids = [c.token_ids for c in completions]
        t0 = time.perf_counter()
        res = runner.score(records, [self.stream.decode(i) for i in ids], ids,
                           finish_reasons=[c.finish_reason for c in completions], budget_s=budget_s)
        if res.first_failure:
            say(f"[{self.exp.label}] reward: {res.errors} errors, {res.timeouts} timeouts, {res.non_numbers} "
                f"non-numbers, {res.budget_cut} not scored within the step's budget (those samples are left out of "
                f"the loss); first: {res.first_failure}")
        return res.rewards, {"reward/errors": float(res.errors), "reward/timeouts": float(res.timeouts),
                             "reward/budget_cut": float(res.budget_cut), "reward/non_numbers": float(res.non_numbers),
                             "reward/seconds": time.perf_counter() - t0}

    def _start_engine(self, model_dir: str, stream: bool) -> dict:
        """Rank 0: rollout.engine started on model.hf_path's family, fed by update_weights (stream), or
        (rollout.sync=disk) vLLM on the export `model_dir`."""
        from .engine import EngineStart, engine_spec
        from .placement import replica_gpus
        from .vllm_engine import VLLMEngine, gpus_here

        r = self.cfg
        options = {k: v for k, v in r.vllm.items() if k != "max_model_len"}  # rollout.vllm, checked at --check
        gpus = replica_gpus(r)  # replica k's GPU (rollout.engine_gpus), None: as the trainer's
        hosts = self.hosts or NodeHosts(1, {}, None)
        if hosts.nodes > 1:
            say("rollout.engines: " + ", ".join(f"replica {k} on {hosts.where(k)}" for k in range(r.engines)))
        here = [k for k in range(r.engines) if not hosts.node_of(k)]  # rank 0's node's replicas: checked here and
        placed = gpus_here([gpus[k] for k in here], here)  # said in one line (the others' by their hosts, at start)
        if placed:
            say(placed)
        start = EngineStart(model=self.model_cfg, precision=r.precision, seed=self.seed,
                            max_model_len=engine_len(r.vllm, self.model_cfg.seq_length),
                            kept_sets=r.top_k > 0 or r.top_p < 1, log_path=str(self.log),
                            start_timeout_s=self.limit_s / 2, call_timeout_s=self.limit_s / 2, options=options,
                            gpu=gpus[0])
        if stream and r.pooled:  # replica k logs to vllm.<k>.log beside vllm.log (replica 0)
            log = lambda k: start.log_path if k == 0 else str(self.log.with_name(f"vllm.{k}.log"))  # noqa: E731
            start_of = lambda k: replace(start, log_path=log(k), gpu=gpus[k])  # noqa: E731
            spec = engine_spec(r.engine)
            if r.placement == "ray":  # GPU bundles where the trainer has CUDA: the engines need GPUs there too
                from .ray_engines import open_ray_pool

                per_engine = int(r.vllm.get("tensor_parallel_size", 1)) if torch.cuda.is_available() else 0
                self.engine_ = open_ray_pool(spec, start_of, r.engines, address=r.ray_address, gpus_per_engine=per_engine,
                                             on_death=r.on_engine_death, timeout_s=start.start_timeout_s)
            else:
                self.engine_ = open_node_pool(spec, start_of, r.engines, hosts, on_death=r.on_engine_death)
        elif stream:
            self.engine_ = engine_spec(r.engine).open(start)
        else:
            self.engine_ = VLLMEngine(model_dir, precision=r.precision, seed=self.seed, max_model_len=start.max_model_len,
                                      kept_sets=start.kept_sets, start_timeout_s=start.start_timeout_s,
                                      call_timeout_s=start.call_timeout_s, log_path=start.log_path, engine_kwargs=options,
                                      gpu=start.gpu)
        return {"rollout/engine_start_s": getattr(self.engine_, "start_seconds", 0.0)}

    def _sample(self, step: int, prompts, info: Optional[dict] = None) -> Batch:
        start = time.perf_counter()
        version = self._held_version(step)
        info = dict(info) if info is not None else self._engine_at(version)
        return self._scored(self._generate(step, prompts), version, info, start)

    def _generate(self, index: int, prompts) -> tuple:
        """vLLM's samples of `prompts` (batch `index`: the 0-based step, or async's index): (prompts, completions, seconds)."""
        r, g = self.cfg, self.cfg.group_size
        _pause_for_tests(self.exp.run.run_dir, "generate", index)
        t0 = time.perf_counter()
        out = self.engine_.generate([p.token_ids for p in prompts], Sampling(
            n=g, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
            seeds=[_seed(self.seed, p.index, g) for p in prompts], stop_token_ids=self.eos))
        return prompts, [c for per_prompt in out for c in per_prompt], time.perf_counter() - t0

    def _groups(self, generated: tuple, info: dict, start: float) -> list:
        """_generate's samples scored by data.reward within what is left of the step's limit, as groups;
        the reward's counts and the generation time are added to info."""
        from .group_filter import Group

        prompts, completions, seconds = generated
        g = self.cfg.group_size
        budget = self.reward_budget_s or max(1.0, self.limit_s - (time.perf_counter() - start))
        rewards, scored = self._scores(prompts, completions, budget)
        for k, v in {**scored, "rollout/seconds": seconds}.items():
            info[k] = info.get(k, 0.0) + v
        return [Group(p, completions[i * g:(i + 1) * g], rewards[i * g:(i + 1) * g]) for i, p in enumerate(prompts)]

    def _scored(self, generated: tuple, version: int, info: dict, start: float, engine=contextlib.nullcontext) -> Batch:
        """The batch of _generate's samples, scored; rollout.filter_groups: the groups without signal
        dropped and refilled (rollout/group_filter.py), each refill generated with `engine()` held."""
        from .group_filter import refill, zero_signal_frac

        groups = self._groups(generated, info, start)
        info["rollout/zero_signal_group_frac"] = zero_signal_frac(groups)  # before any filter
        if self.cfg.filter_groups:
            def more(n: int) -> list:
                with engine():
                    again = self._generate(-1, self.stream.take(n))
                return self._groups(again, info, start)
            groups, counts = refill(groups, more, want=self.cfg.prompts_per_step, max_rounds=self.cfg.filter_max_rounds)
            info.update(counts)
        if hasattr(self.engine_, "info"):  # rollout.engines > 1: the prompts each replica served
            info.update(self.engine_.info())
        rows = [(gr.prompt.token_ids, c) for gr in groups for c in gr.completions]
        info["rollout/prompt_index_first"] = float(groups[0].prompt.index)
        return rows_to_batch(rows, [r for gr in groups for r in gr.rewards], group_size=self.cfg.group_size,
                             version=version, info=info)

    # -- every rank -----------------------------------------------------------------------------------
    def rollouts(self, step: int) -> Batch:
        """Collective: the global batch of 0-based `step`, sampled on rank 0 and broadcast."""
        box: list = [None]
        if self.cfg.mode == "async":
            if self.rank == 0:
                try:
                    box[0] = self._take_async(step)
                except Exception as e:  # noqa: BLE001 - the engine, the reward or a push failed: every rank stops
                    box[0] = f"[{self.exp.label}] rollout at step {step + 1} failed: {e}"
            return self._share(box)
        prompts = self.stream.take(self.cfg.prompts_per_step)  # every rank alike: the position is checkpointed
        info, error = None, None
        if self.cfg.sync == "stream":
            version = self._held_version(step)
            info, error = self._stream_to_engine(version) if self.loaded != version else \
                ({"sync/seconds": 0.0, "sync/bytes": 0.0}, None)
        if self.rank == 0:
            try:
                if error:
                    raise RuntimeError(error)
                box[0] = self._sample(step, prompts, info)
            except Exception as e:  # the engine or the export failed: every rank must stop, not wait
                box[0] = f"[{self.exp.label}] rollout at step {step + 1} failed: {e}"
        return self._share(box)

    def state_dict(self) -> dict:
        """The prompt position (async: after the last batch trained); with rollout.sync=disk also rank 0's
        whole versions (sync=stream: none)."""
        versions = self.versions if self.cfg.sync == "disk" else {}
        prompts = self._trained_prompts if self._trained_prompts is not None else self.stream.state_dict()
        return {"versions": versions, "prompts": prompts}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._versions_in_checkpoint = bool(state["versions"])  # alike on every rank: all read one file
        if self.rank != 0:
            self.versions = {}  # every rank read rank 0's state; only rank 0 samples from it
        if "prompts" not in state:
            raise ValueError("the checkpoint's sampler has no prompt position (it ran the synthetic task); "
                             "resume it without data.prompts, or start a fresh run_dir")
        self.stream.load_state_dict(state["prompts"])
        self._trained_prompts = None
        self.loaded = None  # the engine reloads the checkpoint's weights before it samples again

    def close(self) -> None:
        if self.feed is not None:  # first: a generation under way ends with the engine's process
            self.feed.close(kill=self.engine_.kill if self.engine_ is not None else None)
            self.feed = None
        for part in (self.engine_, self.reward, self.eval_reward, self.hosts):
            if part is not None:
                part.close()
        self.engine_ = self.reward = self.eval_reward = self.hosts = None
        if self.rank == 0 and self.cfg.sync == "disk":
            shutil.rmtree(self._tmp, ignore_errors=True)
