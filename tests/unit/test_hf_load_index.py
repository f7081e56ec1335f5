"""hf/load.tensor_index: which file each tensor is read from. With model.safetensors.index.json, its
weight_map (only the files it names); without one, every *.safetensors, and a name found in two
files is refused. Leftover shards never win silently."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from megatron_cispo.hf import export  # noqa: E402
from megatron_cispo.hf.load import tensor_index  # noqa: E402
from megatron_cispo.tools.make_tiny_hf import make_tiny_hf  # noqa: E402


@pytest.fixture()
def model(tmp_path):
    return make_tiny_hf("llama", tmp_path / "model", seed=1)


def _shard(model, tmp_path) -> dict:
    """Rewrite `model`'s weights as two shards with an index; returns the weight_map."""
    tensors = load_file(str(model / export.WEIGHTS))
    (model / export.WEIGHTS).unlink()
    names = sorted(tensors)
    weight_map = {n: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, n in enumerate(names)}
    for file in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == file}, str(model / file), metadata={"format": "pt"})
    (model / export.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_with_an_index_only_the_files_it_names_are_read(model, tmp_path):
    weight_map = _shard(model, tmp_path)
    stale = {"model.norm.weight": torch.full((64,), 7.0)}  # a leftover file that sorts last
    save_file(stale, str(model / "zz-leftover.safetensors"))
    index = tensor_index(str(model))
    assert {n: f.rsplit("/", 1)[-1] for n, (f, _) in index.items()} == weight_map


def test_a_leftover_model_safetensors_next_to_an_index_is_refused(model, tmp_path):
    tensors = load_file(str(model / export.WEIGHTS))
    _shard(model, tmp_path)
    save_file(tensors, str(model / export.WEIGHTS))
    with pytest.raises(ValueError, match="transformers loads model.safetensors") as e:
        tensor_index(str(model))
    assert "\n" not in str(e.value)


def test_a_tensor_the_index_names_in_a_missing_file_is_one_line(model, tmp_path):
    _shard(model, tmp_path)
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors.*missing") as e:
        tensor_index(str(model))
    assert "\n" not in str(e.value) and str(model / export.INDEX) in str(e.value)


def test_a_tensor_missing_from_the_file_the_index_names_is_one_line(model, tmp_path):
    weight_map = _shard(model, tmp_path)
    name = next(n for n, f in weight_map.items() if f.startswith("model-00001"))
    weight_map[name] = "model-00002-of-00002.safetensors"
    (model / export.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=f"{name} to .*does not hold it") as e:
        tensor_index(str(model))
    assert "\n" not in str(e.value)


def test_without_an_index_a_name_in_two_files_is_refused_naming_both(model, tmp_path):
    save_file({"model.norm.weight": torch.full((64,), 7.0)}, str(model / "model-extra.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight") as e:
        tensor_index(str(model))
    said = str(e.value)
    assert "\n" not in said and "model-extra.safetensors" in said and export.WEIGHTS in said


def test_an_unreadable_index_is_one_line(model, tmp_path):
    _shard(model, tmp_path)
    (model / export.INDEX).write_text("{not json")
    with pytest.raises(ValueError, match="index.json") as e:
        tensor_index(str(model))
    assert "\n" not in str(e.value)
