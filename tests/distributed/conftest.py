"""Session fixtures shared by the distributed tests: tiny Hugging Face models (hf_helpers), made once."""
import pytest


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """family -> tiny model directory (llama, mistral, qwen2, qwen3, qwen3_moe), "qwen3_moe_unnorm"
    (qwen3_moe with norm_topk_prob=false) and "qwen2_deep_sharded": an 8-layer qwen2 in several
    safetensors files."""
    from hf_helpers import make_deep_sharded, make_models

    root = tmp_path_factory.mktemp("hf_models")
    return {**make_models(root), "qwen2_deep_sharded": make_deep_sharded(root / "deep")}
