"""The Megatron-LM RL APIs the drop-in knows, one recorded file per ref, and which one is loaded.

    record = detect(rl_utils, training, arguments)   # install() does this before patching anything
integrations/megatron_lm_api_*.json each describe one ref (names, parameter lists, and the features
the drop-in adapts to). The loaded Megatron-LM is matched by what its functions are: their
signatures and the names their compiled code uses (`logprobs_features`), never by a version string.
A Megatron-LM that matches no record is refused in one line naming the function and the known refs.
"""
from __future__ import annotations

import functools
import importlib.metadata
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

RECORD_DIR = Path(__file__).resolve().parent.parent
# Oldest first (file names sort by version, "main" last): a loaded API that matches two records
# (identical in everything the drop-in uses) takes the newer one.
RECORDS: tuple[dict, ...] = tuple(json.loads(p.read_text()) | {"file": p.name}
                                  for p in sorted(RECORD_DIR.glob("megatron_lm_api_*.json")))
# The keywords every single-sequence THD PackedSeqParams gets; the rest differ per ref.
THD_KEYWORDS = {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"}
CP_SCATTER = "_scatter_for_context_parallel"  # main (#5882): get_logprobs splits the tokens over CP
RL_UTILS, TRAINING, ARGUMENTS = "megatron.rl.rl_utils", "megatron.training", "megatron.training.arguments"
STASH = "_megatron_cispo_originals"  # on a module install() patched: name -> Megatron's object


class MegatronLMVersionError(RuntimeError):
    """The running Megatron-LM's RL API is none of the recorded ones."""


def original(module: Any, name: str, default: Any = None) -> Any:
    """module.name as Megatron defined it, also after install() replaced it."""
    return getattr(module, STASH, {}).get(name, getattr(module, name, default))


def ref_name(record: dict) -> str:
    tag = record["megatron_lm_tag"]
    return f"{tag}@{record['megatron_lm_commit'][:10]}" if tag == "main" else tag


def known_refs() -> str:
    return ", ".join(ref_name(r) for r in RECORDS)


def found_version() -> str:
    """megatron-core version of the running Megatron (a checkout on PYTHONPATH wins over the wheel)."""
    info = sys.modules.get("megatron.core.package_info")
    if info is not None and hasattr(info, "__version__"):
        return str(info.__version__)
    try:
        return importlib.metadata.version("megatron-core") + " (installed wheel)"
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def describe_params(fn: Callable) -> list[list]:
    """[[name, repr(default) or None], ...] in order, the format of the recorded API files."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            out.append([f"{p.kind.description} {p.name}", None])
            continue
        out.append([p.name, None if p.default is p.empty else repr(p.default)])
    return out


def signature_mismatch(found: list[list], expected: list[list]) -> Optional[str]:
    """None if equal, else a phrase naming the first differing parameter."""
    for i in range(max(len(found), len(expected))):
        f = found[i] if i < len(found) else None
        e = expected[i] if i < len(expected) else None
        if f != e:
            show = lambda p: "nothing" if p is None else (p[0] if p[1] is None else f"{p[0]}={p[1]}")  # noqa: E731
            return f"parameter {i}: expected {show(e)}, found {show(f)}"
    return None


@functools.lru_cache(maxsize=16)
def _code_features(code) -> tuple[Optional[tuple[str, ...]], bool]:
    thd = None
    for const in code.co_consts:  # keyword names of a call are a tuple constant of the code object
        if isinstance(const, tuple) and "qkv_format" in const and "PackedSeqParams" in code.co_names:
            thd = tuple(sorted(set(const) - THD_KEYWORDS))
    return thd, CP_SCATTER in code.co_names


def logprobs_features(get_logprobs: Optional[Callable]) -> dict:
    """What Megatron-LM's get_logprobs does that the drop-in must do alike, read off its code:
    unpacked_thd: None (0.16: no PackedSeqParams when unpacked) or the keywords beyond
    THD_KEYWORDS its single-sequence THD PackedSeqParams gets (0.17+); context_parallel: it splits
    the tokens over the CP group itself (main, #5882). None (no Megatron function) reads as 0.16."""
    code = getattr(get_logprobs, "__code__", None)
    thd, cp = _code_features(code) if code is not None else (None, False)
    return {"unpacked_thd": None if thd is None else list(thd), "context_parallel": cp}


def _refuse(module: Any, what: str, problem: str) -> MegatronLMVersionError:
    where = getattr(module, "__file__", None) or getattr(module, "__name__", module)
    return MegatronLMVersionError(
        f"megatron_cispo does not know this Megatron-LM's RL API: {what} {problem}, which none of the refs "
        f"it knows has ({known_refs()}). Found megatron-core {found_version()} ({where}). Use one of "
        "those refs, or integrate by hand (docs/integration.md, 'in-house fork').")


def detect(rl: Any, training: Any = None, arguments: Any = None) -> dict:
    """The record whose API the loaded modules have; MegatronLMVersionError (one line) if none.

    rl: megatron.rl.rl_utils; training / arguments: megatron.training and its arguments module,
    or None to leave pretrain and parse_args unchecked. Reads Megatron's own functions, also
    after install() replaced them.
    """
    left = list(RECORDS)
    needed = lambda r: set(r["rl_utils_helpers"]) | set(r["train_rl_imports_from_rl_utils"])  # noqa: E731
    missing = {ref_name(r): sorted(n for n in needed(r) if original(rl, n) is None) for r in left}
    have = [r for r in left if not missing[ref_name(r)]]
    if not have:
        closest = min(missing.values(), key=len)
        raise _refuse(rl, rl.__name__, f"lacks {', '.join(closest)}")
    left = have

    def narrow(module, name, found, expected, describe):
        nonlocal left
        match = [r for r in left if expected(r) == found]
        if not match:
            raise _refuse(module, f"{module.__name__}.{name}", describe(expected(left[-1])))
        left = match

    for name in ("calculate_grpo_loss", "get_logprobs"):
        params = describe_params(original(rl, name))
        narrow(rl, name, params, lambda r, n=name: r["functions"][n]["params"],
               lambda want, p=params: f"has a different signature ({signature_mismatch(p, want)})")
    feats = logprobs_features(original(rl, "get_logprobs"))
    narrow(rl, "get_logprobs", feats, lambda r: r["get_logprobs_features"],
           lambda want, f=feats: f"works differently (found {f}, expected {want})")
    for module, name in ((training, "pretrain"), (arguments, "parse_args")):
        if module is None:
            continue
        fn = original(module, name, None)
        if fn is None:
            raise _refuse(module, module.__name__, f"has no {name}")
        params = describe_params(fn)
        narrow(module, name, params, lambda r, n=name: r[n]["params"],
               lambda want, p=params: f"has a different signature ({signature_mismatch(p, want)})")
    return left[-1]


def flags_via_pretrain(record: dict) -> bool:
    """Whether this ref's pretrain takes extra_args_provider (<= 0.17); from 0.18 train_rl.py
    parses its arguments before pretrain, through parse_args."""
    return any(name == "extra_args_provider" for name, _ in record["pretrain"]["params"])


def entry_point_requirements() -> dict[str, str]:
    """Import name -> pip requirement, over every known ref (the extra [megatron-lm])."""
    out: dict[str, str] = {}
    for record in RECORDS:
        out.update(record["entry_point_requirements"])
    return out
