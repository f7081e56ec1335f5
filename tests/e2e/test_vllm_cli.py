"""rollout.engine=vllm through the CLI: vLLM (its own process, next to rank 0) samples the shipped
add task from its JSONL on the trainer's weights, reloaded after every optimizer step; the exact-match
reward scores it; megatron trains on 2 gloo ranks.

With fp32, rollout.staleness=0 and the rollout anchor, the CISPO ratio pi_theta / pi_rollout is the
sampler/trainer mismatch itself, so every step's ratio within 1e-4 of 1 shows that each sync reached
the engine and its prefix cache was reset (a stale engine or cache gives ratios far from 1). The
weights are streamed (rollout.sync=stream) in buckets small enough to take at least 10 per sync:
on dp 2 (tied model), on tp 2 with sequence parallelism (untied, top_p: the trainer scores over
vLLM's kept sets) and on pp 2 with staleness 1, where the ratio is off 1 and every step equals the
disk fallback's (rollout.sync=disk), which shows the lagged versions kept as shards are the right ones.
A run killed (SIGKILL) in a weight push, and again (resumed with rollout.mode=async) in a generation of
the batches it makes ahead, and resumed each time continues the prompt stream from its checkpoint
exactly, its vLLM process dies with it, and the new engine starts on the checkpoint's weights (the
ratio stays within 1e-4 of 1 after each resume). In async mode at staleness 1 on pp 2 no trained
sample lags more than 1, the wait fractions are reported, and the steps equal sync mode's as long as
the lags do (an engine that happens to start a batch after the next push gives it fresher weights).
Two replicas (rollout.engines=2) make one engine's batches; one killed mid-run stops the run in one line
(rollout.on_engine_death=stop) or is restarted and rejoins at the next push, the run going on (restart).
"""
import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest

from e2e_helpers import ROOT, Job, killed_after_step_2, metrics, ranks, served_per_step
from megatron_cispo.runner import checkpoint
from megatron_cispo.testing import free_port

YAML = str(ROOT / "yaml_configs" / "vllm_qwen2_tiny.yaml")
if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CISPO_REQUIRE_VLLM") == "1":
        raise RuntimeError("CISPO_REQUIRE_VLLM=1 but vLLM is not installed here: VLLM=1 bash launch/setup_env.sh")
    pytest.skip("vLLM is not installed (VLLM=1 bash launch/setup_env.sh); CI's tier 1 has it",
                allow_module_level=True)

FAST = ["rollout.precision=fp32", "rollout.staleness=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "parallelism.micro_batch_size=8", "parallelism.tp=1", "parallelism.sequence_parallel=false",
        "run.log_interval=1", "run.tensorboard=false", "run.checkpoint_interval=0", "optimizer.lr=1e-2",
        "rollout.sync_bucket_mb=0.02", "data.eval_prompts=null",  # about 20 KiB: 15 buckets of the 285 KB model
        "optimizer.schedule=constant"]  # the demo decays over its run.steps; these runs change run.steps on resume
MIN_BUCKETS = 10


# The shipped exact-match reward is 0 for nearly every sample of a random model, and a step without
# advantages leaves the weights where they were: then a sync that never arrived would pass unseen.
# This reward (a file, as data.reward may name one) differs within every group, so each step moves them.
REWARD = ("import json, os, time\n"
          "def spread(record, completion, token_ids):\n    return float(sum(token_ids) % 5)\n"
          "def slow(record, completion, token_ids):\n    time.sleep(0.4)\n    return float(sum(token_ids) % 5)\n"
          "def spread_logged(record, completion, token_ids):  # every scored record, in $SPREAD_LOG\n"
          "    with open(os.environ['SPREAD_LOG'], 'a') as f:\n        f.write(json.dumps(record['prompt']) + '\\n')\n"
          "    if record['prompt'] == '<bos>97+70<sep>':  # a held-out row: the reward fails, the run goes on\n"
          "        raise ValueError('no score for this one')\n"
          "    return float((sum(token_ids) + len(record['prompt'])) % 2 == 1)\n")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    root = tmp_path_factory.mktemp("vllm_cli")
    (root / "spread.py").write_text(REWARD)
    return make_tiny_hf("qwen2", root / "qwen2", vocab=16, heads=2, kv_heads=2, seed=3)


@pytest.fixture(scope="module")
def untied(model):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    return make_tiny_hf("qwen2", model.parent / "qwen2_untied", vocab=16, heads=2, kv_heads=2, seed=4, tie=False)


def _run(model, run_dir, *overrides, steps: int) -> list[dict]:
    reward = f"data.reward={model.parent / 'spread.py'}:spread"
    ranks(2, [YAML, f"model.hf_path={model}", f"run.run_dir={run_dir}", f"run.steps={steps}", reward, *FAST,
              *overrides], timeout=600)
    recs = metrics(run_dir)
    assert all(r["grad_norm"] > 0 for r in recs), [r["grad_norm"] for r in recs]
    return recs


def _off_one(r) -> float:
    return max(abs(r["cispo/ratio_min"] - 1), abs(r["cispo/ratio_max"] - 1))


def _engine_children(pid: int) -> list[int]:
    """The vLLM worker processes that process `pid` started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"vllm_worker" in cmd:
            found.append(int(stat.parent.name))
    return found


def test_staleness_0_fp32_ratio_is_1_every_step_through_kills_in_a_weight_push_and_in_a_generation(
        model, tmp_path, monkeypatch):
    """Killed (SIGKILL) after the first bucket of version 3's push, resumed in rollout.mode=async, killed
    again while the engine generates step 6's batch (step 5 trained beside it, its checkpoint not yet
    due), resumed to the end in async mode: one engine per launch, which dies with its trainer; no
    prompt lost or trained twice; the ratio within 1e-4 of 1 on every step, the steps after each resume
    included (the new engine has the checkpoint's weights)."""
    from megatron_cispo.rollout.prompt_sources import TEST_PAUSE_ENV

    run_dir = tmp_path / "run"
    reward = f"data.reward={model.parent / 'spread.py'}:spread"
    args = [YAML, f"model.hf_path={model}", f"run.run_dir={run_dir}", "run.steps=100000", reward, *FAST,
            "run.checkpoint_interval=2"]
    for launch, pause in enumerate(("push:3", "generate:5")):
        monkeypatch.setenv(TEST_PAUSE_ENV, pause)
        marker = run_dir / "test_paused"
        marker.unlink(missing_ok=True)
        (tmp_path / pause.replace(":", "_")).mkdir()
        job = Job(tmp_path / pause.replace(":", "_"), 2, args + (["run.resume=true", "rollout.mode=async"] if launch else []))
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():
                assert job.proc.poll() is None and time.monotonic() < deadline, job.output()[-3000:]
                time.sleep(0.2)
            engines = _engine_children(job.workers()[0])
            assert len(engines) == 1, engines
        finally:
            job.kill()  # SIGKILL: no checkpoint at exit, the last one is from a step divisible by 2
        deadline = time.monotonic() + 30  # the engine process dies with the trainer that started it
        while Path(f"/proc/{engines[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{engines[0]}").exists(), f"the vLLM child outlived the trainer killed in {pause}"
        assert int(checkpoint.last_complete(run_dir).name.split("_")[-1]) == 2 * (launch + 1)
    monkeypatch.delenv(TEST_PAUSE_ENV)
    recs = _run(model, run_dir, "run.checkpoint_interval=2", "run.resume=true", "rollout.mode=async", steps=6)
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert _off_one(r) <= 1e-4, (r["step"], r["cispo/ratio_min"], r["cispo/ratio_max"])
        assert r["policy_version_lag"] == 0 and r["sync/bytes"] > 0 and r["rollout/seconds"] > 0
        assert r["rollout/lag_max"] == 0
        assert r["sync/buckets"] >= MIN_BUCKETS, r["sync/buckets"]
    # 4 prompts a step: the stream runs on across both kills and resumes, none twice, none skipped
    assert [r["rollout/prompt_index_first"] for r in recs] == [4 * i for i in range(6)]
    assert "rollout/engine_start_s" in recs[2] and "rollout/engine_start_s" in recs[4]  # each resume's engine
    assert all("rollout/trainer_wait_frac" in r for r in recs[2:]) and "rollout/trainer_wait_frac" not in recs[1]


def test_staleness_1_on_pp2_moves_the_ratio_off_1_and_streamed_equals_disk_step_for_step(model, tmp_path):
    pp2 = ["parallelism.pp=2", "rollout.staleness=1"]
    recs = _run(model, tmp_path / "stream", *pp2, "run.checkpoint_interval=2", steps=3)
    assert [r["policy_version_lag"] for r in recs] == [0, 1, 1]
    assert _off_one(recs[0]) <= 1e-4
    assert min(_off_one(r) for r in recs[1:]) > 1e-3, [_off_one(r) for r in recs]
    assert all(r["sync/buckets"] >= MIN_BUCKETS for r in recs if r["sync/bytes"]), [r.get("sync/buckets") for r in recs]
    keys = ("cispo/ratio_min", "cispo/ratio_max", "cispo/ratio_mean", "loss", "grad_norm", "reward_mean")
    # resumed from step 2's checkpoint: its lagged version 1 comes back sharded, so step 3 samples with it again
    marker = json.loads((tmp_path / "stream" / "checkpoints" / "step_000002" / "COMPLETE").read_text())
    assert marker["sampler_lagged"] == [1]
    killed_after_step_2(tmp_path / "stream", tmp_path / "resumed")
    again = _run(model, tmp_path / "resumed", *pp2, "run.resume=true", steps=3)
    assert again[2]["policy_version_lag"] == 1
    assert all(again[2][key] == recs[2][key] for key in keys), [(again[2][k], recs[2][k]) for k in keys]
    disk = _run(model, tmp_path / "disk", *pp2, "rollout.sync=disk", steps=3)
    for a, b in zip(recs, disk):
        for key in keys:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    fed = _run(model, tmp_path / "async", *pp2, "rollout.mode=async", steps=3)
    for r in fed:
        assert 0 <= r["rollout/lag_max"] <= 1 and r["rollout/dropped_batches"] == 0, r
        assert 0 <= r["rollout/trainer_wait_frac"] and 0 <= r["rollout/engine_wait_frac"] <= 1, r
    assert fed[0]["rollout/trainer_wait_frac"] > 0.5  # step 1 waits for the first batch (and vLLM's compile)
    same = 0
    for a, b in zip(recs, fed):  # the same batches while the lags agree: async fed the right weights
        if a["policy_version_lag"] != b["policy_version_lag"]:
            break
        assert all(a[key] == b[key] for key in keys), (a["step"], [(a[k], b[k]) for k in keys])
        same += 1
    assert same >= 2, [r["policy_version_lag"] for r in fed]  # step 1 lags 0 and batch 2 is made before any push


def test_two_engines_give_one_engine_s_batches_both_serve_and_a_replica_killed_stops_the_run_in_one_line(
        model, tmp_path):
    """rollout.engines=2 (two vLLM processes, local placement), fp32, staleness 0: the same steps, bit for bit,
    as one engine (every prompt keyed by its own seed wherever it runs), the ratio within 1e-4 of 1, each
    replica serving half the prompts. Then one replica is SIGKILLed mid-run (rollout.on_engine_death=stop, the
    default): the run stops with exit 7 and one line naming the replica, and the other replica's process
    dies with it."""
    two = _run(model, tmp_path / "two", "rollout.engines=2", steps=3)
    one = _run(model, tmp_path / "one", steps=3)
    keys = ("cispo/ratio_min", "cispo/ratio_max", "loss", "grad_norm", "reward_mean")
    assert [[r[k] for k in keys] for r in two] == [[r[k] for k in keys] for r in one]
    assert all(_off_one(r) <= 1e-4 for r in two)
    assert [(r["rollout/engine0_prompts"], r["rollout/engine1_prompts"]) for r in two] == [(2, 2), (4, 4), (6, 6)]
    assert (tmp_path / "two" / "vllm.1.log").exists()
    run_dir = tmp_path / "killed"
    reward = f"data.reward={model.parent / 'spread.py'}:spread"
    (tmp_path / "job").mkdir()
    job = Job(tmp_path / "job", 2, [YAML, f"model.hf_path={model}", f"run.run_dir={run_dir}", "run.steps=100000",
                                    reward, *FAST, "rollout.engines=2", "rollout.on_engine_death=stop"])
    try:
        job.wait_for_steps(run_dir, 2, timeout=300)
        engines = _engine_children(job.workers()[0])
        assert len(engines) == 2, engines
        os.kill(engines[1], signal.SIGKILL)
        assert job.proc.wait(timeout=120) != 0, job.output()[-3000:]
    finally:
        job.kill()
    said = [ln for ln in job.output().splitlines() if "[vllm:cispo] rollout at step" in ln]
    assert len(said) == 1 and "engine replica 1: vLLM engine process died" in said[0], job.output()[-3000:]
    assert "exitcode: 7" in job.output()  # EXIT_ROLLOUT_FAILED on every rank; torchrun reports the first
    assert "megatron_cispo/" not in job.output()  # no traceback of ours (torchrun prints its own)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{engines[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{engines[0]}").exists(), "the other replica outlived the run"


def test_a_replica_killed_mid_run_with_on_engine_death_restart_is_replaced_and_rejoins_at_the_next_push(model, tmp_path):
    """rollout.on_engine_death=restart, two local replicas: replica 1's process SIGKILLed after step 2; the run
    goes on to its end, one line says the replica was restarted; replica 0 serves that step's prompts alone
    (its share, or all of them while the fresh replica waits for the next push) and from the next push the
    prompts are split across both again; the ratio stays within 1e-4 of 1 on every step."""
    run_dir = tmp_path / "run"
    (tmp_path / "job").mkdir()
    job = Job(tmp_path / "job", 2, [YAML, f"model.hf_path={model}", f"run.run_dir={run_dir}", "run.steps=5",
                                    f"data.reward={model.parent / 'spread.py'}:spread", *FAST, "rollout.engines=2",
                                    "rollout.on_engine_death=restart"])
    try:
        job.wait_for_steps(run_dir, 2, timeout=300)
        engines = _engine_children(job.workers()[0])
        assert len(engines) == 2, engines
        os.kill(engines[1], signal.SIGKILL)
        assert job.proc.wait(timeout=300) == 0, job.output()[-3000:]
    finally:
        job.kill()
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(_off_one(r) <= 1e-4 for r in recs), [_off_one(r) for r in recs]
    restarts = [r["rollout/engine_restarts"] for r in recs]  # the kill is met at step 3's push or generate, or later
    assert restarts[1] == 0 and restarts[-1] == 1 and restarts == sorted(restarts), restarts
    # one step's prompts all on replica 0 (it took the dead one's share, or the fresh one waited for the next push)
    served = served_per_step(recs)
    assert served[:2] == [(2, 2)] * 2 and sorted(served[2:]) == [(2, 2), (2, 2), (4, 0)], served
    said = [ln for ln in job.output().splitlines() if "engine replica 1 died in" in ln]
    assert len(said) == 1 and "restarting it: it rejoins at the next weight push" in said[0], job.output()[-3000:]


def test_two_replicas_on_two_nodes_each_beside_its_node_s_first_rank_and_one_killed_is_restarted_there(
        model, tmp_path):
    """Two torchrun "nodes" of one rank each on 127.0.0.1, rollout.engines=2, local placement: replica 0 runs
    beside rank 0, replica 1 beside node 1's rank 1 (its vLLM process is rank 1's child), weights reaching it
    over its host's socket. Replica 1's process is SIGKILLed after step 2 (rollout.on_engine_death=restart):
    node 1 starts a fresh one, which rejoins at the next push, the run goes on; every step's ratio within 1e-4
    of 1."""
    run_dir, port = tmp_path / "run", free_port()
    args = [YAML, f"model.hf_path={model}", f"run.run_dir={run_dir}", "run.steps=5",
            f"data.reward={model.parent / 'spread.py'}:spread", *FAST, "rollout.engines=2",
            "rollout.on_engine_death=restart"]
    jobs = []
    try:
        for node in (0, 1):
            (tmp_path / f"node{node}").mkdir()
            jobs.append(Job(tmp_path / f"node{node}", 1, args, nnodes=2, node_rank=node, port=port))
        jobs[0].wait_for_steps(run_dir, 2, timeout=300)
        here, there = _engine_children(jobs[0].workers()[0]), _engine_children(jobs[1].workers()[1])
        assert len(here) == 1 and len(there) == 1, (here, there)
        os.kill(there[0], signal.SIGKILL)
        for job in jobs:
            assert job.proc.wait(timeout=300) == 0, job.output()[-3000:]
    finally:
        for job in jobs:
            job.kill()
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(_off_one(r) <= 1e-4 for r in recs), [_off_one(r) for r in recs]
    assert recs[-1]["rollout/engine_restarts"] == 1
    served = served_per_step(recs)  # replica 0 serves one step alone, then the fresh replica 1 takes its share
    assert served[:2] == [(2, 2)] * 2 and sorted(served[2:]) == [(2, 2), (2, 2), (4, 0)], served
    out = jobs[0].output()
    assert "rollout.engines: replica 0 on node 0 (rank 0), replica 1 on node 1 (rank 1)" in out, out[-3000:]
    said = [ln for ln in out.splitlines() if "engine replica 1 died in" in ln]
    assert len(said) == 1 and "on node 1 (rank 1)" in said[0], out[-3000:]


def test_top_p_0_9_on_tp2_sp_untied_replays_vllms_kept_sets_ratio_still_1_and_evaluates_held_out_prompts(
        untied, tmp_path, monkeypatch):
    """Also data.eval_prompts (the shipped 200 held-out rows, greedy) before the first step and after the
    last: every held-out prompt is scored once per evaluation and never as a training sample, and the
    accuracy equals what transformers decodes greedily from the final export (an independent check).
    And rollout.filter_groups: the groups without signal are refilled from the prompt stream; with two
    reward workers (data.reward_workers) and options for vLLM's engine (rollout.vllm)."""
    held = ROOT / "yaml_configs" / "data" / "add2" / "eval.jsonl"
    log = tmp_path / "scored.jsonl"
    monkeypatch.setenv("SPREAD_LOG", str(log))
    reward = f"data.reward={untied.parent / 'spread.py'}:spread_logged"  # 0/1 from the tokens and the prompt's length
    run_dir = tmp_path / "run"
    ranks(2, [YAML, f"model.hf_path={untied}", f"run.run_dir={run_dir}", "run.steps=2", *FAST, reward,
              "rollout.top_p=0.9", "parallelism.tp=2", "parallelism.sequence_parallel=true",
              f"data.eval_prompts={held}", "run.export_hf=true", "rollout.filter_groups=true",
              "data.reward_workers=2", "rollout.vllm.max_model_len=64", "rollout.vllm.max_num_seqs=64"], timeout=600)
    every = metrics(run_dir)
    assert [r["step"] for r in every] == [0, 1, 2] and "reward_mean" not in every[0]
    recs = every[1:]
    for r in recs:
        assert _off_one(r) <= 1e-4, (r["step"], r["cispo/ratio_min"], r["cispo/ratio_max"])
    assert recs[1]["sync/buckets"] >= MIN_BUCKETS and every[0]["eval/sync_buckets"] >= MIN_BUCKETS  # evals push too
    assert recs[0]["sync/bytes"] == 0  # the first evaluation's push left the engine on version 0
    assert every[0]["eval/version"] == 0 and every[2]["eval/version"] == 2 and "eval/accuracy" not in every[1]
    assert every[0]["eval/scored_frac"] == every[2]["eval/scored_frac"] == 199 / 200  # the row whose reward raised
    held_prompts = [json.loads(line)["prompt"] for line in held.read_text().splitlines()]
    scored = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(p for p in scored if p in set(held_prompts)) == sorted(held_prompts * 2)  # two evals, nothing more
    # and each step's 4 prompts x 4 training samples, with the prompts rollout.filter_groups sampled to refill
    assert len(scored) == 2 * len(held_prompts) + sum(4 + r["rollout/filter_extra_prompts"] for r in recs) * 4
    for r in recs:  # a 0/1 reward on 4 samples: groups without signal are common; each was replaced or counted
        assert r["rollout/filter_dropped_groups"] + r["rollout/filter_short_groups"] >= 0
        assert r["rollout/filter_extra_prompts"] >= r["rollout/filter_dropped_groups"] - 1e-9
    assert 0.05 < every[2]["eval/accuracy"] < 0.95, every[2]  # a score that can differ
    assert _greedy_accuracy(run_dir / "hf" / "step_2", held_prompts) == pytest.approx(every[2]["eval/accuracy"], abs=0.02)


def _greedy_accuracy(model_dir, prompts) -> float:
    """transformers' own greedy decode of `prompts` (5 new tokens, stop at <eos> 13), scored as spread_logged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(str(model_dir)), AutoModelForCausalLM.from_pretrained(str(model_dir))
    hits = 0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok.encode(p)])
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                 eos_token_id=13, pad_token_id=13)[0, ids.shape[1]:].tolist()
            new = new[:new.index(13) + 1] if 13 in new else new
            hits += (sum(new) + len(p)) % 2 == 1
    return hits / len(prompts)


def test_a_reward_budget_cuts_the_step_s_scoring_counts_what_it_cut_and_the_run_goes_on(model, tmp_path):
    """data.reward_budget_s=1.5 with a 0.4 s reward on 2 workers (data.reward_workers): each step scores
    what fits, counts the rest in reward/budget_cut (not as timeouts), says so in one line, and trains on
    the scored samples; the other rank waits in the budget's own group (rollout_wait_group)."""
    run_dir = tmp_path / "run"
    proc = ranks(2, [YAML, f"model.hf_path={model}", f"run.run_dir={run_dir}", "run.steps=2",
                     f"data.reward={model.parent / 'spread.py'}:slow", *FAST, "data.reward_budget_s=1.5",
                     "data.reward_workers=2"], timeout=600)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:  # 16 samples a step; 2 workers x 1.5 s / 0.4 s score about 7 of them
        assert 1 <= r["reward/budget_cut"] <= 15 and r["reward/timeouts"] == 0 and r["reward/errors"] == 0, r
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "not scored within the step's budget" in line]
    assert len(said) == 2 and "the step's reward budget of 1.5 s was spent" in said[0], said
