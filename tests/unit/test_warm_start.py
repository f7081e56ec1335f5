"""make_tiny_hf's warm start (--pretrain) and the tokenizer the shipped task needs: specials survive a
save and reload, a row the tokenizer cannot encode is one line naming it, and the supervised phase learns."""
import json

import pytest

from megatron_cispo.tools.make_tiny_hf import main, make_tiny_hf, pretrain, sft_examples, tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return make_tiny_hf("qwen2", tmp_path_factory.mktemp("warm") / "m", vocab=16, heads=2, kv_heads=2)


def test_the_saved_tokenizer_round_trips_the_task_and_keeps_its_specials(saved):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(saved))
    assert tok.encode("<bos>47+18<sep>") == [10, 4, 7, 12, 1, 8, 11]  # <sep> registered: not dropped on reload
    assert tok.decode([5, 6, 13], skip_special_tokens=True) == "56" and tok.eos_token_id == 13


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_row_the_tokenizer_cannot_encode_is_one_line_naming_it(tmp_path, capsys):
    from megatron_cispo.tools.make_tiny_hf import _tokenizer

    tok = _tokenizer(16)  # the one the tool trains with (its unknown symbol reads as <extra_0>)
    bad = _rows(tmp_path / "bad.jsonl", [{"prompt": "<bos>1+2<sep>", "answer": "3"}, {"prompt": "<bos>4a+1<sep>", "answer": "5"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: the tokenizer cannot encode '<bos>4a\+1<sep>'"):
        sft_examples(bad, tok, 10)
    with pytest.raises(ValueError, match=r"nofield.jsonl:1: expected a JSON object with 'prompt' and 'answer'"):
        sft_examples(_rows(tmp_path / "nofield.jsonl", [{"prompt": "<bos>1+2<sep>"}]), tok, 10)
    code = main(["--family", "qwen2", "--vocab", "16", "--heads", "2", "--kv-heads", "2", "--pretrain", str(bad),
                 "--pretrain-steps", "3", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "bad.jsonl:2" in err, err


def test_the_supervised_phase_lowers_the_loss_on_the_task(saved):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_cispo.rollout.arith import add2_rows

    tok = AutoTokenizer.from_pretrained(str(saved))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab=16, heads=2, kv_heads=2))
    rows = [r for r in add2_rows()[:64]]
    examples = [tok.encode(r["prompt"]) + tok.encode(r["answer"]) + [13] for r in rows]
    first = pretrain(model, examples, steps=1, seed=0)
    last = pretrain(model, examples, steps=60, seed=0)
    assert last < 0.7 * first, (first, last)
