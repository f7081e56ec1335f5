"""The prompt stream of a run: rows of a JSONL or Parquet file (read with `datasets`), tokenized once,
served in a new seeded order every epoch, without end, resumable from a checkpoint.

    stream = PromptStream("data/add.jsonl", tokenizer_path=hf_dir, seed=cfg.run.seed)
    batch = stream.take(32)              # [Prompt(index, record, token_ids)], the next 32
    ckpt["prompts"] = stream.state_dict(); ...; stream.load_state_dict(ckpt["prompts"])

Epoch e serves the rows in the order of a permutation drawn from a generator keyed by (seed, e), so
the stream is a pure function of (file, seed, position): a resumed run sees exactly the continuation.
"""
from __future__ import annotations

import hashlib
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # file extension -> datasets builder


@dataclass(frozen=True)
class Prompt:
    index: int            # position in the stream (0, 1, 2, ... over all epochs): the resume key
    record: dict          # the dataset row as read (every field, for the reward)
    token_ids: list[int]  # the tokenized prompt (chat template applied when asked)


def decode(tokenizer, ids) -> str:
    """The text of `ids` without special tokens (BOS, EOS, pads): what a reward compares."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _permutation(seed: int, epoch: int, n: int) -> list[int]:
    # random.Random's shuffle is stable across Python versions; the key is hashed so that nearby
    # seeds and epochs give unrelated orders
    digest = hashlib.sha256(f"prompts:{seed}:{epoch}".encode()).digest()
    order = list(range(n))
    random.Random(int.from_bytes(digest[:8], "little")).shuffle(order)
    return order


def _read_split(path: Path, split: str, setting: str = "data.prompts"):
    """The `split` of a file (datasets names a single file's split "train") or of a directory whose
    files name their splits (train.jsonl, test.parquet, ...), in memory; ValueError one line."""
    where = f"{setting}={path}"
    if not path.exists():
        raise ValueError(f"{where}: no such file; give the path of a .jsonl, .json or .parquet file")
    suffixes = {p.suffix for p in path.iterdir() if p.is_file()} & set(KINDS) if path.is_dir() else {path.suffix}
    kinds = {KINDS[s] for s in suffixes if s in KINDS}
    if len(kinds) != 1:
        found = ", ".join(sorted(suffixes)) or "no supported files"
        raise ValueError(f"{where}: expected one kind of {', '.join(KINDS)} file(s), found {found}; "
                         f"convert the prompts to JSONL or Parquet")
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"{where}: the file is empty; give a file with at least one prompt")
    import datasets

    bars_were_on, verbosity = not datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()  # one read per run: its bars and its own error lines would only
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # clutter the log beside our one line
    # a fresh cache per read: a file edited in place can never come back from a stale cache, and
    # nothing is left in ~/.cache
    try:
        with tempfile.TemporaryDirectory(prefix="megatron_cispo_prompts_") as cache:
            files = {"data_dir": str(path)} if path.is_dir() else {"data_files": str(path)}
            splits = datasets.load_dataset(kinds.pop(), cache_dir=cache, keep_in_memory=True, **files)
    except Exception as e:  # noqa: BLE001 - a malformed file: say which and why, in one line
        while e.__cause__ is not None:  # datasets wraps the parser's error, which says where
            e = e.__cause__
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{where}: could not read it ({type(e).__name__}: {first}); check that it is "
                         f"valid JSON lines or Parquet with one column per field") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()
    if split not in splits:
        raise ValueError(f"{where}: no split {split!r} (data.split); the splits there are {', '.join(splits)}")
    return splits[split]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what transformers' tokenizers load


def has_tokenizer(model_dir) -> bool:
    """Whether an HF model directory carries its tokenizer (a config-only directory, as the GPU recipes
    ship for --check, does not)."""
    return any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)


def read_prompts(path: Path, split: str, prompt_key: str, setting: str = "data.prompts"):
    """(rows, their prompt texts) of one split; ValueError (one line) for an empty split, a missing
    prompt field or a prompt that is not a string."""
    rows = _read_split(path, split, setting)
    where = f"{setting}={path} (split {split!r})"
    if len(rows) == 0:
        raise ValueError(f"{where}: the split has no rows; give a file with at least one prompt")
    if prompt_key not in rows.column_names:
        raise ValueError(f"{where}: no field {prompt_key!r} (data.prompt_key); the fields are "
                         f"{', '.join(rows.column_names)}")
    texts = list(rows[prompt_key])  # datasets 5 returns a lazy Column
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"{where}: row {i}: field {prompt_key!r} is {type(text).__name__} "
                             f"{str(text)[:40]!r}, not a string; write every prompt as a string")
    return rows, texts


class PromptStream:
    """Prompts of one split of `path`, tokenized with the tokenizer at `tokenizer_path`; every row's
    tokens are computed at construction, so a bad row is refused before the first step."""

    def __init__(self, path: str, *, tokenizer_path: str, seed: int, split: str = "train", prompt_key: str = "prompt",
                 chat_template: bool = False, max_prompt_tokens: int | None = None,
                 limit_name: str = "data.max_prompt_tokens", setting: str = "data.prompts"):
        """limit_name: where max_prompt_tokens comes from, for the message of a prompt over it; setting:
        the key that named the file, for every message (data.eval_prompts for the held-out ones)."""
        from transformers import AutoTokenizer

        self.path, self.seed = Path(path).absolute(), seed
        rows, texts = read_prompts(self.path, split, prompt_key, setting)
        where = f"{setting}={self.path} (split {split!r})"
        if not has_tokenizer(tokenizer_path):
            raise ValueError(f"{setting}: model.hf_path={tokenizer_path} has no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}), so the prompts cannot be tokenized; point model.hf_path "
                             "(HF_MODEL) at the model's whole directory")
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        if chat_template:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"data.chat_template=true: the tokenizer at {tokenizer_path} has no chat template; "
                                 f"set data.chat_template=false or use a tokenizer that has one")
            chats = [[{"role": "user", "content": t}] for t in texts]
            ids = self.tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = self.tokenizer(texts)["input_ids"]  # with the tokenizer's own BOS where it adds one
        self._ids = [list(map(int, x)) for x in ids]
        for i, x in enumerate(self._ids):
            if not x:
                raise ValueError(f"{where}: row {i}: the prompt {texts[i][:40]!r} tokenizes to no tokens; "
                                 f"remove the row or give it text")
            if max_prompt_tokens is not None and len(x) > max_prompt_tokens:
                raise ValueError(f"{where}: row {i}: the prompt is {len(x)} tokens, more than "
                                 f"{limit_name}={max_prompt_tokens}; shorten it or raise the limit")
        self._rows, self.texts = rows, texts
        self._position = 0
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its permutation), the one last used
        h = hashlib.sha256()
        for t in texts:  # the prompts in file order: a state fits any copy of them (JSONL or Parquet)
            b = t.encode()
            h.update(len(b).to_bytes(8, "little") + b)
        self.fingerprint = h.hexdigest()

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def max_len(self) -> int:
        """The longest tokenized prompt in the split."""
        return max(map(len, self._ids))

    def decode(self, ids) -> str:
        return decode(self.tokenizer, ids)

    def every(self) -> list[Prompt]:
        """Every row once, in file order (index = row): a held-out set, evaluated whole."""
        return [Prompt(index=i, record=dict(self._rows[i]), token_ids=list(self._ids[i])) for i in range(len(self))]

    def take(self, n: int) -> list[Prompt]:
        """The next `n` prompts; an epoch boundary inside the take continues into the next epoch."""
        out = []
        for k in range(self._position, self._position + n):
            epoch, j = divmod(k, len(self))
            if self._order[0] != epoch:
                self._order = (epoch, _permutation(self.seed, epoch, len(self)))
            row = self._order[1][j]
            out.append(Prompt(index=k, record=dict(self._rows[row]), token_ids=list(self._ids[row])))
        self._position += n
        return out

    def state_dict(self) -> dict:
        return {"position": self._position, "rows": len(self), "fingerprint": self.fingerprint, "path": str(self.path)}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` stopped; a state of other prompts is refused (ValueError)."""
        if state.get("fingerprint") != self.fingerprint or state.get("rows") != len(self):
            raise ValueError(f"the checkpoint's prompt stream read other prompts ({state.get('path', '?')}: "
                             f"{state.get('rows')} rows, fingerprint {str(state.get('fingerprint'))[:12]}) than "
                             f"data.prompts={self.path} ({len(self)} rows, fingerprint {self.fingerprint[:12]}); "
                             f"resume with the prompt file and split the run started with")
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"the checkpoint's prompt stream position is {position!r}, not an int >= 0")
        self._position = position
