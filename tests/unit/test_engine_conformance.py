"""The engine protocol (rollout/engine.py) on every registered engine, the same cases for each: the trainer's
weights in through update_weights as a real bucket stream (stream_buckets from a megatron-core model, at
least 10 buckets), then generate() equal to the trainer's logprobs in fp32 (megatron's GPTModel on the
same weights, teacher-forced on the sampled tokens); kept sets (top-k) with the logprobs renormalised over
them; a stop token ending a sample where the free run drew it; a push that fails partway or ends short
leaving the engine on its previous weights; close, after which a call raises. Each engine runs in one
process with the trainer's model (spawn, world 1), so the stream is the one a run sends.

vLLM is skipped without vLLM unless CISPO_REQUIRE_VLLM=1 (then it fails). A plugin engine (one file plus
its registration, loaded through MEGATRON_CISPO_PLUGINS) runs through the config and the sampler.
"""
import os
import textwrap

import pytest
import torch

from megatron_cispo.rollout.engine import ENGINES
from megatron_cispo.rollout.vllm_engine import vllm_missing
from megatron_cispo.testing import spawn

if vllm_missing() and os.environ.get("CISPO_REQUIRE_VLLM") == "1":
    pytest.fail(vllm_missing(), pytrace=False)
BUCKET = 8192  # bytes: every model below takes more than 10 buckets
PROMPT_LENS = (5, 3)  # two prompts of different lengths


def _synthetic_cfg():
    from megatron_cispo.runner.model import ModelConfig

    return ModelConfig(vocab_size=24, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=2,
                       ffn_hidden_size=48, init_std=0.1)


def _manifest(spec, cfg, chunks):
    from megatron_cispo.base.weights import gather_full_state
    from megatron_cispo.hf.mapping import hf_shapes

    if spec.names == "hf":
        return hf_shapes(cfg.arch)
    return {k: tuple(v.shape) for k, v in gather_full_state(chunks).items()}


def _trainer_logprobs(chunks, vocab, prompt, completion):
    """megatron's fp32 log-softmax of each sampled token, teacher-forced: [len(completion), vocab] and the picks."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = chunks[0](ids, torch.arange(ids.shape[1])[None], None)[0, :, :vocab].float()
    full = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return full, full.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]


def conformance_worker(name, hf_path, log_path):
    """Every protocol case on engine `name`; returns figures for the test to judge."""
    from megatron_cispo.rollout.engine import EngineStart, Sampling, engine_spec
    from megatron_cispo.rollout.weight_stream import stream_buckets
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model

    distributed.init_distributed()
    spec = engine_spec(name)
    cfg = ModelConfig(hf_path=hf_path) if spec.hf_model else _synthetic_cfg()
    chunks = [c.eval() for c in build_model(cfg, tp=1, pp=1, seed=5, wrap_ddp=False)]
    vocab = cfg.vocab_size
    eng = spec.open(EngineStart(model=cfg, precision="fp32", seed=3, max_model_len=32, kept_sets=True,
                                log_path=log_path, start_timeout_s=600, call_timeout_s=300))
    out = {}
    manifest = _manifest(spec, cfg, chunks)

    def push(tensors=None, cut_at=None, short=False):
        for i, b in enumerate(stream_buckets(chunks, namer=spec.namer(cfg.arch), bucket_bytes=BUCKET, tensors=tensors)):
            if cut_at is not None and i == cut_at:
                raise RuntimeError("stream cut by the test")
            if short and i >= 2:
                return  # the stream ends early: tensors missing
            yield b

    try:
        out["sync"] = eng.update_weights(push(), manifest=manifest, bucket_bytes=BUCKET)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        free = Sampling(n=2, max_new_tokens=6, seeds=[0, 10], temperature=1.0)
        first = eng.generate(prompts, free)
        out["shape"] = [[len(c.token_ids) for c in per] for per in first]
        out["reasons"] = sorted({c.finish_reason for per in first for c in per})
        out["logprob_err"] = max((c_lp - _trainer_logprobs(chunks, vocab, p, c)[1]).abs().max().item()
                                 for p, per in zip(prompts, first) for c in per
                                 for c_lp in [torch.tensor(c.logprobs)])
        out["distinct"] = len({tuple(c.token_ids) for per in first for c in per})
        # kept sets: top-k 3, logprobs renormalised over the set
        topk = eng.generate(prompts, Sampling(n=2, max_new_tokens=6, seeds=[0, 10], top_k=3))
        errs, sizes, inside = [], [], True
        for p, per in zip(prompts, topk):
            for c in per:
                full, _ = _trainer_logprobs(chunks, vocab, p, c)
                for t, (tok, ids) in enumerate(zip(c.token_ids, c.kept)):
                    sizes.append(len(ids))
                    inside &= tok in ids
                    want = full[t, tok] - torch.logsumexp(full[t, ids], 0)
                    errs.append(abs(c.logprobs[t] - want.item()))
        out["kept_err"], out["kept_sizes"], out["kept_inside"] = max(errs), sorted(set(sizes)), inside
        # a stop token: the third token the free run drew for prompt 0, sample 0
        ref = first[0][0].token_ids
        stop = ref[2]
        stopped = eng.generate(prompts[:1], Sampling(n=2, max_new_tokens=6, seeds=[0], stop_token_ids=[stop]))[0][0]
        end = ref.index(stop) + 1
        out["stop"] = (stopped.token_ids == ref[:end], stopped.finish_reason, stopped.token_ids[-1] == stop)
        # a push that fails partway, then one that ends short: the engine keeps its weights
        scaled = [{n: p.detach() * 1.5 for n, p in getattr(c, "module", c).named_parameters()} for c in chunks]
        errors = []
        for kw in (dict(cut_at=3), dict(short=True)):
            try:
                eng.update_weights(push(scaled, **kw), manifest=manifest, bucket_bytes=BUCKET)
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - what each engine raises is the engine's own
                errors.append(str(e).splitlines()[0])
        out["failed_pushes"] = errors
        again = eng.generate(prompts, free)
        out["kept_weights"] = [[c.token_ids for c in per] for per in again] == [[c.token_ids for c in per] for per in first]
        # the scaled weights, complete: the samples change (the case above could not pass by accident)
        eng.update_weights(push(scaled), manifest=manifest, bucket_bytes=BUCKET)
        moved = eng.generate(prompts, free)
        out["moved"] = [[c.logprobs for c in per] for per in moved] != [[c.logprobs for c in per] for per in first]
    finally:
        eng.close()
    try:
        eng.generate(prompts, free)
        out["after_close"] = None
    except Exception as e:  # noqa: BLE001
        out["after_close"] = type(e).__name__
    return out


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    return str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("conformance") / "qwen2", hidden=128, seed=2))


SHIPPED = ("torch", "hf", "vllm")


def test_every_shipped_engine_is_registered_and_covered_here():
    assert set(SHIPPED) <= set(ENGINES)


@pytest.mark.parametrize("name", SHIPPED)
def test_engine_keeps_the_protocol(name, qwen2, tmp_path):
    if name == "vllm" and vllm_missing():
        pytest.skip(vllm_missing())
    (r,) = spawn(conformance_worker, 1, (name, qwen2, str(tmp_path / "engine.log")), timeout_s=600)
    assert r["sync"]["sync/buckets"] >= 10, r["sync"]
    assert r["shape"] == [[6, 6], [6, 6]] and r["reasons"] == ["length"]
    assert r["distinct"] >= 3  # the seeds differ, so do the samples
    assert r["logprob_err"] <= 1e-4, r["logprob_err"]  # the trainer's logprobs, fp32
    assert r["kept_err"] <= 1e-4 and r["kept_inside"] and min(r["kept_sizes"]) >= 3, r
    assert r["stop"] == (True, "stop", True), r["stop"]
    assert all(r["failed_pushes"]), r["failed_pushes"]  # both raised, in one line each
    assert r["kept_weights"] and r["moved"]
    assert r["after_close"] is not None


PLUGIN = textwrap.dedent('''
    """A plugin engine: the synthetic GPT's engine under another name, registered from a plugin module."""
    from megatron_cispo.rollout.engine import EngineSpec, register_engine
    from megatron_cispo.rollout.torch_engine import TorchEngine, open_engine as torch_open

    class EchoEngine(TorchEngine):
        opened = 0

    def open_engine(start):
        EchoEngine.opened += 1
        eng = torch_open(start)
        eng.__class__ = EchoEngine
        return eng

    register_engine(EngineSpec("echo", "cispo_echo_engine:open_engine", hf_model=False, prompt_files=False,
                               overlaps=False, routes=True, names="megatron"))
''')


def test_a_new_engine_is_one_file_and_its_name(tmp_path, monkeypatch):
    """One file (registration included), named in MEGATRON_CISPO_PLUGINS: the config accepts it, its rules
    come from its spec, and the sampler samples with it exactly what the torch engine samples."""
    from megatron_cispo.integrations.plugins import load_plugins
    from megatron_cispo.rollout.sampler import Sampler
    from megatron_cispo.runner.experiment import load_experiment

    (tmp_path / "cispo_echo_engine.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        load_plugins("cispo_echo_engine")
        with pytest.raises(ValueError, match="rollout.mode='async'"):
            load_experiment("yaml_configs/demo_cpu.yaml", ["rollout.engine=echo", "rollout.mode=async"])
        cfg = load_experiment("yaml_configs/demo_cpu.yaml", ["rollout.engine=echo"])
        base = load_experiment("yaml_configs/demo_cpu.yaml", [])
        state = _synthetic_state(cfg.model)
        batches = []
        for c in (cfg, base):
            s = Sampler(c.model, c.rollout, seed=1)
            s.sync(0, state)
            batches.append(s.rollouts(0))
            s.close()
        import cispo_echo_engine

        assert cispo_echo_engine.EchoEngine.opened == 1
        assert torch.equal(batches[0].tokens, batches[1].tokens)
        assert torch.equal(batches[0].rollout_logprobs, batches[1].rollout_logprobs)
    finally:
        ENGINES.pop("echo", None)
    with pytest.raises(ValueError, match="not a registered engine; registered: .*'torch'"):
        load_experiment("yaml_configs/demo_cpu.yaml", ["rollout.engine=echo"])


def _synthetic_state(model_cfg) -> dict:
    """A full state under megatron's names for model_cfg's GPT, seeded (no megatron-core needed)."""
    from megatron_cispo.rollout.torch_engine import TorchGPT

    g = torch.Generator().manual_seed(0)
    h, v, f, s = model_cfg.hidden_size, model_cfg.vocab_size, model_cfg.ffn_size, model_cfg.seq_length
    shapes = {"embedding.word_embeddings.weight": (v, h), "embedding.position_embeddings.weight": (s, h),
              "decoder.final_layernorm.weight": (h,), "output_layer.weight": (v, h)}
    for i in range(model_cfg.num_layers):
        p = f"decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (3 * h, h),
                       p + "self_attention.linear_proj.weight": (h, h), p + "pre_mlp_layernorm.weight": (h,),
                       p + "mlp.linear_fc1.weight": (f, h), p + "mlp.linear_fc2.weight": (h, f)})
    state = {k: (torch.ones(sh) if len(sh) == 1 else torch.randn(*sh, generator=g) * 0.2) for k, sh in shapes.items()}
    TorchGPT(state, model_cfg)  # every name the engine reads is there
    return state


@pytest.mark.parametrize("overrides,says", [
    (["rollout.engines=2"], "rollout.engines=2: the 'torch' engine runs inside the trainer's process, one copy"),
    (["rollout.engines=0"], "rollout.engines must be >= 1, got 0"),
    (["rollout.sync=disk"], "rollout.sync='disk' reloads an exported HF directory, which the 'torch' engine does not"),
    (["rollout.mode=async"], "rollout.mode='async' generates beside the trainer"),
    (["rollout.engine=nope"], "rollout.engine='nope' is not a registered engine; registered: ['hf', 'torch', 'vllm']"),
    (["rollout.placement=ray"], "rollout.placement='ray' runs engines in their own processes, which the 'torch' "
                                "engine is not"),
    (["rollout.on_engine_death=restart"], "rollout.on_engine_death='restart' runs engines in their own processes"),
    (["rollout.placement=k8s"], "rollout.placement: expected 'local' | 'ray'"),
])
def test_what_an_engine_cannot_do_is_refused_in_one_line_where_the_config_is_read(overrides, says):
    from megatron_cispo.config import ConfigError
    from megatron_cispo.runner.experiment import load_experiment

    with pytest.raises(ConfigError) as e:
        load_experiment("yaml_configs/demo_cpu.yaml", overrides)
    assert says in str(e.value) and "\n" not in str(e.value)
