"""The prompt stream: a seeded permutation per epoch, exact resume, JSONL = Parquet, the shipped task's
tokens on the tiny tokenizer, and one line for every bad input."""
import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest

from megatron_cispo.rollout import arith
from megatron_cispo.rollout.prompts import PromptStream, decode

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "yaml_configs" / "data" / "add_small.jsonl"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron_cispo.tools.make_tiny_hf import make_tiny_hf

    return str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2"))


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _small(tmp_path, n=7) -> Path:
    return _jsonl(tmp_path / "small.jsonl", [{"prompt": f"<bos>{i}+{i}<sep>", "i": i} for i in range(n)])


def _rows(prompts):
    return [(p.record["a"], p.record["b"]) for p in prompts]


def test_each_epoch_is_a_permutation_in_an_order_keyed_by_seed_and_epoch(tok):
    stream = PromptStream(str(SHIPPED), tokenizer_path=tok, seed=3)
    taken = stream.take(250)  # two full epochs and half of the third
    assert len(stream) == 100 and [p.index for p in taken] == list(range(250))
    every = sorted((a, b) for a in range(10) for b in range(10))
    e0, e1, e2 = _rows(taken[:100]), _rows(taken[100:200]), _rows(taken[200:])
    assert sorted(e0) == every and sorted(e1) == every and len(set(e2)) == 50
    assert e0 != e1 and e0 != every  # shuffled, and anew each epoch
    assert _rows(PromptStream(str(SHIPPED), tokenizer_path=tok, seed=3).take(250)) == e0 + e1 + e2
    assert _rows(PromptStream(str(SHIPPED), tokenizer_path=tok, seed=4).take(100)) != e0


def test_a_resumed_stream_continues_exactly_mid_epoch_and_across_an_epoch_boundary(tok, tmp_path):
    path = str(_small(tmp_path))  # 7 rows: the takes below stop mid-epoch and cross boundaries inside
    whole = [(p.index, p.record["i"]) for p in PromptStream(path, tokenizer_path=tok, seed=1).take(30)]
    pieces, state = [], None
    for n in (5, 4, 9, 12):  # stops at 5 (mid epoch 0), 9 (mid epoch 1, after crossing 7), 18, 30
        stream = PromptStream(path, tokenizer_path=tok, seed=1)
        if state is not None:
            stream.load_state_dict(pickle.loads(pickle.dumps(state)))  # as a checkpoint holds it
        pieces += [(p.index, p.record["i"]) for p in stream.take(n)]
        state = stream.state_dict()
    assert pieces == whole and state["position"] == 30 and state["rows"] == 7
    assert sorted(i for _, i in whole[:7]) == list(range(7)) and sorted(i for _, i in whole[7:14]) == list(range(7))


def test_parquet_and_jsonl_of_the_same_rows_give_the_same_prompts_and_fingerprint(tok, tmp_path):
    import datasets

    parquet = tmp_path / "add.parquet"
    datasets.Dataset.from_list(arith.rows()).to_parquet(str(parquet))
    a = PromptStream(str(SHIPPED), tokenizer_path=tok, seed=0)
    b = PromptStream(str(parquet), tokenizer_path=tok, seed=0)
    assert a.take(120) == b.take(120) and a.fingerprint == b.fingerprint
    b.load_state_dict(a.state_dict())  # a run may switch the file's format and resume


def test_the_shipped_task_is_the_generated_one_and_tokenizes_to_the_add_layout(tok, tmp_path):
    assert arith.main([str(tmp_path / "gen.jsonl")]) == 0
    assert (tmp_path / "gen.jsonl").read_bytes() == SHIPPED.read_bytes()
    stream = PromptStream(str(SHIPPED), tokenizer_path=tok, seed=0)
    prompts = stream.take(100)
    # [bos] a + b [sep]: the synthetic add task's layout with one digit (ids 10, 12, 11)
    assert all(p.token_ids == [10, p.record["a"], 12, p.record["b"], 11] for p in prompts)
    assert stream.max_len == 5 and prompts[0].record.keys() == {"prompt", "answer", "a", "b"}
    assert all(p.record["answer"] == str(p.record["a"] + p.record["b"]) for p in prompts)
    assert stream.decode([1, 2, 13]) == decode(stream.tokenizer, [1, 2, 13]) == "12"  # <eos> dropped


def test_chat_template_is_applied_with_a_generation_prompt(tok, tmp_path):
    templated = tmp_path / "tok"
    shutil.copytree(tok, templated)
    cfg = json.loads((templated / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}<sep>{% endif %}")
    (templated / "tokenizer_config.json").write_text(json.dumps(cfg))
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "3+5"}])
    stream = PromptStream(str(path), tokenizer_path=str(templated), seed=0, chat_template=True)
    assert stream.take(1)[0].token_ids == [10, 3, 12, 5, 11]
    assert PromptStream(str(path), tokenizer_path=str(templated), seed=0).take(1)[0].token_ids == [3, 12, 5]


def test_a_split_of_a_directory_is_read_by_its_file_name(tok, tmp_path):
    _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1"}, {"prompt": "2+2"}])
    _jsonl(tmp_path / "test.jsonl", [{"prompt": "9+9"}])
    stream = PromptStream(str(tmp_path), tokenizer_path=tok, seed=0, split="test")
    assert len(stream) == 1 and stream.take(2)[1].record == {"prompt": "9+9"}


def _bad(tmp_path: Path, case: str) -> tuple[Path, dict]:
    p = tmp_path / "p.jsonl"
    if case == "missing":
        return tmp_path / "nope.jsonl", {}
    if case == "extension":
        (tmp_path / "p.csv").write_text("prompt\n1+1\n")
        return tmp_path / "p.csv", {}
    if case == "empty":
        p.write_text("")
    elif case == "malformed":
        p.write_text('{"prompt": "1+1"\n')
    else:
        rows = {"split": [{"prompt": "1"}], "key": [{"question": "1", "answer": "2"}],
                "not_str": [{"prompt": "1+1"}, {"prompt": 7}], "too_long": [{"prompt": "1"}, {"prompt": "12345"}],
                "no_tokens": [{"prompt": "1"}, {"prompt": ""}], "chat": [{"prompt": "1"}]}[case]
        _jsonl(p, rows)
    kw = {"split": {"split": "test"}, "too_long": {"max_prompt_tokens": 4}, "chat": {"chat_template": True}}
    return p, kw.get(case, {})


@pytest.mark.parametrize("case, expected", [
    ("missing", "nope.jsonl: no such file; give the path of a .jsonl, .json or .parquet file"),
    ("extension", "p.csv: expected one kind of .jsonl, .json, .parquet file(s), found .csv"),
    ("empty", "p.jsonl: the file is empty; give a file with at least one prompt"),
    ("malformed", "p.jsonl: could not read it (ArrowInvalid: JSON parse error"),
    ("split", "p.jsonl: no split 'test' (data.split); the splits there are train"),
    ("key", "no field 'prompt' (data.prompt_key); the fields are question, answer"),
    ("not_str", "row 1: field 'prompt' is int '7', not a string; write every prompt as a string"),
    ("too_long", "row 1: the prompt is 5 tokens, more than data.max_prompt_tokens=4; shorten it or raise the limit"),
    ("no_tokens", "row 1: the prompt '' tokenizes to no tokens; remove the row or give it text"),
    ("chat", "has no chat template; set data.chat_template=false or use a tokenizer that has one"),
])
def test_bad_input_is_refused_in_one_line_naming_the_file_and_the_fix(tok, tmp_path, case, expected):
    path, kw = _bad(tmp_path, case)
    with pytest.raises(ValueError) as e:
        PromptStream(str(path), tokenizer_path=tok, seed=0, **kw)
    msg = str(e.value)
    assert expected in msg and "\n" not in msg, msg
    assert case == "chat" or f"data.prompts={path}" in msg


def test_a_state_of_other_prompts_is_refused_naming_both_files(tok, tmp_path):
    small = PromptStream(str(_small(tmp_path)), tokenizer_path=tok, seed=0)
    small.take(3)
    (tmp_path / "x").mkdir()
    other = PromptStream(str(_small(tmp_path / "x", n=6)), tokenizer_path=tok, seed=0)
    with pytest.raises(ValueError) as e:
        other.load_state_dict(small.state_dict())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the checkpoint's prompt stream read other prompts")
    assert f"{tmp_path / 'small.jsonl'}: 7 rows" in msg and f"data.prompts={tmp_path / 'x' / 'small.jsonl'} (6 rows" in msg
    assert other.take(1)[0].index == 0  # the refused state changed nothing


def test_a_model_directory_without_a_tokenizer_is_refused_at_start_and_named_by_check(tmp_path, capsys):
    """The GPU recipes' config-only directories (config.json, no tokenizer): a run refuses to tokenize with
    them in one line; --check reads the rows (a bad row is still refused) and says what it left to the start."""
    from megatron_cispo.train import main

    config_only = ROOT / "yaml_configs" / "models" / "qwen3_8b"
    with pytest.raises(ValueError, match=rf"^data.prompts: model.hf_path={config_only} has no tokenizer \(none of "
                                         r"tokenizer.json, tokenizer.model, vocab.json\), so the prompts cannot be "
                                         r"tokenized; point model.hf_path \(HF_MODEL\) at the model's whole directory$"):
        PromptStream(str(SHIPPED), tokenizer_path=str(config_only), seed=0)
    recipe = str(ROOT / "yaml_configs" / "gpu_qwen3_8b.yaml")
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1", "answer": "2"}, {"prompt": 7, "answer": "7"}])
    bad_rows = ["--check", recipe, "--world-size", "16", "--nnodes", "2", f"data.prompts={bad}"]
    assert main(bad_rows) == 2  # the rows are read before the engine is judged
    assert "row 1: field 'prompt' is int '7', not a string" in capsys.readouterr().err
    sample = ROOT / "yaml_configs" / "data" / "math_sample.jsonl"
    code = main(["--check", recipe, "--world-size", "16", "--nnodes", "2", f"data.prompts={sample}"])
    out, err = capsys.readouterr()
    if importlib.util.find_spec("vllm") is None:  # the second megatron-core tier: --check says so, in one line
        assert code == 2 and "needs vLLM" in err.strip().splitlines()[-1], err
        return
    assert code == 0, err
    assert (f"# not checked: the prompts' tokenization, their lengths in tokens and the chat template "
            f"(model.hf_path={config_only} has no tokenizer files); the run checks them at start\n") in out
