"""VLLMEngine (vLLM in a child process) on a tiny qwen2 against transformers on the same weights: fp32
processed logprobs and kept sets, stop tokens, seeds, weights pushed in buckets through vLLM's
weight-transfer API (all or nothing: a short or failing push keeps the previous weights) and reloaded
from a directory, each with the prefix cache reset, tied logits; start failures, a dying or hung child
and a dying trainer as one EngineError line or a clean exit. One engine per module (it takes both
kinds of update). Skipped without vLLM unless CISPO_REQUIRE_VLLM=1 (then it fails)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_cispo.rollout import vllm_engine
from megatron_cispo.rollout.engine import Sampling
from megatron_cispo.rollout.vllm_engine import EngineError, VLLMEngine, vllm_missing

if vllm_missing() and os.environ.get("CISPO_REQUIRE_VLLM") == "1":
    pytest.fail(vllm_missing(), pytrace=False)
needs_vllm = pytest.mark.skipif(vllm_missing() is not None, reason="vLLM is not installed")
PROMPTS = [[10, 1, 12, 2, 11], [10, 7, 12, 9, 11], [10, 3, 3, 12, 4, 11], [10, 5, 12, 0, 11]]
SEEDS = [0, 10, 20, 30]
KW = dict(n=2, max_new_tokens=8, temperature=0.7, stop_token_ids=[13])


def gen(engine, prompts, **sampling):
    return engine.generate(prompts, Sampling(**sampling))


def _make(out, **sizes):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf
    return str(make_tiny_hf("qwen2", out, **sizes))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("vllm") / "qwen2", hidden=128)  # head_dim 32: CPU vLLM has kernels


@pytest.fixture(scope="module")
def engine(model):
    # stream=True with the model's own weights loaded at start (a run starts on placeholder weights): the
    # one engine takes both a push and a reload from a directory
    eng = VLLMEngine(model, precision="fp32", max_model_len=64, seed=0, kept_sets=True, stream=True,
                     engine_kwargs={"load_format": "auto"})
    yield eng
    eng.close()


BUCKET = 4096  # bytes: a tiny model's push then takes hundreds of buckets, its embedding several


def _push(engine, model_dir, tensors=None):
    from safetensors.torch import load_file

    from megatron_cispo.hf.arch import read_arch
    from megatron_cispo.hf.mapping import hf_shapes
    from megatron_cispo.rollout.weight_stream import tensor_buckets
    if tensors is None:
        tensors = load_file(f"{model_dir}/model.safetensors")
    return engine.update_weights(tensor_buckets(tensors, BUCKET), manifest=hf_shapes(read_arch(model_dir)), bucket_bytes=BUCKET)


def _variant(src, out, change):
    """An export of `src` with change(name, tensor) applied to every weight."""
    from megatron_cispo.hf.arch import read_arch
    from megatron_cispo.hf.export import write_hf_dir
    from safetensors.torch import load_file
    state = {k: change(k, v) for k, v in load_file(f"{src}/model.safetensors").items()}
    return str(write_hf_dir(state, read_arch(src), out, dtype=torch.float32))


def _reference(model_dir, prompt, completion, temperature, top_k, top_p):
    """transformers fp32 on model_dir: each sampled token's processed logprob and its kept set."""
    from transformers import AutoModelForCausalLM

    from megatron_cispo.rollout.sampler import top_k_top_p
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].double() / temperature
    z = torch.log_softmax(top_k_top_p(logits, top_k, top_p), -1)
    lp = z.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
    return lp, [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in z]


def _check_against(model_dir, out, top_k, top_p, bound=1e-4):
    diffs = []
    for prompt, samples in zip(PROMPTS, out):
        for c in samples:
            lp, kept = _reference(model_dir, prompt, c, KW["temperature"], top_k, top_p)
            diffs.append((lp - torch.tensor(c.logprobs, dtype=torch.float64)).abs())
            assert c.kept == (kept if (top_k or top_p < 1) else None)
    d = torch.cat(diffs)
    assert d.max() < bound, f"mean {d.mean():.2e} max {d.max():.2e}"
    return d


@needs_vllm
@pytest.mark.parametrize("top_k,top_p", [(20, 0.9), (0, 0.8), (0, 1.0)])
def test_fp32_logprobs_and_kept_sets_equal_transformers(engine, model, top_k, top_p):
    out = gen(engine, PROMPTS, seeds=SEEDS, top_k=top_k, top_p=top_p, **KW)
    assert [len(s) for s in out] == [2] * 4 and all(len(c.token_ids) == 8 == len(c.logprobs) for s in out for c in s)
    d = _check_against(model, out, top_k, top_p)
    assert d.mean() < 1e-5
    if top_k or top_p < 1:
        sizes = {len(k) for s in out for c in s for k in c.kept}
        assert max(sizes) < 300 and (not top_k or max(sizes) <= top_k)  # the sets do truncate


@needs_vllm
def test_a_stop_token_ends_the_sample_and_is_returned_with_its_logprob(engine):
    kw = {**KW, "top_k": 0, "top_p": 1.0}
    free = gen(engine, PROMPTS[:1], seeds=[5], **{**kw, "stop_token_ids": []})[0][0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    got = gen(engine, PROMPTS[:1], seeds=[5], **{**kw, "stop_token_ids": [stop]})[0][0]
    assert got.finish_reason == "stop"
    assert got.token_ids == free.token_ids[:first + 1]  # the stop token included
    assert got.logprobs == pytest.approx(free.logprobs[:first + 1], abs=1e-6)


@needs_vllm
def test_same_seeds_give_the_same_completions_other_seeds_do_not(engine):
    a = gen(engine, PROMPTS, seeds=SEEDS, top_k=20, top_p=0.9, **KW)
    b = gen(engine, PROMPTS[::-1], seeds=SEEDS[::-1], top_k=20, top_p=0.9, **KW)[::-1]  # another batch order
    c = gen(engine, PROMPTS, seeds=[s + 100 for s in SEEDS], top_k=20, top_p=0.9, **KW)
    assert a == b
    assert [x.token_ids for s in a for x in s] != [x.token_ids for s in c for x in s]
    assert a[0][0].token_ids != a[0][1].token_ids  # the n samples of a prompt differ
    with pytest.raises(ValueError, match="less than n=2 apart"):
        gen(engine, PROMPTS[:2], seeds=[0, 1], top_k=0, top_p=1.0, **KW)


@needs_vllm
def test_load_weights_makes_the_logprobs_the_new_models(engine, model, tmp_path):
    g = torch.Generator().manual_seed(1)
    new = _variant(model, tmp_path / "new", lambda k, v: v + 0.05 * torch.randn(v.shape, generator=g))
    try:
        assert engine.load_weights(new) < 30
        out = gen(engine, PROMPTS, seeds=SEEDS, top_k=20, top_p=0.9, **KW)
        _check_against(new, out, 20, 0.9)
        with pytest.raises(AssertionError):  # the old weights' logprobs are far from them
            _check_against(model, out, 20, 0.9, bound=1e-2)
    finally:
        engine.load_weights(model)


@needs_vllm
def test_a_bucketed_push_makes_the_logprobs_the_new_models_and_a_failed_one_keeps_the_old(engine, model, tmp_path):
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(2)
    new = _variant(model, tmp_path / "new", lambda k, v: v + 0.05 * torch.randn(v.shape, generator=g))
    weights = load_file(f"{new}/model.safetensors")
    args = dict(seeds=SEEDS, top_k=20, top_p=0.9, **KW)
    try:
        info = _push(engine, new)
        assert info["sync/buckets"] >= 10 and info["sync/bytes"] == sum(t.nbytes for t in weights.values())
        # the shared bucket file is unlinked once both sides map it: a SIGKILLed run leaves nothing in /dev/shm
        assert engine._shm is not None and not engine._shm[0].exists()
        pushed = gen(engine, PROMPTS, **args)
        _check_against(new, pushed, 20, 0.9)  # the tied head follows the pushed embedding
        short = dict(list(weights.items())[:-1])  # one tensor never arrives
        with pytest.raises(EngineError, match="loading the streamed weights failed: ValueError: weight stream "
                                              "ended with .* missing .* the engine keeps its previous weights"):
            _push(engine, model, {k: v * 0 for k, v in short.items()})

        def dies_midway():
            from megatron_cispo.rollout.weight_stream import tensor_buckets
            for i, b in enumerate(tensor_buckets({k: v * 0 for k, v in weights.items()}, BUCKET)):
                if i == 20:
                    raise RuntimeError("the trainer's stream broke")
                yield b
        from megatron_cispo.hf.arch import read_arch
        from megatron_cispo.hf.mapping import hf_shapes
        with pytest.raises(RuntimeError, match="stream broke"):
            engine.update_weights(dies_midway(), manifest=hf_shapes(read_arch(new)), bucket_bytes=BUCKET)
        after = gen(engine, PROMPTS, **args)  # neither failed push moved a weight
        assert [[c.logprobs for c in s] for s in after] == [[c.logprobs for c in s] for s in pushed]
    finally:
        _push(engine, model)


@needs_vllm
def test_tied_logits_keep_every_tied_token(engine, model, tmp_path):
    """All logits equal (zero embeddings, tied head): top-k keeps every tied token, more than the
    top_k + 1 candidates first asked for, so the worker redoes the prompts over the whole vocabulary."""
    flat = _variant(model, tmp_path / "flat", lambda k, v: torch.zeros_like(v) if "embed" in k else v)
    try:
        engine.load_weights(flat)
        out = gen(engine, PROMPTS[:2], seeds=SEEDS[:2], top_k=5, top_p=1.0, **KW)
        for c in (c for s in out for c in s):
            assert c.kept == [list(range(300))] * 8
            assert c.logprobs == pytest.approx([-torch.log(torch.tensor(300.0)).item()] * 8, abs=1e-5)
    finally:
        engine.load_weights(model)


@needs_vllm
@pytest.mark.parametrize("case", ["unknown_arch", "head_dim_16"])
def test_a_model_vllm_cannot_run_is_one_engine_error_line(tmp_path, case):
    if case == "unknown_arch":
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({"architectures": ["NopeForCausalLM"], "model_type": "nope"}))
        expect = "starting vLLM on"
    else:
        bad, expect = _make(tmp_path / "small"), "head_dim 16 of this qwen2 model"
    with pytest.raises(EngineError) as e:
        VLLMEngine(str(bad), precision="fp32", max_model_len=64, seed=0, kept_sets=False, start_timeout_s=300)
    msg = str(e.value)
    assert "\n" not in msg and expect in msg and "log: " in msg, msg


@needs_vllm
def test_an_moe_model_samples_but_refuses_a_weight_reload_on_cpu(tmp_path):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf
    moe = str(make_tiny_hf("qwen3_moe", tmp_path / "moe", hidden=96))  # head_dim 96/4 + 8 = 32
    with VLLMEngine(moe, precision="fp32", max_model_len=64, seed=0, kept_sets=False) as eng:
        out = gen(eng, PROMPTS[:1], seeds=[0], top_k=0, top_p=1.0, **KW)
        assert len(out[0][1].token_ids) == 8
        with pytest.raises(EngineError, match="loading weights from .*: ValueError: vLLM's CPU reload_weights does "
                                              "not restore this qwen3_moe model's MoE layers"):
            eng.load_weights(moe)


# the pipe and process handling, with a stand-in worker instead of vLLM (no vLLM needed)
FAKE = """import os, sys, time
from megatron_cispo.rollout.child import attach, recv, send

def serve():
    out, cfg = attach()
    print("fake worker started", file=sys.stderr, flush=True)
    send(out, ("ok", 0.0))
    op = recv(0, None)
    if op[0] == "close":
        return send(out, ("ok", None))
    {}
"""


def _fake_engine(monkeypatch, tmp_path, behaviour, **kw):
    (tmp_path / "fake_vllm_worker.py").write_text(FAKE.format(behaviour))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(vllm_engine, "_WORKER", "fake_vllm_worker")
    monkeypatch.setattr(vllm_engine, "vllm_missing", lambda: None)
    return VLLMEngine(str(tmp_path), precision="fp32", max_model_len=64, seed=0, kept_sets=False, **kw)


def test_a_given_log_is_appended_to_and_a_clean_runs_temp_log_is_removed(monkeypatch, tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("the first run's engine\n")  # a resumed run writes into the same run_dir
    eng = _fake_engine(monkeypatch, tmp_path, "pass", log_path=str(log))
    eng.close()
    assert log.read_text() == "the first run's engine\nfake worker started\n"
    eng = _fake_engine(monkeypatch, tmp_path, "pass")
    temp = eng.log_path
    assert temp.read_text() == "fake worker started\n"
    eng.close()
    eng.close()
    assert not temp.exists()


def test_a_child_dying_mid_call_is_one_line_quoting_its_error(monkeypatch, tmp_path):
    eng = _fake_engine(monkeypatch, tmp_path, "print('RuntimeError: CPU out of memory', file=sys.stderr); os._exit(3)")
    with pytest.raises(EngineError, match=r"died while generating 1 prompts x 1 \(exit 3\): RuntimeError: CPU out "
                                          r"of memory \(log: .*\)$"):
        gen(eng, [[1]], n=1, max_new_tokens=1, temperature=1.0, top_k=0, top_p=1.0, seeds=[0], stop_token_ids=[])
    assert eng.proc is None
    with pytest.raises(EngineError, match="closed engine"):
        eng.load_weights(str(tmp_path))
    eng.close()
    assert "CPU out of memory" in eng.log_path.read_text()  # the temp log its message names is kept
    eng.log_path.unlink()


def test_a_hung_child_times_out_and_is_killed(monkeypatch, tmp_path):
    eng = _fake_engine(monkeypatch, tmp_path, "time.sleep(600)", call_timeout_s=1.0)
    pid, t0 = eng.proc.pid, time.monotonic()
    with pytest.raises(EngineError, match="loading weights from .* took more than 1 s; killed it"):
        eng.load_weights(str(tmp_path))
    assert time.monotonic() - t0 < 15
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@needs_vllm
def test_the_child_exits_when_the_trainer_is_killed(model):
    """The real worker, killed with its parent while it is still starting (PR_SET_PDEATHSIG)."""
    code = ("import os; os.environ['VLLM_LOGGING_LEVEL'] = 'ERROR'; from megatron_cispo.rollout import vllm_engine; "
            f"vllm_engine.vllm_missing = lambda: None; vllm_engine.VLLMEngine({model!r}, precision='fp32', "
            "max_model_len=64, seed=0, kept_sets=False)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    children, deadline = [], time.monotonic() + 60
    while not children and time.monotonic() < deadline:
        time.sleep(0.2)
        out = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout
        children = [int(p) for p in out.split()]
    assert children, "the engine started no child"
    time.sleep(1.0)  # let it read its config and arm the death signal
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(children[0]):
        time.sleep(0.2)
    assert not _alive(children[0]), "the vLLM child outlived the trainer"


def test_vllm_missing_names_the_extra(monkeypatch):
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: None)
    line = vllm_missing()
    assert "rollout.engine=vllm" in line and "pip install -e '.[vllm]'" in line and "\n" not in line
    with pytest.raises(EngineError, match=r"needs vLLM"):
        VLLMEngine("x", precision="fp32", max_model_len=8, seed=0, kept_sets=False)


@needs_vllm
def test_the_trainer_side_head_dims_are_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert list(vllm_engine.CPU_HEAD_DIMS) == list(CPUAttentionBackend.get_supported_head_sizes())


def test_cpu_model_problem_names_head_dim_and_moe_before_any_rank_starts(tmp_path):
    from megatron_cispo.hf.arch import read_arch
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    small = read_arch(_make(tmp_path / "small"))                          # head_dim 16
    ok = read_arch(_make(tmp_path / "ok", hidden=128))                     # head_dim 32
    moe = read_arch(str(make_tiny_hf("qwen3_moe", tmp_path / "moe", hidden=96)))  # head_dim 24 + 8 = 32
    assert "no kernel for head_dim 16 of this qwen2 model" in vllm_engine.cpu_model_problem(small, cuda=False)
    assert vllm_engine.cpu_model_problem(ok, cuda=False) is None
    assert "MoE layers" in vllm_engine.cpu_model_problem(moe, cuda=False)
    assert vllm_engine.cpu_model_problem(small, cuda=True) is None
