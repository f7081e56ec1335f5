"""Launch mistakes fail fast with one line: bad launch variables exit 2 before any Python starts, and a
node whose peers never come fails after the rendezvous timeout instead of hanging.

The validation cases run the scripts with PY pointing at a stub that records its calls, so they
take milliseconds and prove that neither the config check nor torchrun (one process) was started.
"""
import os
import re
import signal
import socket
import subprocess
import time

import pytest

from e2e_helpers import DEMO, ROOT, env
from megatron_cispo.testing import free_port

LAUNCH_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC", "GPUS_PER_NODE", "RDZV",
               "RDZV_ID", "RDZV_TIMEOUT", "NGPU", "PY", "TORCH_CPP_LOG_LEVEL", "ENGINE_GPUS_PER_NODE", "RAY_PORT",
               "RAY_START_TIMEOUT", "RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")


def _clean_env(**extra) -> dict[str, str]:
    out = {k: v for k, v in env().items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return {**out, "NGPU": "0", **extra}


@pytest.fixture
def stubs(tmp_path):
    """A PY, srun and scontrol that append their argv to calls.log; returns (env, calls.log)."""
    calls = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in [("python", 'args="$*"; echo "python ${args//$\'\\n\'/ }" >> "$CALLS"'),  # one line per call
                       # the trainer's step returns last: slurm_ray.sbatch ends its Ray steps when it does
                       ("srun", 'echo "srun NNODES=$NNODES MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT $*" >> "$CALLS"'
                                '; case "$*" in *multi_node.sh*) sleep 1;; esac'),
                       ("scontrol", 'printf "nodeA\\nnodeB\\n"')]:
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    stub_env = _clean_env(PY=str(bin_dir / "python"), CALLS=str(calls),
                          PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(ROOT),
                          SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="nodeA,nodeB")
    return stub_env, calls


def _launch(script, stub_env, **launch_env):
    start = time.monotonic()
    proc = subprocess.run(["bash", f"launch/{script}", DEMO], cwd=ROOT, env={**stub_env, **launch_env},
                          capture_output=True, text=True, timeout=30)
    return proc, time.monotonic() - start


BAD = [  # script, launch env, what the one line must say
    ("multi_node.sh", dict(NNODES="2"), "MASTER_ADDR is not set"),
    ("multi_node.sh", dict(NNODES="2", NODE_RANK="5", MASTER_ADDR="127.0.0.1"), "NODE_RANK='5' is not valid: expected an integer in 0..1"),
    ("multi_node.sh", dict(NNODES="2", NODE_RANK="-1", MASTER_ADDR="127.0.0.1"), "NODE_RANK='-1'"),
    ("multi_node.sh", dict(NNODES="abc"), "NNODES='abc' is not valid: expected a positive integer"),
    ("multi_node.sh", dict(NNODES="0"), "NNODES='0'"),
    ("multi_node.sh", dict(GPUS_PER_NODE="-4"), "GPUS_PER_NODE='-4' is not valid: expected a positive integer"),
    ("multi_node.sh", dict(MASTER_PORT="70000"), "MASTER_PORT='70000' is not valid: expected an integer in 1..65535"),
    ("multi_node.sh", dict(MASTER_PORT="http"), "MASTER_PORT='http'"),
    ("multi_node.sh", dict(NNODES="2", MASTER_ADDR="node0:29500"), "MASTER_ADDR='node0:29500'"),
    ("multi_node.sh", dict(RDZV_TIMEOUT="10m"), "RDZV_TIMEOUT='10m' is not valid: expected a positive integer"),
    ("multi_node.sh", dict(RDZV="etcd"), "RDZV='etcd'"),
    ("single_node.sh", dict(NPROC="-4"), "NPROC='-4' is not valid: expected a positive integer"),
    ("single_node.sh", dict(NPROC="abc"), "NPROC='abc'"),
    ("single_node.sh", dict(MASTER_PORT="0"), "MASTER_PORT='0'"),
    ("single_node.sh", dict(NGPU="two"), "NGPU='two' is not valid: expected a non-negative integer"),
    ("slurm.sbatch", dict(MASTER_PORT="99999"), "MASTER_PORT='99999'"),
    ("slurm.sbatch", dict(GPUS_PER_NODE="0"), "GPUS_PER_NODE='0'"),
    ("slurm_ray.sbatch", dict(RAY_PORT="0"), "RAY_PORT='0' is not valid: expected an integer in 1..65535"),
    ("slurm_ray.sbatch", dict(ENGINE_GPUS_PER_NODE="two"), "ENGINE_GPUS_PER_NODE='two' is not valid"),
    ("slurm_ray.sbatch", dict(RAY_START_TIMEOUT="5m"), "RAY_START_TIMEOUT='5m' is not valid"),
    ("slurm_ray.sbatch", dict(NGPU="8", ENGINE_GPUS_PER_NODE="8"),
     "ENGINE_GPUS_PER_NODE='8' is not valid: expected fewer than GPUS_PER_NODE=8"),
]


@pytest.mark.parametrize("script, launch_env, message", BAD,
                         ids=[f"{s}:{' '.join(f'{k}={v}' for k, v in e.items())}" for s, e, _ in BAD])
def test_bad_launch_variable_is_one_line_exit_2_and_nothing_starts(stubs, script, launch_env, message):
    stub_env, calls = stubs
    proc, seconds = _launch(script, stub_env, **launch_env)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith(f"{script}: "), lines
    assert not calls.exists(), calls.read_text()  # no config check, no torchrun, no srun
    assert seconds < 5


def test_valid_settings_reach_torchrun_with_the_rendezvous_timeout(stubs):
    stub_env, calls = stubs
    proc, _ = _launch("multi_node.sh", stub_env, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", GPUS_PER_NODE="08")
    assert proc.returncode == 0, proc.stderr
    (torchrun,) = calls.read_text().splitlines()  # one process: it checks the config, then runs torchrun
    assert ("launch/run_torchrun.py multi_node.sh node 1 waited for node 0 at 10.0.0.1:29500" in torchrun and
            "NNODES=2" in torchrun)
    # world 16 to check the config for: "08" is read as eight, not as bad octal
    assert (" 16 --nnodes 2 --nproc-per-node 8 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 "
            "--rdzv-conf timeout=600 -m megatron_cispo.train") in torchrun
    calls.unlink()
    proc, _ = _launch("multi_node.sh", stub_env, NNODES="2", RDZV="c10d", NODE_RANK="7", MASTER_ADDR="10.0.0.1",
                      RDZV_TIMEOUT="30")  # c10d assigns node ranks, so NODE_RANK is not checked
    assert proc.returncode == 0, proc.stderr
    assert "--rdzv-endpoint 10.0.0.1:29500 --rdzv-id megatron_cispo --rdzv-conf join_timeout=30" in calls.read_text()
    calls.unlink()
    proc, _ = _launch("slurm.sbatch", stub_env, RDZV_TIMEOUT="900")
    assert proc.returncode == 0, proc.stderr
    assert "srun NNODES=2 MASTER_ADDR=nodeA MASTER_PORT=29500 --kill-on-bad-exit=1" in calls.read_text()


def test_the_config_check_places_the_engines_on_the_nodes_the_script_launches():
    """multi_node.sh hands its nodes to the check (WORLD_SIZE over --nproc-per-node): 2 nodes of 8 processes
    against run.gpus_per_node=4 is refused in one line naming 8 per node (on one node it would say 16)."""
    recipe = str(ROOT / "yaml_configs" / "gpu_qwen3_8b.yaml")
    node_env = _clean_env(NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", GPUS_PER_NODE="8",
                          MATH_PROMPTS=str(ROOT / "yaml_configs" / "data" / "math_sample.jsonl"))
    proc = subprocess.run(["bash", "launch/multi_node.sh", recipe, "run.gpus_per_node=4"], cwd=ROOT, env=node_env,
                          capture_output=True, text=True, timeout=120)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].endswith("16 trainer processes on 2 node(s) are 8 per node, more than run.gpus_per_node=4: add "
                             "nodes (--nnodes) or fix run.gpus_per_node"), lines


def _node(rank: int, port: int, timeout_s: int) -> subprocess.Popen:
    node_env = _clean_env(NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          GPUS_PER_NODE="1", RDZV_TIMEOUT=str(timeout_s))
    return subprocess.Popen(["bash", "launch/multi_node.sh", DEMO], cwd=ROOT, env=node_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_node_whose_peer_never_comes_fails_after_the_rendezvous_timeout_with_one_line():
    # Two separate jobs at once, to keep the test short: node 0 alone, and node 1 alone.
    timeout_s = 3
    start = time.monotonic()
    alone = {rank: _node(rank, free_port(), timeout_s) for rank in (0, 1)}
    out = {rank: p.communicate(timeout=150) for rank, p in alone.items()}
    seconds = time.monotonic() - start
    for rank, p in alone.items():
        text = out[rank][0] + out[rank][1]
        assert p.returncode == 1, text[-3000:]
        assert "Traceback" not in text and "frame #" not in text, text[-3000:]
        assert text.strip().splitlines()[-1].startswith("multi_node.sh: "), text[-3000:]
    # torch's own words, quoted at the end of the line, bound the wait: node 0 waited the timeout...
    last0 = out[0][1].strip().splitlines()[-1]
    assert f"node 0 waited RDZV_TIMEOUT={timeout_s} s for all NNODES=2 nodes to join at 127.0.0.1:" in last0
    waited = re.search(r"Timed out after (\d+) seconds waiting for clients. 1/2 clients joined", last0)
    assert waited and int(waited.group(1)) <= timeout_s + 1, last0
    # ...and node 1 gave up connecting to node 0 after it (torch retries the connection once).
    last1 = out[1][1].strip().splitlines()[-1]
    assert f"node 1 waited for node 0 at 127.0.0.1:" in last1 and f"RDZV_TIMEOUT={timeout_s} s" in last1
    assert f"timed out after {timeout_s * 1000}ms while trying to connect" in last1, last1
    # Wall time adds interpreter start-up and the config check, slow on a loaded 2-core machine;
    # without the timeout this would wait torch's default 600 s.
    assert seconds < 120, seconds


def test_a_taken_port_is_one_line_naming_master_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(["bash", "launch/single_node.sh", DEMO], cwd=ROOT, timeout=120,
                              env=_clean_env(MASTER_PORT=str(port)), capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("single_node.sh: the rendezvous port is already in use") and "MASTER_PORT" in last
    assert str(port) in last


def test_sigterm_to_the_launch_script_keeps_the_workers_exit_code_5_and_prints_no_traceback(tmp_path):
    # torchrun itself gets the signal (as from a scheduler), forwards it, and the ranks checkpoint and exit 5.
    run_dir = tmp_path / "run"
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(["bash", "launch/single_node.sh", DEMO, "parallelism.tp=1", "run.steps=200",
                                 "run.log_interval=1", f"run.run_dir={run_dir}"], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, env=_clean_env(NPROC="2", MASTER_PORT=str(free_port())))
    try:
        deadline = time.monotonic() + 150
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the script exec'd the launcher: this is torchrun's agent
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert proc.returncode == 5, text[-3000:]
    assert "Traceback" not in text and "death signal" not in text and "closing signal" not in text, text[-3000:]
    assert text.count("stopped by SIGTERM after step") == 1, text[-3000:]


def test_slurm_ray_starts_a_head_then_workers_with_the_engine_gpus_then_the_trainer_on_the_others(stubs):
    """launch/slurm_ray.sbatch on 3 stub nodes of 8 GPUs: Ray's head on the first node and a worker on each
    other, every one with GPUs 6,7; the trainer on GPUs 0..5 of every node, joined to the head's address
    (rollout.placement=ray, rollout.ray_address). What it runs exists: the keys are RolloutConfig's, the
    flags are `ray start`'s (when ray is installed here), and multi_node.sh takes the rest."""
    import dataclasses
    import importlib.util
    import sys

    from megatron_cispo.runner.data import RolloutConfig

    stub_env, calls = stubs
    stub_env = {**stub_env, "SLURM_JOB_NUM_NODES": "3"}
    (calls.parent / "bin" / "scontrol").write_text('#!/usr/bin/env bash\nprintf "nodeA\\nnodeB\\nnodeC\\n"\n')
    proc, _ = _launch("slurm_ray.sbatch", stub_env, NGPU="8")
    assert proc.returncode == 0, proc.stderr
    lines = calls.read_text().splitlines()
    head = [ln for ln in lines if " start --head " in ln]
    workers = sorted(ln for ln in lines if " start --block --address=" in ln)
    (trainer,) = [ln for ln in lines if "multi_node.sh" in ln]
    assert len(head) == 1 and "-w nodeA env CUDA_VISIBLE_DEVICES=6,7 " in head[0], lines
    assert "--port=6379 --num-gpus=2 --include-dashboard=false" in head[0]
    assert [w.split(" -w ")[1].split()[0] for w in workers] == ["nodeB", "nodeC"], lines
    assert all("CUDA_VISIBLE_DEVICES=6,7 " in w and "--address=nodeA:6379 --num-gpus=2" in w for w in workers)
    assert "--overlap --kill-on-bad-exit=1 env CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 GPUS_PER_NODE=6 bash -c" in trainer
    assert trainer.endswith(f"_ {DEMO} rollout.placement=ray rollout.ray_address=nodeA:6379"), trainer
    assert lines.index(next(ln for ln in lines if " status --address nodeA:6379" in ln)) < lines.index(trainer)
    # the keys it sets are the rollout section's, with these values
    fields = {f.name for f in dataclasses.fields(RolloutConfig)}
    assert {"placement", "ray_address"} <= fields
    assert RolloutConfig(engine="vllm", placement="ray", ray_address="nodeA:6379").ray_address == "nodeA:6379"
    if importlib.util.find_spec("ray") is not None:  # the flags it gives `ray start` are Ray's
        helped = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--help"], capture_output=True,
                                text=True, timeout=60, env=env()).stdout
        used = set(re.findall(r" (--[a-z-]+)", " ".join(head + workers))) - {"--overlap", "--nodes", "--ntasks"}
        assert used and all(flag in helped for flag in used), (used, helped[-2000:])
