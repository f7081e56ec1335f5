"""hf/export.write_hf_dir: a directory transformers loads with the source model's logits, sharded as
transformers shards, written atomically (a failure leaves no half directory and keeps the old one).
write_hf_stream, for tensors that arrive one by one, writes the same directory shard by shard."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from megatron_cispo.hf import export  # noqa: E402
from megatron_cispo.hf.arch import read_arch  # noqa: E402
from megatron_cispo.runner import checkpoint_files  # noqa: E402
from megatron_cispo.tools.make_tiny_hf import make_tiny_hf  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"])
def source(request, tmp_path_factory):
    return make_tiny_hf(request.param, tmp_path_factory.mktemp(request.param) / "model", seed=3)


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = torch.tensor([[10, 3, 1, 4, 1, 5, 11, 5, 1, 4, 1, 3, 13]])
    with torch.no_grad():
        return model(tokens).logits


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_export_loads_in_transformers_with_identical_logits(source, tmp_path):
    arch = read_arch(source)
    hf = _tensors(source)
    out = export.write_hf_dir(hf, arch, tmp_path / "out")
    names = sorted(p.name for p in out.iterdir())
    # config, generation config, tokenizer, weights, and the marker that says an export wrote it
    assert names == sorted([p.name for p in source.iterdir()] + [export.MARKER])
    from megatron_cispo import __version__

    assert json.loads((out / export.MARKER).read_text()) == {"megatron_cispo": __version__,
                                                              "source": str(source), "step": None}
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    from safetensors import safe_open

    with safe_open(str(out / export.WEIGHTS), "pt") as h:
        assert h.metadata() == {"format": "pt"}
    back = _tensors(out)
    assert sorted(back) == sorted(hf)
    for n, t in hf.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n
    assert torch.equal(_logits(out), _logits(source))


def test_export_casts_to_the_source_dtype_unless_told(source, tmp_path):
    arch = read_arch(source)
    hf = {n: t.double() for n, t in _tensors(source).items()}
    out = export.write_hf_dir(hf, arch, tmp_path / "fp32")
    assert {t.dtype for t in _tensors(out).values()} == {torch.float32}
    out = export.write_hf_dir(hf, arch, tmp_path / "bf16", dtype=torch.bfloat16)
    assert {t.dtype for t in _tensors(out).values()} == {torch.bfloat16}


def test_sharded_export_has_an_index_that_transformers_loads(source, tmp_path):
    arch = read_arch(source)
    hf = _tensors(source)
    out = export.write_hf_dir(hf, arch, tmp_path / "out", max_shard_bytes=100_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (out / export.WEIGHTS).exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(s.stat().st_size <= 100_000 + 10_000 for s in shards)  # + header; no tensor here is that big
    index = json.loads((out / export.INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(hf)
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf.values())
    assert torch.equal(_logits(out), _logits(source))


def test_a_streamed_export_is_the_same_model_in_the_same_shards(source, tmp_path):
    """Sharded; the one-file case is every end-to-end export's (runner/export.export_chunks streams)."""
    max_shard_bytes = 100_000
    arch = read_arch(source)
    hf = _tensors(source)
    whole = export.write_hf_dir(hf, arch, tmp_path / "whole", max_shard_bytes=max_shard_bytes)
    seen = []

    def one_by_one():
        for name, t in hf.items():
            seen.append(name)
            yield name, t
    out = export.write_hf_stream(one_by_one(), arch, tmp_path / "streamed", max_shard_bytes=max_shard_bytes)
    assert seen == list(hf)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in whole.iterdir())
    got = _tensors(out)
    assert set(got) == set(hf) and all(torch.equal(got[k], hf[k].to(got[k].dtype)) for k in hf)
    index = json.loads((out / export.INDEX).read_text())
    assert index["metadata"] == json.loads((whole / export.INDEX).read_text())["metadata"]
    assert all(s.stat().st_size <= max_shard_bytes + 10_000 for s in out.glob("model-*.safetensors"))
    assert torch.equal(_logits(out), _logits(source))


def _fail_on_second_shard(monkeypatch):
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return calls


def test_a_failed_export_leaves_no_directory_and_no_temporary(source, tmp_path, monkeypatch):
    arch = read_arch(source)
    calls = _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        export.write_hf_dir(_tensors(source), arch, tmp_path / "out", max_shard_bytes=100_000)
    assert len(calls) == 2  # one shard was written before the failure
    assert sorted(os.listdir(tmp_path)) == []


def test_a_failed_rewrite_keeps_the_existing_export(source, tmp_path, monkeypatch):
    arch = read_arch(source)
    hf = _tensors(source)
    out = export.write_hf_dir(hf, arch, tmp_path / "out")
    before = _files(out)
    _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError):
        export.write_hf_dir({n: t + 1 for n, t in hf.items()}, arch, out, max_shard_bytes=100_000)
    assert _files(out) == before and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_failed_rename_puts_the_existing_export_back(source, tmp_path, monkeypatch):
    arch = read_arch(source)
    hf = _tensors(source)
    out = export.write_hf_dir(hf, arch, tmp_path / "out")
    before = _files(out)
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(".out.tmp"):
            raise OSError(5, "Input/output error", str(src))
        real(src, dst)

    monkeypatch.setattr(checkpoint_files.os, "replace", replace)
    with pytest.raises(OSError, match="Input/output"):
        export.write_hf_dir({n: t + 1 for n, t in hf.items()}, arch, out)
    assert _files(out) == before and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_rewrite_replaces_the_export_whole(source, tmp_path):
    arch = read_arch(source)
    hf = _tensors(source)
    out = export.write_hf_dir(hf, arch, tmp_path / "out", max_shard_bytes=100_000)
    export.write_hf_dir({n: t + 1 for n, t in hf.items()}, arch, out)
    assert not list(out.glob("model-*")) and not (out / export.INDEX).exists()  # no stale shards left
    assert torch.equal(_tensors(out)["model.norm.weight"], hf["model.norm.weight"] + 1)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_the_marker_records_the_step(source, tmp_path):
    out = export.write_hf_dir(_tensors(source), read_arch(source), tmp_path / "out", step=7)
    assert json.loads((out / export.MARKER).read_text())["step"] == 7


@pytest.mark.parametrize("where", ["is", "contains", "lies inside"])
def test_an_export_over_the_source_model_is_refused_and_touches_nothing(source, where):
    out = {"is": source, "contains": source.parent, "lies inside": source / "sub"}[where]
    before = _files(source)
    with pytest.raises(ValueError, match=f"{where} the source model directory") as e:
        export.write_hf_dir({n: t + 1 for n, t in _tensors(source).items()}, read_arch(source), out)
    assert "\n" not in str(e.value) and _files(source) == before
    assert sorted(p.name for p in source.parent.iterdir()) == ["model"]


def test_only_an_earlier_export_is_replaced(source, tmp_path):
    """A model directory that an export did not write (no marker) is the user's: never replaced."""
    arch, hf = read_arch(source), _tensors(source)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name, data in _files(source).items():
        (theirs / name).write_bytes(data)
    before = _files(theirs)
    with pytest.raises(ValueError, match="is not a megatron_cispo export"):
        export.write_hf_dir(hf, arch, theirs)
    assert _files(theirs) == before
    (tmp_path / "empty").mkdir()
    export.write_hf_dir(hf, arch, tmp_path / "empty")  # an empty directory holds nothing to lose
    export.write_hf_dir(hf, arch, tmp_path / "empty")  # nor does an export
    assert (tmp_path / "empty" / export.MARKER).is_file()


def test_model_hf_path_is_made_absolute_so_a_saved_config_works_from_any_directory(source, monkeypatch):
    from megatron_cispo.runner.model import ModelConfig

    monkeypatch.chdir(source.parent)
    cfg = ModelConfig(hf_path="model")
    assert cfg.hf_path == str(source) and os.path.isabs(cfg.hf_path)
