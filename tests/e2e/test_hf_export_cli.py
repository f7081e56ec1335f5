"""Weights out, through the CLI: run.export_hf on tp=2 pp=2 and `python -m megatron_cispo.export_hf`.

Round trip: run.steps=0 writes back the loaded model bit for bit (names, shapes, dtypes, values). After
training, the export CLI on a tp=2 pp=2 checkpoint equals the trainer's own export of that step, needs
only the source's config.json, and every export (qwen2 on tp=2 pp=2, qwen3_moe on tp=2+SP x ep=2) loads
in transformers with megatron's logprobs for its weights. Bad input (OUT over the source model or a
directory that is not an export included): one line, exit 2, nothing written.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from e2e_helpers import ROOT, env, ranks  # noqa: E402
from test_checkpoint_cross_version import other  # noqa: E402, F401 - the fixture: the other tier's python
from megatron_cispo.export_hf import main as export_main  # noqa: E402
from megatron_cispo.hf.export import MARKER  # noqa: E402
from megatron_cispo.tools.make_tiny_hf import make_tiny_hf  # noqa: E402

# the trainer's settings for a tiny HF run: transformers samples (rollout.engine=hf), one microbatch
HF_RUN = """model:
  hf_path: {hf_path}
  dtype: fp32
parallelism:
  tp: 2
  pp: 2
  micro_batch_size: 4
rollout:
  engine: hf
  task: reverse
  digits: 2
  prompts_per_step: 2
  group_size: 2
  staleness: 0
  precision: fp32
optimizer:
  lr: 0.01
  weight_decay: 0.5   # the random model earns no reward, so decay is what moves every matrix
run:
  export_hf: true
  run_dir: {run_dir}
  tensorboard: false
  log_interval: 1
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    return {f: make_tiny_hf(f, root / f, seed=5) for f in ("qwen2", "qwen3_moe")}


def _yaml(tmp_path: Path, hf_path: Path, run_dir: Path) -> str:
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(HF_RUN.format(hf_path=hf_path, run_dir=run_dir))
    return str(path)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and torch.equal(a[n], b[n]), n


def _export_cli(*args, check: bool = True, python: str = sys.executable) -> subprocess.CompletedProcess:
    proc = subprocess.run([python, "-m", "megatron_cispo.export_hf", *map(str, args)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("family,layout", [
    ("qwen2", ["parallelism.tp=2", "parallelism.pp=2"]),  # tied embeddings: the output layer is the embedding
    ("qwen3_moe", ["parallelism.tp=2", "parallelism.pp=2", "parallelism.sequence_parallel=true"]),
    ("qwen3_moe", ["parallelism.tp=1", "parallelism.pp=2", "parallelism.ep=2", "parallelism.micro_batch_size=2"]),
], ids=["qwen2-tp2-pp2", "qwen3_moe-tp2-pp2-sp", "qwen3_moe-pp2-ep2"])
def test_steps_0_exports_the_loaded_model_bit_for_bit(models, tmp_path, family, layout):
    run_dir = tmp_path / "run"
    proc = ranks(4, [_yaml(tmp_path, models[family], run_dir), "run.steps=0", *layout])
    out = run_dir / "hf" / "step_0"
    assert f"run.steps=0: wrote {out}" in proc.stdout
    _assert_same_tensors(_tensors(out), _tensors(models[family]))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):  # the weights' file too: same tensors, order, header and metadata
        assert (out / name).read_bytes() == (models[family] / name).read_bytes(), name
    assert json.loads((out / MARKER).read_text())["step"] == 0
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step_0"]  # no temporary left


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory) -> Path:
    """qwen2 trained 5 steps on tp=2 pp=2, checkpoints (and so exports) after steps 2 and 4, an export at the end."""
    tmp = tmp_path_factory.mktemp("hf_trained")
    run_dir = tmp / "run"
    ranks(4, [_yaml(tmp, models["qwen2"], run_dir), "run.steps=5", "run.checkpoint_interval=2"])
    return run_dir


@pytest.fixture(scope="module")
def trained_moe(models, tmp_path_factory) -> Path:
    """qwen3_moe trained 2 steps on tp=2+SP x ep=2 (expert TP 2, dp=2), a checkpoint and export after step 2."""
    tmp = tmp_path_factory.mktemp("hf_trained_moe")
    run_dir = tmp / "run"
    ranks(4, [_yaml(tmp, models["qwen3_moe"], run_dir), "run.steps=2", "run.checkpoint_interval=2",
              "parallelism.pp=1", "parallelism.ep=2", "parallelism.sequence_parallel=true",
              "parallelism.micro_batch_size=2"])
    return run_dir


def test_the_trainer_exports_at_every_checkpoint_and_at_the_end_and_the_weights_moved(trained, models):
    assert sorted(p.name for p in (trained / "hf").iterdir()) == ["step_2", "step_4", "step_5"]
    source, four, last = (_tensors(p) for p in (models["qwen2"], trained / "hf" / "step_4", trained / "hf" / "step_5"))
    assert sorted(last) == sorted(source)
    for a, b in ((source, four), (four, last)):
        assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_export_cli_equals_the_trainers_export_of_each_step(trained, tmp_path):
    proc = _export_cli(trained, tmp_path / "newest")
    assert "(step 4)" in proc.stdout
    _assert_same_tensors(_tensors(tmp_path / "newest"), _tensors(trained / "hf" / "step_4"))
    _export_cli(trained, tmp_path / "two", "--step", 2)
    _assert_same_tensors(_tensors(tmp_path / "two"), _tensors(trained / "hf" / "step_2"))
    names = [sorted(p.name for p in d.iterdir()) for d in (tmp_path / "two", trained / "hf" / "step_2")]
    assert names[0] == names[1]
    assert json.loads((tmp_path / "two" / MARKER).read_text())["step"] == 2
    _export_cli(trained, tmp_path / "two")  # an earlier export is replaced whole
    _assert_same_tensors(_tensors(tmp_path / "two"), _tensors(trained / "hf" / "step_4"))


def _run_on(trained: Path, was: Path, source: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the trained run's checkpoints whose config.yaml names `source` (not `was`) as model.hf_path."""
    run = tmp_path / name
    shutil.copytree(trained / "checkpoints", run / "checkpoints")
    for ckpt in (run / "checkpoints").iterdir():
        text = (ckpt / "config.yaml").read_text()
        assert f"hf_path: {was}\n" in text
        (ckpt / "config.yaml").write_text(text.replace(str(was), str(source)))
    return run


def test_export_cli_needs_only_the_sources_config_json(trained, models, tmp_path):
    """The source's weights are not read (they are replaced by the checkpoint's): gone, the export still works."""
    bare = tmp_path / "moved_model"
    bare.mkdir()
    shutil.copy(models["qwen2"] / "config.json", bare)
    _export_cli(_run_on(trained, models["qwen2"], bare, tmp_path, "run"), tmp_path / "out")
    _assert_same_tensors(_tensors(tmp_path / "out"), _tensors(trained / "hf" / "step_4"))
    mark = json.loads((tmp_path / "out" / MARKER).read_text())
    assert mark["step"] == 4 and mark["source"] == str(bare)


def test_export_cli_on_the_other_megatron_core_equals_this_ones_trainer_export(trained, tmp_path, other):
    """The checkpoint's layout is this tier's (common.pt on 0.16, the shards' common_state on 0.19)."""
    _export_cli(trained, tmp_path / "out", python=other[0])
    _assert_same_tensors(_tensors(tmp_path / "out"), _tensors(trained / "hf" / "step_4"))


# Each export (argv: pairs RUN_DIR EXPORT_DIR) in transformers against megatron (one process, tp=1) on
# the same weights: from the run's checkpoint of that step when there is one, else (the end-of-run
# export) from the export itself, which the steps=0 test shows megatron reads back bit for bit.
LOGPROBS = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from megatron_cispo.export_hf import _config
from megatron_cispo.runner import checkpoint, checkpoint_files, distributed
from megatron_cispo.runner.cpu_compat import import_megatron_core
from megatron_cispo.runner.model import ModelConfig, build_model

import_megatron_core()
distributed.init_distributed(seed=0)
tokens = torch.tensor([[10, 3, 1, 11, 1, 3, 13, 7, 2, 5, 0, 4, 12, 9]])
for run, export in zip(sys.argv[1::2], sys.argv[2::2]):
    step = json.loads((Path(export) / "megatron_cispo_export.json").read_text())["step"]
    path = checkpoint_files.step_dir(Path(run), step)
    if path.is_dir():
        model = _config(path).model
        chunks = build_model(model, tp=1, pp=1, wrap_ddp=False, load_weights=False)
        checkpoint.load_model(path, chunks=chunks)
    else:
        model = ModelConfig(hf_path=export)
        chunks = build_model(model, tp=1, pp=1, wrap_ddp=False)
    with torch.no_grad():
        logits = chunks[0].eval()(tokens, torch.arange(tokens.shape[1])[None], None)[..., :model.vocab_size]
        ours = torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, tokens[0, 1:, None])
        hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        theirs = torch.log_softmax(hf(tokens).logits.float(), -1)[0, :-1].gather(-1, tokens[0, 1:, None])
    print("export", export, "checkpoint", path.is_dir(), "max_abs_diff", (ours - theirs).abs().max().item())
distributed.shutdown()
"""


def test_every_export_loads_in_transformers_with_megatrons_logprobs(trained, trained_moe, models, tmp_path):
    exports = [(run, d) for run in (trained, trained_moe) for d in sorted((run / "hf").iterdir())]
    assert [d.name for _, d in exports] == ["step_2", "step_4", "step_5", "step_2"]
    moe = _tensors(trained_moe / "hf" / "step_2")
    assert not torch.equal(moe["model.embed_tokens.weight"], _tensors(models["qwen3_moe"])["model.embed_tokens.weight"])
    script = tmp_path / "logprobs.py"
    script.write_text(LOGPROBS)
    proc = subprocess.run([sys.executable, str(script), *(str(p) for pair in exports for p in pair)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("export ")]
    assert [(r[1], r[3]) for r in rows] == [(str(d), str(d.name != "step_5")) for _, d in exports], proc.stdout
    for r in rows:
        print(*r)  # the figure docs/launch.md quotes (pytest -s)
        assert float(r[5]) <= 1e-5, r


def test_export_cli_bad_input_is_one_line_exit_2_and_writes_nothing(trained, models, tmp_path, capsys):
    out = tmp_path / "out"
    empty = tmp_path / "empty_run"
    empty.mkdir()
    synthetic = tmp_path / "synthetic_run" / "checkpoints"  # a copy whose config has no model.hf_path
    shutil.copytree(trained / "checkpoints", synthetic)
    for ckpt in synthetic.iterdir():
        text = (ckpt / "config.yaml").read_text().replace("engine: hf", "engine: torch")
        text = text.replace("export_hf: true", "export_hf: false")  # what a synthetic-GPT run saves
        (ckpt / "config.yaml").write_text("\n".join(l for l in text.splitlines() if "hf_path" not in l) + "\n")
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "not_a_model" / "notes.txt").write_text("keep me")
    # a run whose model.hf_path is a copy (old code replaced it), and another model directory
    source = tmp_path / "models" / "source"
    shutil.copytree(models["qwen2"], source)
    run = _run_on(trained, models["qwen2"], source, tmp_path, "copied_run")
    other_model = shutil.copytree(source, tmp_path / "other_model")
    before = {d: {p.name: p.read_bytes() for p in d.iterdir()} for d in (source, other_model)}
    cases = {
        (tmp_path / "missing", out): "no such directory",
        (empty, out): "no complete checkpoint",
        (trained, out, "--step", 7): "--step 7:",
        (synthetic.parent, out): "model.hf_path is not set",
        (trained, tmp_path / "not_a_model"): "is not a megatron_cispo export",
        (run, source): "is the source model directory",
        (run, tmp_path / "models"): "contains the source model directory",
        (run, source / "sub"): "lies inside the source model directory",
        (run, other_model): "is not a megatron_cispo export",
    }
    # The first case through `python -m megatron_cispo.export_hf`, the others through its main() in this
    # process: each refusal comes before any process group or model, and a subprocess each cost an
    # interpreter and the torch, transformers and megatron-core imports (docs/testing.md).
    for i, (args, said) in enumerate(cases.items()):
        if i == 0:
            proc = _export_cli(*args, check=False)
            code, err = proc.returncode, proc.stderr
        else:
            capsys.readouterr()
            code = export_main([str(a) for a in args])
            err = capsys.readouterr().err
        assert code == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0] and lines[0].startswith("export_hf: "), (args, err)
        assert not out.exists()
    assert (tmp_path / "not_a_model" / "notes.txt").read_text() == "keep me"
    assert {d: {p.name: p.read_bytes() for p in d.iterdir()} for d in (source, other_model)} == before
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["source"]


def test_export_cli_that_cannot_write_says_so_in_one_line_exit_6(trained, tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = _export_cli(trained, tmp_path / "a_file" / "out", check=False)
    assert proc.returncode == 6, proc.stdout + proc.stderr
    # megatron-core 0.19 warns that GPTModel is deprecated while the model is built; ours is one line
    lines = [line for line in proc.stderr.strip().splitlines() if "GPTModel IS DEPRECATED" not in line]
    assert len(lines) == 1 and "Hugging Face export to" in lines[0] and "not written" in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
