"""Write a seeded, random, tiny Hugging Face model of a supported family, for tests, docs and examples.

    python -m megatron_cispo.tools.make_tiny_hf --family qwen2 runs/tiny_qwen2
    python -m megatron_cispo.tools.make_tiny_hf --family qwen3_moe --layers 4 --seed 3 runs/tiny_moe
    python -m megatron_cispo.tools.make_tiny_hf --family qwen2 --vocab 16 --hidden 128 --heads 2 --kv-heads 2 \
        --pretrain runs/data/add2/train.jsonl --pretrain-steps 600 runs/models/warm   # a warm start

The directory is what a hub download holds: config.json, generation_config.json, model.safetensors
and a word-level tokenizer (tokenizer.json, tokenizer_config.json). Token ids 0..13 are the demo
tasks' symbols: the digits 0-9, then <bos>, <sep>, + and <eos> (rollout/task.py's ids for base 10), so
the synthetic tasks run on it unchanged; the rest are <extra_i>. Every weight is random (norm weights
and biases too, so a mapping that drops one is caught), drawn from torch's generator seeded by --seed.
No network access is needed.

--pretrain FILE warm-starts the model the way real RL starts from a pretrained one: a short supervised
phase (AdamW, seeded, on CPU, seconds) on the first --pretrain-rows rows of a prompt file with
"prompt" and "answer" fields, plain next-token loss on each row (prompt, answer, <eos>). Stopped
early, it leaves the model solving part of the task, and RL the rest: on the --add2 task (hidden 128,
2 heads of 64) held-out greedy accuracy is about 10% after 500 steps, 45% after 600, 97% after 1000.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..hf.arch import FAMILIES  # the families megatron-core builds from HF: one list
TASK_SYMBOLS = [str(d) for d in range(10)] + ["<bos>", "<sep>", "+", "<eos>"]  # ids 0..13


def tiny_config(family: str, *, vocab: int = 300, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, ffn: int = 96, tie: bool | None = None, max_positions: int = 128):
    """The transformers config of a tiny `family` model. qwen3 and qwen3_moe use head_dim =
    hidden/heads + 8, which is not hidden/heads, as the real Qwen3 sizes do; qwen3_moe has 4 experts, top-2, with
    normalised top-k probabilities (as Qwen3-30B-A3B)."""
    import transformers as tf

    if family not in FAMILIES:
        raise ValueError(f"--family {family!r}: expected one of {', '.join(FAMILIES)}")
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-6, bos_token_id=10, eos_token_id=13, pad_token_id=None)
    default_tie = {"llama": False, "mistral": False, "qwen2": True, "qwen3": True, "qwen3_moe": False}[family]
    common["tie_word_embeddings"] = default_tie if tie is None else tie
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    if family in ("llama", "mistral"):
        cls = tf.LlamaConfig if family == "llama" else tf.MistralConfig
        extra = {"rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}}
        if family == "mistral":
            extra["sliding_window"] = None
        return cls(**common, **extra)
    if family == "qwen2":
        return tf.Qwen2Config(**common, **rope, use_sliding_window=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, **rope, head_dim=hidden // heads + 8, use_sliding_window=False)
    return tf.Qwen3MoeConfig(**common, **rope, head_dim=hidden // heads + 8, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                             mlp_only_layers=[], router_aux_loss_coef=0.0, use_sliding_window=False)


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = TASK_SYMBOLS + [f"<extra_{i}>" for i in range(vocab - len(TASK_SYMBOLS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<extra_0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one symbol per character
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<extra_0>",
                                   additional_special_tokens=["<sep>"])


def sft_examples(path: str | Path, tokenizer, rows: int) -> list[list[int]]:
    """The token ids of prompt + answer + <eos> for the first `rows` rows of JSONL `path`;
    ValueError (one line, naming the row) for a row without the fields or with a symbol the tokenizer lacks."""
    import json

    out, unk, eos = [], tokenizer.unk_token_id, tokenizer.eos_token_id
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if len(out) == rows:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, answer = str(row["prompt"]), str(row["answer"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--pretrain {path}:{i}: expected a JSON object with 'prompt' and 'answer'") from None
            p, a = tokenizer.encode(prompt), tokenizer.encode(answer)
            if unk in p + a or not a:
                raise ValueError(f"--pretrain {path}:{i}: the tokenizer cannot encode {prompt!r} + {answer!r} (only "
                                 f"{' '.join(TASK_SYMBOLS)}; a symbol outside them reads as <extra_0>)")
            out.append(p + a + [eos])
    if not out:
        raise ValueError(f"--pretrain {path}: no rows")
    return out


def pretrain(model, examples: list[list[int]], *, steps: int, seed: int, lr: float = 1e-3, batch: int = 64) -> float:
    """`steps` AdamW steps of next-token loss on `examples` (batches drawn by `seed`); the last loss."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    width = max(len(row) for row in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for i, row in enumerate(examples):
        ids[i, :len(row)], mask[i, :len(row)], labels[i, :len(row)] = torch.tensor(row), 1, torch.tensor(row)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        pick = torch.randint(len(examples), (batch,), generator=gen)
        loss = model(input_ids=ids[pick], attention_mask=mask[pick], labels=labels[pick]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def make_tiny_hf(family: str, out: str | Path, *, seed: int = 0, dtype: str = "float32", pretrain_file=None,
                 pretrain_steps: int = 0, pretrain_rows: int = 4000, **sizes) -> Path:
    """Write the model to `out` (created; must not hold a config.json) and return it; with pretrain_file,
    warm-started by `pretrain_steps` supervised steps on its first `pretrain_rows` rows (see the module doc)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a model (config.json); pick another directory")
    cfg = tiny_config(family, **sizes)
    if cfg.vocab_size < len(TASK_SYMBOLS):
        raise ValueError(f"--vocab {cfg.vocab_size} is too small: the task symbols take {len(TASK_SYMBOLS)} ids")
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            # norms near 1 and other vectors near 0, but none exactly: a dropped tensor shows
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise if p.dim() == 1 else 0.02 * noise)
    tokenizer = _tokenizer(cfg.vocab_size)
    if pretrain_file is not None and pretrain_steps > 0:
        torch.manual_seed(seed)  # dropout is off in these configs; the batches come from their own generator
        pretrain(model, sft_examples(pretrain_file, tokenizer, pretrain_rows), steps=pretrain_steps, seed=seed)
    model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_cispo.tools.make_tiny_hf", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="directory to write (created)")
    ap.add_argument("--family", required=True, choices=FAMILIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=96)
    ap.add_argument("--tie", choices=("yes", "no", "family"), default="family",
                    help="tie the output layer to the embedding (default: as the family's small models do)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--pretrain", metavar="FILE", help="warm start: supervised steps on this JSONL's prompt/answer rows")
    ap.add_argument("--pretrain-steps", type=int, default=600, help="AdamW steps of the warm start (default 600)")
    ap.add_argument("--pretrain-rows", type=int, default=4000, help="rows of FILE it trains on (default the first 4000)")
    a = ap.parse_args(argv)
    try:
        path = make_tiny_hf(a.family, a.out, seed=a.seed, dtype=a.dtype, pretrain_file=a.pretrain,
                            pretrain_steps=a.pretrain_steps, pretrain_rows=a.pretrain_rows, vocab=a.vocab, hidden=a.hidden,
                            layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn,
                            tie=None if a.tie == "family" else a.tie == "yes")
    except (ValueError, FileExistsError, OSError) as e:
        print(f"make_tiny_hf: {e}", file=sys.stderr)
        return 2
    print(f"wrote a tiny {a.family} model to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
