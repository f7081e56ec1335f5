"""install(): put the drop-ins into a running Megatron-LM, after checking its API against the record.

    from megatron_cispo.integrations.megatron_lm import install; install()   # before pretrain()
Patches megatron.rl.rl_utils.{calculate_grpo_loss, get_logprobs} and every other module that
imported them by name (train_rl.py), and wraps megatron.training.pretrain to add the --cispo-*
flags and the signed loss report. Idempotent; uninstall() restores the originals. Neither ever
rebinds a name inside megatron_cispo: our public functions stay ours.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from ...config import LossConfig
from . import settings
from .dropin import calculate_grpo_loss
from .vocab_logprobs import get_logprobs

API_FILE = Path(__file__).resolve().parent.parent / "megatron_lm_api_0_16.json"
API: dict = json.loads(API_FILE.read_text())
REPLACEMENTS: dict[str, Callable] = {"calculate_grpo_loss": calculate_grpo_loss, "get_logprobs": get_logprobs}
NEG_LOSS_KEY = "neg lm loss"  # -('lm loss'): Megatron prints only positive keys, so one of the two shows
_STASH = "_megatron_cispo_originals"  # on the patched module: name -> original object


class MegatronLMVersionError(RuntimeError):
    """The running Megatron-LM does not have the API this integration was recorded against."""


def found_version() -> str:
    """megatron-core version of the running Megatron (a fork on PYTHONPATH wins over the wheel)."""
    info = sys.modules.get("megatron.core.package_info")
    if info is not None and hasattr(info, "__version__"):
        return str(info.__version__)
    try:
        return importlib.metadata.version("megatron-core") + " (installed wheel)"
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _version_error(module: Any, problem: str) -> MegatronLMVersionError:
    where = getattr(module, "__file__", None) or getattr(module, "__name__", module)
    return MegatronLMVersionError(
        f"megatron_cispo cannot patch this Megatron-LM: {problem}. Found megatron-core {found_version()} "
        f"({where}); expected the API of Megatron-LM {API['megatron_lm_tag']} (megatron-core "
        f"{API['megatron_core_version']}), recorded in {API_FILE.name}. Use a matching Megatron-LM, or "
        "integrate by hand (docs/integration.md, 'in-house fork').")


def describe_params(fn: Callable) -> list[list]:
    """[[name, repr(default) or None], ...] in order, the format of the recorded API file."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            out.append([f"{p.kind.description} {p.name}", None])
            continue
        out.append([p.name, None if p.default is p.empty else repr(p.default)])
    return out


def signature_mismatch(found: list[list], expected: list[list]) -> Optional[str]:
    """None if equal, else a sentence naming the first differing parameter."""
    for i in range(max(len(found), len(expected))):
        f = found[i] if i < len(found) else None
        e = expected[i] if i < len(expected) else None
        if f != e:
            show = lambda p: "nothing" if p is None else (p[0] if p[1] is None else f"{p[0]}={p[1]}")  # noqa: E731
            return f"parameter {i}: expected {show(e)}, found {show(f)}"
    return None


def _original(module: Any, name: str) -> Any:
    return getattr(module, _STASH, {}).get(name, getattr(module, name, None))


OWN_PACKAGE = __name__.split(".")[0]  # "megatron_cispo": its modules hold our functions by name


def _foreign_modules() -> list:
    """Loaded modules outside megatron_cispo (Megatron's, train_rl / __main__, the user's)."""
    return [mod for mod_name, mod in list(sys.modules.items())
            if mod is not None and mod_name != OWN_PACKAGE and not mod_name.startswith(OWN_PACKAGE + ".")]


def _rebind(old: Any, new: Any, name: str) -> None:
    """Point every foreign module's `name` that is `old` (e.g. train_rl's imported copy) at `new`.

    megatron_cispo's own modules are skipped: sweeping them would make uninstall() turn our
    public calculate_grpo_loss / get_logprobs into Megatron's. Only a module's own namespace is
    read, so a lazy module __getattr__ never runs.
    """
    for mod in _foreign_modules():
        namespace = getattr(mod, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is old:
            try:
                setattr(mod, name, new)
            except (AttributeError, TypeError):
                pass


def check_rl_utils(rl: Any) -> None:
    """Raise MegatronLMVersionError unless rl_utils has every recorded name and signature."""
    needed = set(API["rl_utils_helpers"]) | set(API["train_rl_imports_from_rl_utils"])
    missing = sorted(n for n in needed if getattr(rl, n, None) is None)
    if missing:
        raise _version_error(rl, f"{API['rl_utils_module']} lacks {', '.join(missing)}")
    for name, spec in API["functions"].items():
        fn = _original(rl, name)
        why = signature_mismatch(describe_params(fn), spec["params"])
        if why:
            raise _version_error(rl, f"{API['rl_utils_module']}.{name} has a different signature ({why})")


def with_signed_loss_report(forward_step_func: Callable) -> Callable:
    """Wrap a forward_step so its loss function also reports NEG_LOSS_KEY = -('lm loss')."""
    @functools.wraps(forward_step_func)
    def forward_step(*args, **kwargs):
        out = forward_step_func(*args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 2 and callable(out[1])):
            return out
        output_tensor, loss_fn = out

        def loss_func(*a, **k):
            result = loss_fn(*a, **k)
            report = result[-1] if isinstance(result, tuple) else None
            if isinstance(report, dict) and "lm loss" in report:
                # A [sum, tokens] pair negates only the sum, so the token-weighted average stays exact.
                neg = report["lm loss"].detach().clone().reshape(-1)
                neg[0] = -neg[0]
                report[NEG_LOSS_KEY] = neg
            return result

        return output_tensor, loss_func

    forward_step._megatron_cispo_wrapped = True
    return forward_step


def _wrap_pretrain(original: Callable) -> Callable:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def pretrain(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        user = bound.arguments.get("extra_args_provider")
        bound.arguments["extra_args_provider"] = (
            settings.extra_args_provider if user is None
            else (lambda parser: settings.extra_args_provider(user(parser))))
        step = bound.arguments["forward_step_func"]
        if not getattr(step, "_megatron_cispo_wrapped", False):
            bound.arguments["forward_step_func"] = with_signed_loss_report(step)
        return original(*bound.args, **bound.kwargs)

    return pretrain


def _patch(module: Any, name: str, new: Callable) -> None:
    stash = module.__dict__.setdefault(_STASH, {})
    current = getattr(module, name)
    if name not in stash:
        stash[name] = current
    if current is not new:
        setattr(module, name, new)
        _rebind(current, new, name)


def install(config: Optional[LossConfig] = None, *, temperature: Optional[float] = None,
            patch_pretrain: bool = True) -> None:
    """Patch the running Megatron-LM. Idempotent: a second call only updates config/temperature.

    config: the LossConfig to use; None reads the --cispo-* flags from Megatron's args on first
    use. temperature: of the trainer's logprobs; None reads --cispo-temperature (default 1.0).
    patch_pretrain: wrap megatron.training.pretrain (adds --cispo-* flags and NEG_LOSS_KEY);
    needed unless the caller passes settings.extra_args_provider to pretrain itself.
    Raises MegatronLMVersionError, naming the version found, when names or signatures differ.
    """
    try:
        rl = importlib.import_module(API["rl_utils_module"])
    except ImportError as e:
        raise _version_error(API["rl_utils_module"], f"importing {API['rl_utils_module']} failed "
                             f"({type(e).__name__}: {e}); put the Megatron-LM checkout on PYTHONPATH") from e
    check_rl_utils(rl)
    training = None
    if patch_pretrain:
        try:
            training = importlib.import_module(API["training_module"])
        except ImportError as e:
            raise _version_error(API["training_module"], f"importing {API['training_module']} failed: {e}") from e
        pretrain = _original(training, "pretrain")
        if pretrain is None:
            raise _version_error(training, f"{API['training_module']} has no pretrain")
        params = inspect.signature(pretrain).parameters
        lacking = [p for p in API["pretrain"]["required_params"] if p not in params]
        if lacking:
            raise _version_error(training, f"{API['training_module']}.pretrain lacks parameter(s) {', '.join(lacking)}")
    settings.configure(config, temperature=temperature)
    for name, new in REPLACEMENTS.items():
        _patch(rl, name, new)
    if training is not None:
        stash = getattr(training, _STASH, {})
        wrapped = stash.get("_pretrain_wrapper") or _wrap_pretrain(_original(training, "pretrain"))
        _patch(training, "pretrain", wrapped)
        training.__dict__[_STASH]["_pretrain_wrapper"] = wrapped


def installed() -> bool:
    rl = sys.modules.get(API["rl_utils_module"])
    return rl is not None and all(getattr(rl, n, None) is f for n, f in REPLACEMENTS.items())


def uninstall() -> None:
    """Restore the originals in Megatron's modules (and any other non-megatron_cispo module that
    holds a patched name) and forget the configuration. megatron_cispo's own names stay ours."""
    for mod_name in (API["rl_utils_module"], API["training_module"]):
        mod = sys.modules.get(mod_name)
        stash = getattr(mod, _STASH, None) if mod is not None else None
        if not stash:
            continue
        for name, original in list(stash.items()):
            if name.startswith("_"):
                continue
            current = getattr(mod, name)
            setattr(mod, name, original)
            _rebind(current, original, name)
        delattr(mod, _STASH)
    settings.configure(None)
