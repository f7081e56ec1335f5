"""The shipped task: single-digit addition as a prompt file and an exact-match reward.

    python -m megatron_cispo.rollout.arith yaml_configs/data/add_small.jsonl   # regenerate the file
    data.prompts: yaml_configs/data/add_small.jsonl
    data.reward: "megatron_cispo.rollout.arith:exact_match"

Each row is {"prompt": "<bos>a+b<sep>", "answer": "a+b in decimal", "a": a, "b": b} for a, b in 0..9.
The prompt spells out <bos> and <sep> because the tiny tokenizer (tools/make_tiny_hf) adds no BOS
itself and reads both as single special tokens: the prompt tokenizes to [10, a, 12, b, 11], the
layout of the synthetic `add` task with one digit. The answer, unlike that task's, is written most
significant digit first ("12"), as a person writes it, and ends with <eos>.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_SPECIAL = re.compile(r"<(bos|sep|eos|extra_\d+)>|<\|[^|>]*\|>")  # the tiny tokenizer's specials, and <|...|>


def rows() -> list[dict]:
    """The 100 rows of the task: every a + b with a, b in 0..9, a major."""
    return [{"prompt": f"<bos>{a}+{b}<sep>", "answer": str(a + b), "a": a, "b": b} for a in range(10) for b in range(10)]


def exact_match(record: dict, completion: str, token_ids: list[int]) -> float:
    """1.0 when the completion, special tokens removed and whitespace stripped, is the answer, else 0.0.
    Special tokens are removed here too, so a completion decoded with them still scores."""
    return float(_SPECIAL.sub("", completion).strip() == str(record["answer"]))


def write(path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m megatron_cispo.rollout.arith OUT.jsonl", file=sys.stderr)
        return 2
    print(f"wrote {len(rows())} rows to {write(argv[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
