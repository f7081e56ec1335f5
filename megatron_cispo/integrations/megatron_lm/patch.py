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
import importlib.util
import inspect
import json
import shlex
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
HELP_FLAGS = {"-h", "--help"}
_STASH = "_megatron_cispo_originals"  # on the patched module: name -> original object


class MegatronLMVersionError(RuntimeError):
    """The running Megatron-LM does not have the API this integration was recorded against."""


class MegatronLMDependencyError(ImportError):
    """A package that Megatron-LM's RL code imports is not installed (the extra [megatron-lm])."""


EXTRA = 'pip install "megatron_cispo[megatron-lm]"'


def megatron_lm_extra() -> list[str]:
    """The pip requirements of setup.py's extra [megatron-lm] (from the recorded API file)."""
    return sorted(API["entry_point_requirements"].values())


def _not_installed(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is None
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _import_megatron(module: str) -> Any:
    """Import one of Megatron-LM's modules; a failure says what is missing and how to get it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top == "megatron" or not top:
            raise _version_error(module, f"importing {module} failed ({e}): megatron.rl and "
                                 "megatron.training come with a Megatron-LM checkout, not the megatron-core "
                                 "wheel; put the checkout first on PYTHONPATH (the launcher does it for "
                                 "the script's directory)") from e
        requirements = API["entry_point_requirements"]
        others = [requirements[n] for n in requirements if n != top and _not_installed(n)]
        also = f"; also missing: {', '.join(others)}" if others else ""
        raise MegatronLMDependencyError(
            f"megatron_cispo cannot patch Megatron-LM: importing {module} failed because the package "
            f"{top!r} is not installed{also}. Install what Megatron-LM's RL entry point needs with "
            f"{EXTRA} (or pip install {shlex.quote(requirements.get(top, top))})") from e
    except ImportError as e:
        raise _version_error(module, f"importing {module} failed ({type(e).__name__}: {e})") from e


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
        if HELP_FLAGS & set(sys.argv[1:]):
            # ft_integration.setup() parses argv without extra_args_provider before Megatron's
            # own parse adds it, so its --help would list no --cispo-* flag: print the full help.
            arguments = importlib.import_module(API["arguments_module"])
            arguments.parse_args(extra_args_provider=bound.arguments["extra_args_provider"])  # exits
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
    Raises MegatronLMVersionError, naming the version found, when names or signatures differ or
    megatron.rl is not importable (no checkout on the path), and MegatronLMDependencyError, naming
    the package and the extra [megatron-lm], when Megatron-LM's code lacks a package it imports.
    """
    rl = _import_megatron(API["rl_utils_module"])
    check_rl_utils(rl)
    training = None
    if patch_pretrain:
        training = _import_megatron(API["training_module"])
        arguments = _import_megatron(API["arguments_module"])
        for module, name, spec in ((training, "pretrain", API["pretrain"]),
                                   (arguments, "parse_args", API["parse_args"])):
            fn = _original(module, name)
            if fn is None:
                raise _version_error(module, f"{module.__name__} has no {name}")
            lacking = [p for p in spec["required_params"] if p not in inspect.signature(fn).parameters]
            if lacking:
                raise _version_error(module, f"{module.__name__}.{name} lacks parameter(s) {', '.join(lacking)}")
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
