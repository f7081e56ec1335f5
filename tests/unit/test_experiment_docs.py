"""docs/configuration.md is generated from the dataclasses; this fails when the two drift apart."""
from pathlib import Path

from megatron_cispo.runner.config_doc import config_doc

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_doc_matches_the_dataclasses():
    assert DOC.read_text() == config_doc(), (
        "docs/configuration.md is stale; regenerate it with "
        "`python -m megatron_cispo.runner.config_doc > docs/configuration.md`")


def test_configuration_doc_lists_every_loss_key():
    from megatron_cispo.config import LossConfig, describe_fields

    text = DOC.read_text()
    for key, *_ in describe_fields(LossConfig, "loss"):
        assert f"`{key}`" in text
