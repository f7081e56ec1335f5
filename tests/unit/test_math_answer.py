"""rollout/math_answer.py: the math-set reward reads a completion's final answer and compares it with the
row's by value or as normalised text; the GSM8K converter writes the schema; the shipped sample follows it."""
import json
from pathlib import Path

import pytest

from megatron_cispo.rollout.math_answer import (INSTRUCTION, answers_equal, extract_answer, final_answer_match,
                                                gsm8k_row, main)
from megatron_cispo.rollout.rewards import load_reward

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text,want", [
    ("so 3 + 4 = 7, and the total is \\boxed{7}.", "7"),
    ("first \\boxed{5}, then correcting: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
    ("\\boxed{x^{2}+1} done", "x^{2}+1"),  # nested braces
    ("She has 12 left.\n#### 12", "12"),
    ("Thus the answer is: 3.5 apples\nThanks", "3.5 apples"),
    ("We get 10, then 20, then 30 in all", "30"),  # the last number
    ("no numbers here", None),
    ("\\boxed{7", "7"),  # an unclosed box is no box: the last number decides
])
def test_extract_answer_prefers_the_last_box_then_a_marker_then_the_last_number(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("got,want,equal", [
    ("72", "72", True), ("72.0", "72", True), ("1,005", "1005", True), ("$34", "34", True), ("34.", "34", True),
    ("0.75", "\\frac{3}{4}", True), ("3/4", "\\dfrac{3}{4}", True), ("-\\frac{1}{2}", "-0.5", True),
    ("25%", "25", True), ("71", "72", False), ("0.333", "\\frac{1}{3}", False), ("x^2 + 1", "x^2+1", True),
    ("\\left(1,2\\right)", "(1,2)", True), ("", "", False), ("1/0", "1/0", True),  # not a number: equal as text
])
def test_answers_are_equal_by_value_when_both_are_numbers_else_as_text(got, want, equal):
    assert answers_equal(got, want) is equal


def test_the_reward_scores_the_final_answer_and_zero_for_a_cut_sample():
    row = {"prompt": "q", "answer": "336"}
    assert final_answer_match(row, "334 + 335 + 336 = 1005, so \\boxed{336}", [1, 2], "stop") == 1.0
    assert final_answer_match(row, "so \\boxed{335}", [1], "stop") == 0.0
    assert final_answer_match(row, "... 336", [1], "length") == 0.0  # cut at max_new_tokens
    assert final_answer_match(row, "I do not know", [1]) == 0.0
    with pytest.raises(KeyError):
        final_answer_match({"prompt": "q"}, "\\boxed{1}", [1])
    assert load_reward("megatron_cispo.rollout.math_answer:final_answer_match") is not None  # data.reward's import


def test_gsm8k_rows_convert_to_the_schema_and_the_cli_writes_them(tmp_path, capsys):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text(json.dumps({"question": " Tom has 2 apples and buys 1,000 more. ", "answer": "2+1000\n#### 1,002"})
                   + "\n\n")
    assert main(["gsm8k", str(src), str(tmp_path / "out" / "train.jsonl")]) == 0
    assert json.loads((tmp_path / "out" / "train.jsonl").read_text()) == {
        "prompt": f"Tom has 2 apples and buys 1,000 more.\n{INSTRUCTION}", "answer": "1002"}
    assert "1 rows" in capsys.readouterr().out
    with pytest.raises(ValueError, match="a GSM8K answer ends with '#### <number>', got 'no marker'"):
        gsm8k_row({"question": "q", "answer": "no marker"})
    assert main(["math", "a", "b"]) == 2


def test_the_shipped_sample_follows_the_schema_and_its_answers_score():
    rows = [json.loads(line) for line in (ROOT / "yaml_configs/data/math_sample.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(set(r) == {"prompt", "answer"} and r["prompt"].endswith(INSTRUCTION) for r in rows)
    for r in rows:
        assert final_answer_match(r, f"work... \\boxed{{{r['answer']}}}", [1], "stop") == 1.0
