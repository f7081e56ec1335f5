"""A verifiable math reward for prompt files of the math-set schema, and the converter that writes them.

    data.reward: "megatron_cispo.rollout.math_answer:final_answer_match"
    python -m megatron_cispo.rollout.math_answer gsm8k gsm8k_train.jsonl math/train.jsonl   # GSM8K -> schema

The schema (docs/launch.md, "Math prompts"): one JSON object per line with "prompt", the question as the
model should see it (with data.chat_template: true, the user turn), and "answer", the reference final
answer as text ("72", "-3", "0.25", "\\frac{1}{4}", "x^2+1"). Other fields are kept and ignored.

The reward reads the completion's final answer: the last \\boxed{...}, else what follows the last
"####" or "answer is", else the last number in the text. Answers that both read as numbers (integers,
decimals, "1,000", "a/b", "\\frac{a}{b}", a trailing %) are equal within 1e-6 relative; anything else
is compared as text with spaces, "$", "\\left"/"\\right", "\\!" and a final "." removed. A completion
cut at rollout.max_new_tokens (finish_reason "length") scores 0: its last number is not an answer.
"""
from __future__ import annotations

import json
import re
import sys
from fractions import Fraction
from pathlib import Path
from typing import Optional

# What GSM8K-style RL recipes ask for (Qwen's math prompt): the reward reads the \boxed answer first.
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
REL_TOL = 1e-6
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_MARKERS = re.compile(r"(?:####|answer is:?)\s*(.+)", re.IGNORECASE)
_FRAC = re.compile(r"^(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}$")


def _boxed(text: str) -> Optional[str]:
    """The contents of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None  # unclosed: no answer


def extract_answer(text: str) -> Optional[str]:
    """The final answer a completion states: the last \\boxed{...}, else what follows the last '####' or
    'answer is' (to the end of its line), else the last number; None when it states none."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    marked = _MARKERS.findall(text)
    if marked:
        return marked[-1].splitlines()[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normal(answer: str) -> str:
    s = answer.strip()
    for junk in ("\\left", "\\right", "\\!", "$", " "):
        s = s.replace(junk, "")
    return s.rstrip(".").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def _number(s: str) -> Optional[Fraction]:
    """s as an exact number, or None: an integer or decimal (commas between digit groups allowed), a/b,
    \\frac{a}{b}, with a trailing % read as a plain number (GSM8K's "25%" means 25)."""
    s = s.removesuffix("\\%").removesuffix("%")
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        return None if int(den) == 0 else Fraction(int(num), int(den)) * (-1 if sign else 1)
    if re.fullmatch(r"-?\d+/\d+", s):
        num, den = s.split("/")
        return None if int(den) == 0 else Fraction(int(num), int(den))
    if re.fullmatch(r"-?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?|-?\.\d+", s):
        return Fraction(s.replace(",", ""))
    return None


def answers_equal(got: str, want: str) -> bool:
    """Whether two final answers agree: by value when both read as numbers, else as normalised text."""
    g, w = _normal(got), _normal(want)
    gn, wn = _number(g), _number(w)
    if gn is not None and wn is not None:
        return abs(gn - wn) <= REL_TOL * max(1, abs(wn))
    return g == w and g != ""


def final_answer_match(record: dict, completion: str, token_ids: list[int],
                       finish_reason: Optional[str] = None) -> float:
    """1.0 when the completion's final answer (extract_answer) equals record["answer"], else 0.0; 0.0 for a
    sample cut at max_new_tokens. A row without "answer" raises KeyError, counted per step as a reward error."""
    if finish_reason == "length":
        return 0.0
    got = extract_answer(completion)
    return float(got is not None and answers_equal(got, str(record["answer"])))


def gsm8k_row(row: dict) -> dict:
    """A GSM8K row {"question", "answer": "<reasoning> #### 72"} in the schema, the instruction appended."""
    answer = row["answer"].rsplit("####", 1)
    if len(answer) != 2:
        raise ValueError(f"a GSM8K answer ends with '#### <number>', got {row['answer'][-60:]!r}")
    return {"prompt": f"{row['question'].strip()}\n{INSTRUCTION}", "answer": answer[1].strip().replace(",", "")}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "gsm8k":
        print("usage: python -m megatron_cispo.rollout.math_answer gsm8k IN.jsonl OUT.jsonl", file=sys.stderr)
        return 2
    src, out = Path(argv[1]), Path(argv[2])
    rows = [gsm8k_row(json.loads(line)) for line in src.read_text().splitlines() if line.strip()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
