"""The shipped tasks: addition as prompt files and an exact-match reward.

    python -m megatron_cispo.rollout.arith yaml_configs/data/add_small.jsonl   # regenerate the small file
    python -m megatron_cispo.rollout.arith --add2 yaml_configs/data/add2       # train.jsonl + eval.jsonl
    data.prompts: yaml_configs/data/add_small.jsonl
    data.reward: "megatron_cispo.rollout.arith:exact_match"

Each row is {"prompt": "<bos>a+b<sep>", "answer": "a+b in decimal", "a": a, "b": b} for a, b in 0..9.
The prompt spells out <bos> and <sep> because the tiny tokenizer (tools/make_tiny_hf) adds no BOS
itself and reads both as single special tokens: the prompt tokenizes to [10, a, 12, b, 11], the
layout of the synthetic `add` task with one digit. The answer, unlike that task's, is written most
significant digit first ("12"), as a person writes it, and ends with <eos>.

--add2 is the real run's task: every a + b with a, b in 0..99 (10,000 rows), prompt "<bos>47+18<sep>",
the answer written least significant digit first ("56" for 65: the order a model can add in, carry by
carry), split by a seeded shuffle into EVAL_ROWS held-out rows (eval.jsonl, never trained on) and the
rest (train.jsonl).
"""
from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

EVAL_ROWS = 200

_SPECIAL = re.compile(r"<(bos|sep|eos|extra_\d+)>|<\|[^|>]*\|>")  # the tiny tokenizer's specials, and <|...|>


def rows() -> list[dict]:
    """The 100 rows of the task: every a + b with a, b in 0..9, a major."""
    return [{"prompt": f"<bos>{a}+{b}<sep>", "answer": str(a + b), "a": a, "b": b} for a in range(10) for b in range(10)]


def add2_rows() -> list[dict]:
    """The 10,000 rows of --add2: a + b for a, b in 0..99, the answer least significant digit first."""
    return [{"prompt": f"<bos>{a}+{b}<sep>", "answer": str(a + b)[::-1]} for a in range(100) for b in range(100)]


def exact_match(record: dict, completion: str, token_ids: list[int], finish_reason: str | None = None) -> float:
    """1.0 when the sample ended at its EOS (finish_reason "stop"; None: not known, the text alone decides)
    and the completion, special tokens removed and whitespace stripped, is the answer, else 0.0. A sample
    cut at max_new_tokens ("length") scores 0 even when its digits are right: the answer ends with <eos>.
    Special tokens are removed here too, so a completion decoded with them still scores."""
    if finish_reason == "length":
        return 0.0
    return float(_SPECIAL.sub("", completion).strip() == str(record["answer"]))


def write(path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return path


def write_add2(out_dir: str | Path, *, seed: int = 0) -> tuple[Path, Path]:
    """out_dir/train.jsonl and out_dir/eval.jsonl (EVAL_ROWS rows) of --add2, split by `seed`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows_ = add2_rows()
    random.Random(seed).shuffle(rows_)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, part in zip(paths, (rows_[EVAL_ROWS:], rows_[:EVAL_ROWS])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--add2":
        train, held = write_add2(argv[1])
        print(f"wrote {len(add2_rows()) - EVAL_ROWS} rows to {train} and {EVAL_ROWS} to {held}")
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m megatron_cispo.rollout.arith OUT.jsonl | --add2 OUT_DIR", file=sys.stderr)
        return 2
    print(f"wrote {len(rows())} rows to {write(argv[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
