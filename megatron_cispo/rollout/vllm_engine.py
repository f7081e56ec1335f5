"""vLLM's offline engine as the rollout sampler, run in its own child process (vllm_worker), so it never
touches the trainer's torch.distributed groups, works at any trainer world size, and a crash in vLLM is
one EngineError line here (the child's log holds the rest).

    eng = VLLMEngine("runs/x/hf/step_0", precision="fp32", max_model_len=256, seed=0, kept_sets=True)
    eng.load_weights("runs/x/hf/step_1")                 # after each optimizer step (an export dir), or:
    eng = VLLMEngine(hf_path, ..., stream=True)          # placeholder weights, then pushes in buckets:
    eng.update_weights(stream_buckets(...), manifest=hf_shapes(arch), bucket_bytes=n)   # weight_stream.py
    out = eng.generate(prompts, Sampling(n=4, max_new_tokens=32, top_p=0.9, seeds=[0, 4, 8],
                                         stop_token_ids=[eos]))  # out[i][j]: sample j of prompt i
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import re
import signal
import subprocess
import tempfile
import time
import uuid
import weakref
from dataclasses import astuple
from pathlib import Path
from typing import Iterable

import torch

from .child import recv, send, start
from .engine import Completion, EngineStart, Sampling, push_in_parts, runs_on_cuda  # noqa: F401 - Completion: callers import it from here

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}
CALL_TIMEOUT_S = 3600.0  # generous: a hung child must end as an error, never hang the trainer
# torchrun's variables: with them the child's vLLM would join the trainer's group instead of making its own
_TORCHRUN_ENV = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+|"
                           r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|TORCH_ELASTIC_\w+)$")
# the child's defaults (the caller's environment wins): in-process engine (the 3-process default
# starts in minutes), a small CPU KV cache, no thread pinning on a shared machine, quiet logs
_CHILD_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING",
                   "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
_WORKER = "megatron_cispo.rollout.vllm_worker"


class EngineError(RuntimeError):
    """The vLLM engine failed; the message is one line: what failed, the cause, the fix or the log."""


def vllm_missing() -> str | None:
    """None when vLLM is importable in this python (checked without importing it), else one line."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    return ("rollout.engine=vllm needs vLLM, which this python cannot import: pip install -e '.[vllm]' "
            "(CPU: launch/setup_env.sh with VLLM=1)")


# vLLM 0.32's CPU attention kernels (CPUAttentionBackend.get_supported_head_sizes(); a test compares)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def cpu_model_problem(arch, *, cuda: bool) -> str | None:
    """One line when vLLM's CPU build cannot serve model `arch` (hf.arch.HFArch) as a synced sampler, else
    None: what config.json shows, said before any rank starts (the child checks again on start and load)."""
    if cuda:
        return None
    if arch.head_dim not in CPU_HEAD_DIMS:
        return (f"rollout.engine=vllm on CPU: vLLM's CPU attention has no kernel for head_dim {arch.head_dim} of "
                f"this {arch.family} model (model.hf_path={arch.path}); it supports {list(CPU_HEAD_DIMS)}")
    if arch.num_experts:
        return (f"rollout.engine=vllm on CPU: vLLM 0.32's CPU weight reload does not restore a {arch.family} "
                f"model's MoE layers (measured: off by up to 0.10 in logprob), so the sampler could not follow "
                f"the trainer; use rollout.engine: hf on CPU, or vLLM on GPU")
    return None


def visible_device(gpu: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a process that must see the node's GPU `gpu` alone: the gpu-th entry of this
    process's own CUDA_VISIBLE_DEVICES where that is set (a scheduler's allocation), else `gpu` itself.
    ValueError (one line) for an index past the GPUs this process sees."""
    if not visible:
        return str(gpu)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if gpu >= len(ids):
        raise ValueError(f"rollout.engine_gpus names GPU {gpu}, but CUDA_VISIBLE_DEVICES={visible} gives this node "
                         f"{len(ids)} GPUs (0..{len(ids) - 1})")
    return ids[gpu]


def gpu_placement(gpus: list[int], *, device_count: int, local_trainers: int, node: str = "rank 0's node",
                  replicas: list[int] | None = None) -> str:
    """rollout.engine_gpus checked at start on one node (`node`), which has `device_count` GPUs and
    `local_trainers` trainer processes (local rank i on GPU i): one line saying where each of its replicas
    (`replicas`, default 0..; replica replicas[i] on gpus[i]) runs. ValueError (one line) for a GPU the node
    does not have, naming how many it has."""
    past = [g for g in gpus if g >= device_count]
    if past:
        raise ValueError(f"rollout.engine_gpus={gpus}: GPU {past[0]} is not on {node}, which has {device_count} "
                         f"(0..{device_count - 1}); {local_trainers} of them train, "
                         f"{max(0, device_count - local_trainers)} are left over for engines apart")
    where = [f"replica {k} on GPU {g} ({'colocated with local rank ' + str(g) if g < local_trainers else 'apart'})"
             for k, g in zip(replicas if replicas is not None else range(len(gpus)), gpus)]
    return "rollout.engine_gpus: " + ", ".join(where)


def gpus_here(gpus: list[int | None], replicas: list[int], *, node: str = "rank 0's node") -> str | None:
    """gpu_placement of this node's replicas (replica replicas[i] on GPU gpus[i]) against its own CUDA GPUs and
    its LOCAL_WORLD_SIZE trainer processes, at start; None without CUDA or without rollout.engine_gpus."""
    if not torch.cuda.is_available() or all(g is None for g in gpus):
        return None
    return gpu_placement(list(gpus), device_count=torch.cuda.device_count(), replicas=replicas, node=node,
                         local_trainers=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def start_problem(cfg) -> str | None:
    """rollout.engine=vllm's own refusals at --check: vLLM not installed, a model its build cannot serve."""
    return vllm_missing() or cpu_model_problem(cfg.model.arch, cuda=runs_on_cuda(cfg.model))


def _last_error(log: Path) -> str:
    """The log's last line that names an error, else its last line: what the child died of."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if re.search(r"(Error|Exception|Killed|Traceback)\b", ln)
              and not ln.startswith("Traceback")]
    return (errors or lines or ["empty log"])[-1][-300:]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session: its threads and helpers
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait()


class VLLMEngine:
    """One vLLM engine on `model_dir` (an HF directory) in a child process. Every method blocks; a
    failure, the child's death or a timeout raises EngineError and leaves the engine closed."""

    def __init__(self, model_dir: str, *, precision: str, max_model_len: int, seed: int, kept_sets: bool,
                 start_timeout_s: float = 900.0, call_timeout_s: float = CALL_TIMEOUT_S,
                 log_path: str | None = None, engine_kwargs: dict | None = None, stream: bool = False,
                 gpu: int | None = None):
        """engine_kwargs: more keywords for vllm.LLM (e.g. gpu_memory_utilization on a GPU shared with
        the trainer). The child's stdout and stderr go to log_path (default: a new file in /tmp).
        stream: start on placeholder weights (model_dir needs only config.json) and take weights through
        vLLM's weight-transfer API (push); otherwise model_dir's weights, and load_weights(dir).
        gpu: the node's GPU the child alone sees (rollout.engine_gpus; None: what this process sees)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        missing = vllm_missing()
        if missing:
            raise EngineError(missing)
        self.max_model_len, self.kept_sets, self.call_timeout_s = max_model_len, kept_sets, call_timeout_s
        self.last_generate_seconds = 0.0
        self.proc: subprocess.Popen | None = None
        self._shm: tuple[Path, torch.Tensor] | None = None  # (the shared bucket file, the trainer's map of it)
        self._own_log, self._failed = log_path is None, False  # a temp log of a clean run is removed on close
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm_engine_", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        env = {k: v for k, v in os.environ.items() if not _TORCHRUN_ENV.match(k)}
        if gpu is not None:  # rollout.engine_gpus: the child sees that GPU alone, as its cuda:0
            env["CUDA_VISIBLE_DEVICES"] = visible_device(gpu, os.environ.get("CUDA_VISIBLE_DEVICES"))
        cfg = {"model_dir": str(Path(model_dir).resolve()), "dtype": PRECISIONS[precision],
               "max_model_len": max_model_len, "seed": seed, "kept_sets": kept_sets,
               "engine_kwargs": dict(engine_kwargs or {}), "stream": stream}
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:  # appended to: a resumed run keeps the earlier engines' lines
            self.proc = start(_WORKER, cfg, env={**_CHILD_DEFAULTS, **env}, stderr=log)
        self._finalizer = weakref.finalize(self, _kill, self.proc)  # on garbage collection and at exit
        atexit.register(self._finalizer)
        self._call(None, None, f"starting vLLM on {model_dir}", start_timeout_s,
                   f"check that {model_dir} is an HF model directory vLLM supports")
        self.start_seconds = time.perf_counter() - t0

    def load_weights(self, model_dir: str) -> float:
        """The child reloads every weight from HF directory `model_dir` (same architecture) and resets
        the prefix cache (KV of the old weights would give wrong logprobs). Returns seconds."""
        t0 = time.perf_counter()
        self._call("load", str(Path(model_dir).resolve()), f"loading weights from {model_dir}",
                   self.call_timeout_s, "it must be an export of the engine's model")
        return time.perf_counter() - t0

    def update_weights(self, buckets: Iterable, *, manifest: dict[str, tuple[int, ...]], bucket_bytes: int) -> dict:
        """Load the weights streamed as `buckets` (weight_stream.Bucket, each <= bucket_bytes) through vLLM's
        weight-transfer API, then reset the prefix cache. All or nothing: a stream that raises or ends
        short leaves the engine on its previous weights (the child aborts the update) and raises
        EngineError, or the stream's own exception. manifest: every HF tensor a complete push holds.
        Returns {"sync/seconds", "sync/bytes", "sync/buckets"}."""
        return push_in_parts(self, buckets, manifest=manifest, bucket_bytes=bucket_bytes)

    # update_weights in parts, for a caller that feeds several engines one bucket at a time (engine_pool.py)
    def begin_update(self, manifest: dict, bucket_bytes: int) -> None:
        self.buffer(manifest, bucket_bytes)
        self._call("wstart", None, "starting a weight update", self.call_timeout_s, "see the log")

    def add_bucket(self, bucket, index: int = 0) -> int:
        """Bucket `index` of the update begun: copied into the shared file unless packed there; its bytes."""
        buf = self._shm[1]
        n = bucket.data.numel()
        if bucket.data.data_ptr() != buf.data_ptr():  # not packed in place (stream_buckets(buffer=))
            buf[:n].copy_(bucket.data.view(-1).cpu())
        self._call("wupdate", {"blocks": [astuple(b) for b in bucket.blocks], "nbytes": n},
                   f"receiving weight bucket {index}", self.call_timeout_s, "see the log", fatal=False)
        return n

    def finish_update(self) -> None:
        self._call("wfinish", None, "loading the streamed weights", self.call_timeout_s,
                   "the stream must hold every tensor of the engine's model", fatal=False)

    def abort_update(self) -> None:
        """End the update begun, loading nothing (the engine keeps its weights); nothing when it is closed."""
        if self.proc is not None:
            self._call("wabort", None, "aborting a weight update", self.call_timeout_s, "see the log")

    def buffer(self, manifest: dict, bucket_bytes: int) -> torch.Tensor:
        """The shared bucket file ([bucket_bytes] uint8, mapped here and in the engine), made and announced
        to the engine (winit) on first use: pack buckets straight into it (stream_buckets(buffer=))."""
        if self._shm is not None and self._shm[1].numel() == bucket_bytes:
            return self._shm[1]
        self._close_shm()
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        path = root / f"cispo_weights_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        with open(path, "wb") as f:
            f.truncate(bucket_bytes)
        self._shm = (path, torch.from_file(str(path), shared=True, size=bucket_bytes, dtype=torch.uint8))
        info = {"path": str(path), "nbytes": bucket_bytes, "manifest": {k: tuple(v) for k, v in manifest.items()}}
        self._call("winit", info, "starting the weight transfer engine", self.call_timeout_s, "see the log")
        path.unlink()  # both sides have mapped it: the name is not needed, and a killed run leaves no file
        return self._shm[1]

    def _close_shm(self) -> None:
        if self._shm is not None:
            self._shm[0].unlink(missing_ok=True)
            self._shm = None

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """sampling.n samples per prompt (token ids); sample j of prompt i is seeded with seeds[i] + j
        (vLLM's parallel sampling), so the same seeds and weights give the same completions. top_k 0 and
        top_p 1 are off. Returns [prompt][sample]."""
        s = sampling
        n, max_new_tokens, seeds = s.n, s.max_new_tokens, s.seeds
        if len(seeds) != len(prompts):
            raise ValueError(f"seeds: one per prompt, got {len(seeds)} for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if not p or len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} must be "
                                 f"1..max_model_len {self.max_model_len}")
        spans = sorted((s, i) for i, s in enumerate(seeds))
        for (a, i), (b, j) in zip(spans, spans[1:]):
            if b < a + n:
                raise ValueError(f"seeds of prompts {i} and {j} ({a}, {b}) are less than n={n} apart: sample k "
                                 "of a prompt uses seed + k, so their samples would share seeds")
        t0 = time.perf_counter()
        args = dict(prompts=[list(map(int, p)) for p in prompts], n=n, max_new_tokens=max_new_tokens,
                    temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p),
                    seeds=[int(x) for x in seeds], stop_token_ids=[int(t) for t in s.stop_token_ids])
        out = self._call("generate", args, f"generating {len(prompts)} prompts x {n}", self.call_timeout_s,
                         "see the log")
        self.last_generate_seconds = time.perf_counter() - t0
        return [[Completion(*c) for c in samples] for samples in out]

    def alive(self) -> bool:
        """Whether the child still runs and the engine is open (a fatal failure closed it)."""
        proc = self.proc
        return proc is not None and proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the child's session from any thread, and nothing else: a call waiting on it (another
        thread's generate) then raises EngineError and closes the engine there."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()

    def close(self) -> None:
        """Stop the child (idempotent): ask it to exit, then kill its session after a short wait. The
        temp log (no log_path given) is removed unless an EngineError named it."""
        self._stop(polite=True)
        if self._own_log and not self._failed:
            self.log_path.unlink(missing_ok=True)

    def _stop(self, polite: bool) -> None:
        self._close_shm()
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if polite and proc.poll() is None:
            try:
                send(proc.stdin, ("close", None))
                proc.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        _kill(proc)
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        atexit.unregister(self._finalizer)
        self._finalizer.detach()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, op, arg, what: str, timeout_s: float, fix: str, fatal: bool = True):
        """Send (op, arg) (op None: only wait for the start reply) and return the child's value; any
        failure raises EngineError (one line) and closes the engine, except an error the child answered
        with when not `fatal` (a refused weight update: the child is still on its previous weights)."""
        if self.proc is None:
            raise EngineError(f"vLLM engine: {what} on a closed engine (it failed earlier or was closed)")
        try:
            if op is not None:
                send(self.proc.stdin, (op, arg))
            kind, value = recv(self.proc.stdout.fileno(), time.monotonic() + timeout_s)
        except TimeoutError:
            msg = f"vLLM engine: {what} took more than {timeout_s:.0f} s; killed it (log: {self.log_path})"
        except (EOFError, OSError, ValueError):
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = "none: it closed the pipe"
            msg = (f"vLLM engine process died while {what} (exit {rc}): {_last_error(self.log_path)} "
                   f"(log: {self.log_path})")
        else:
            if kind == "ok":
                return value
            msg = f"vLLM engine: {what} failed: {value}; {fix} (log: {self.log_path})"
            if not fatal:
                raise EngineError(msg)
        self._failed = True
        self._stop(polite=False)
        raise EngineError(msg)


def open_engine(start: EngineStart) -> VLLMEngine:
    """rollout.engine=vllm: an engine on placeholder weights of model.hf_path's family, fed by update_weights."""
    return VLLMEngine(start.model.hf_path, precision=start.precision, seed=start.seed,
                      max_model_len=start.max_model_len, kept_sets=start.kept_sets,
                      start_timeout_s=start.start_timeout_s, call_timeout_s=start.call_timeout_s,
                      log_path=start.log_path, engine_kwargs=start.options, stream=True, gpu=start.gpu)
