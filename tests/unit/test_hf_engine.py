"""rollout.engine=hf: transformers' own model on the trainer's synced weights (rollout/hf_engine.py), and the
Sampler that samples with it.

The engine's logits equal transformers' from_pretrained of the model directory (the export mapping
loses nothing) and megatron's GPTModel built from the same directory (the trainer and the hf
sampler agree in fp32), for every family; the Sampler keeps one engine per version and the task
scores any of the HF vocabulary's ids, a non-task id as wrong.
"""
import pytest
import torch

from megatron_cispo.testing import spawn

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # untied, tied + qkv bias, qk-norm, experts


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    root = tmp_path_factory.mktemp("tiny_hf")
    return {f: str(make_tiny_hf(f, root / f, seed=3)) for f in FAMILIES}


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 11), generator=torch.Generator().manual_seed(seed))


def _disk_state(path: str) -> dict[str, torch.Tensor]:
    """The model directory's tensors as full megatron tensors (what gather_full_state holds at step 0)."""
    from safetensors.torch import load_file

    from megatron_cispo.hf.arch import read_arch
    from megatron_cispo.hf.mapping import from_hf

    return from_hf(load_file(f"{path}/model.safetensors"), read_arch(path))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_logits_equal_transformers_from_pretrained_fp32(models, family):
    import transformers

    from megatron_cispo.hf.arch import read_arch
    from megatron_cispo.rollout.hf_engine import HFEngine

    path = models[family]
    arch = read_arch(path)
    tokens = _tokens(arch.vocab_size)
    want = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = want(input_ids=tokens).logits
    got = HFEngine.from_state(_disk_state(path), arch, dtype=torch.float32).logits(tokens)
    assert got.shape == (3, 11, arch.vocab_size) and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-6


def megatron_vs_engine_worker(paths):
    """One process, tp=1: per family, max |megatron GPTModel logits - HFEngine logits| on the
    megatron model's gathered full state (what Sampler.sync receives), over the real vocabulary."""
    from megatron_cispo.rollout.hf_engine import HFEngine
    from megatron_cispo.runner import distributed
    from megatron_cispo.runner.model import ModelConfig, build_model
    from megatron_cispo.base.weights import gather_full_state

    distributed.init_distributed()
    out = {}
    for family, path in paths.items():
        cfg = ModelConfig(hf_path=path)
        chunks = build_model(cfg, tp=1, pp=1)
        tokens = _tokens(cfg.vocab_size, seed=1)
        with torch.no_grad():
            want = chunks[0](tokens, torch.arange(tokens.shape[1])[None], None)[..., :cfg.vocab_size]
        got = HFEngine.from_state(gather_full_state(chunks), cfg.arch, dtype=torch.float32).logits(tokens)
        out[family] = (got - want).abs().max().item()
    return out


def test_hf_engine_logits_equal_megatron_model_from_the_same_directory_fp32(models):
    (errs,) = spawn(megatron_vs_engine_worker, 1, (models,), timeout_s=300)
    assert set(errs) == set(FAMILIES)
    for family, err in errs.items():
        assert err <= 1e-5, (family, err)


def _sampler(path: str, **rollout):
    from megatron_cispo.rollout.sampler import Sampler
    from megatron_cispo.runner.experiment import RolloutConfig
    from megatron_cispo.runner.model import ModelConfig

    cfg = RolloutConfig(engine="hf", staleness=0, precision="fp32", prompts_per_step=4, group_size=4, digits=3,
                        **rollout)
    return Sampler(ModelConfig(hf_path=path), cfg, seed=7)


def test_hf_sampler_builds_each_version_once_and_samples_transformers_logprobs(models):
    from megatron_cispo.rollout.hf_engine import HFEngine

    path = models["qwen2"]
    sampler = _sampler(path, temperature=0.7)
    state = _disk_state(path)
    sampler.sync(0, state)
    engine = sampler.engine(0)
    assert isinstance(engine, HFEngine) and sampler.engine(0) is engine  # cached, not rebuilt
    batch = sampler.rollouts(0)
    # the rollout logprobs are transformers' log-softmax at temperature 0.7 of the sampled tokens
    logits = engine.logits(batch.tokens[:, :-1]).float() / 0.7
    want = torch.log_softmax(logits, -1).gather(2, batch.tokens[:, 1:, None])[..., 0]
    mask = batch.loss_mask
    assert mask.any() and (batch.rollout_logprobs[mask] - want[mask]).abs().max().item() <= 1e-5
    sampler.sync(1, {k: v * 1.01 for k, v in state.items()})
    assert sampler.engine(1) is not engine  # a new version, a new engine


def test_hf_sampler_draws_any_vocabulary_id_and_a_non_task_id_scores_wrong(models):
    path = models["qwen2"]
    sampler = _sampler(path, task="dedup", reward="per_position", top_k=50)
    sampler.sync(0, _disk_state(path))
    batch = sampler.rollouts(0)
    task = sampler.task
    answers = batch.tokens[:, -task.answer_len:]
    # a random model over 300 ids draws mostly ids past the task's 14 (base + 4)
    outside = answers >= task.vocab_size
    assert outside.any() and int(batch.tokens.max()) < 300
    assert not batch.correct[outside].any()
    assert batch.keep is not None and int(batch.keep.ids.max()) < 300
    assert ((0 <= batch.rewards) & (batch.rewards <= 1)).all()


def test_task_scores_an_hf_id_past_its_symbols_as_a_wrong_position():
    from megatron_cispo.rollout.task import Task
    from megatron_cispo.runner.experiment import RolloutConfig

    task = Task(RolloutConfig(task="reverse", digits=3))
    bos, sep = task.bos, task.sep
    # prompt 1 2 3 -> answer 3 2 1; the first answer token is HF id 299, far past the task's 14 ids
    tokens = torch.tensor([[bos, 1, 2, 3, sep, 299, 2, 1], [bos, 1, 2, 3, sep, 3, 2, 1]])
    rewards, correct = task.rewards(tokens)
    assert correct.tolist() == [[False, True, True], [True, True, True]]
    assert rewards.tolist() == pytest.approx([2 / 3, 1.0])
