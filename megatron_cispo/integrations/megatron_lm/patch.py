"""install(): put the drop-ins into a running Megatron-LM whose RL API is one of the recorded refs.

    from megatron_cispo.integrations.megatron_lm import install; install()   # before train_rl.py parses its args
Patches megatron.rl.rl_utils.{calculate_grpo_loss, get_logprobs} and every other module that
imported them by name (train_rl.py), wraps megatron.training.arguments.parse_args to add the
--cispo-* flags (every ref has it; from 0.18 train_rl.py parses before pretrain) and
megatron.training.pretrain for the signed loss report. Idempotent; uninstall() restores the
originals. Neither ever rebinds a name inside megatron_cispo: our public functions stay ours.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import shlex
import sys
from typing import Any, Callable, Optional

from ...config import LossConfig
from . import settings
from .api import (ARGUMENTS, RL_UTILS, STASH, TRAINING, MegatronLMVersionError, detect, entry_point_requirements,
                  flags_via_pretrain, known_refs, original)
from .dropin import calculate_grpo_loss
from .vocab_logprobs import get_logprobs

REPLACEMENTS: dict[str, Callable] = {"calculate_grpo_loss": calculate_grpo_loss, "get_logprobs": get_logprobs}
NEG_LOSS_KEY = "neg lm loss"  # -('lm loss'): Megatron prints only positive keys, so one of the two shows
HELP_FLAGS = {"-h", "--help"}
_state: dict[str, Any] = {"record": None}  # the recorded API install() matched


class MegatronLMDependencyError(ImportError):
    """A package that Megatron-LM's RL code imports is not installed (the extra [megatron-lm])."""


EXTRA = 'pip install "megatron_cispo[megatron-lm]"'


def megatron_lm_extra() -> list[str]:
    """The pip requirements of setup.py's extra [megatron-lm]: what train_rl.py needs at every known ref."""
    return sorted(set(entry_point_requirements().values()))


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
            raise MegatronLMVersionError(
                f"megatron_cispo cannot patch Megatron-LM: importing {module} failed ({e}): megatron.rl and "
                "megatron.training come with a Megatron-LM checkout, not the megatron-core wheel; put the "
                f"checkout first on PYTHONPATH (the launcher does it for the script's directory). Known refs: "
                f"{known_refs()}") from e
        requirements = entry_point_requirements()
        others = [requirements[n] for n in requirements if n != top and _not_installed(n)]
        also = f"; also missing: {', '.join(others)}" if others else ""
        raise MegatronLMDependencyError(
            f"megatron_cispo cannot patch Megatron-LM: importing {module} failed because the package "
            f"{top!r} is not installed{also}. Install what Megatron-LM's RL entry point needs with "
            f"{EXTRA} (or pip install {shlex.quote(requirements.get(top, top))})") from e
    except ImportError as e:
        raise MegatronLMVersionError(f"megatron_cispo cannot patch Megatron-LM: importing {module} failed "
                                     f"({type(e).__name__}: {e}). Known refs: {known_refs()}") from e


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


def _with_cispo_flags(user: Optional[Callable]) -> Callable:
    return settings.extra_args_provider if user is None else (lambda parser: settings.extra_args_provider(user(parser)))


def _wrap_parse_args(original_parse: Callable) -> Callable:
    """parse_args with the --cispo-* flags added to whatever extra_args_provider it is given."""
    sig = inspect.signature(original_parse)

    @functools.wraps(original_parse)
    def parse_args(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = _with_cispo_flags(bound.arguments.get("extra_args_provider"))
        return original_parse(*bound.args, **bound.kwargs)

    return parse_args


def _wrap_pretrain(original_pretrain: Callable, record: dict) -> Callable:
    sig = inspect.signature(original_pretrain)
    help_here = flags_via_pretrain(record)

    @functools.wraps(original_pretrain)
    def pretrain(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        if help_here and HELP_FLAGS & set(sys.argv[1:]):
            # <= 0.17: ft_integration.setup() parses argv without pretrain's extra_args_provider
            # (add_inference_args) before initialize_megatron parses with it, so --help would miss
            # those flags: print the full help here. From 0.18 train_rl.py parses first, in full.
            arguments = importlib.import_module(ARGUMENTS)
            arguments.parse_args(extra_args_provider=bound.arguments.get("extra_args_provider"))  # exits
        step = bound.arguments["forward_step_func"]
        if not getattr(step, "_megatron_cispo_wrapped", False):
            bound.arguments["forward_step_func"] = with_signed_loss_report(step)
        return original_pretrain(*bound.args, **bound.kwargs)

    return pretrain


def _patch(module: Any, name: str, new: Callable) -> None:
    stash = module.__dict__.setdefault(STASH, {})
    current = getattr(module, name)
    if name not in stash:
        stash[name] = current
    if current is not new:
        setattr(module, name, new)
        _rebind(current, new, name)


def _patch_wrapped(module: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Patch module.name with wrap(original), built once per module (install() is idempotent)."""
    key = f"_{name}_wrapper"
    wrapped = module.__dict__.get(STASH, {}).get(key) or wrap(original(module, name))
    _patch(module, name, wrapped)
    module.__dict__[STASH][key] = wrapped


def install(config: Optional[LossConfig] = None, *, temperature: Optional[float] = None,
            patch_pretrain: bool = True) -> dict:
    """Patch the running Megatron-LM and return the recorded API it matched. Idempotent: a second
    call only updates config/temperature.

    config: the LossConfig to use; None reads the --cispo-* flags from Megatron's args on first
    use. temperature: of the trainer's logprobs; None reads --cispo-temperature (default 1.0).
    patch_pretrain: wrap megatron.training.arguments.parse_args (adds the --cispo-* flags) and
    pretrain (NEG_LOSS_KEY, full --help); without it the caller adds settings.extra_args_provider
    to Megatron's parse itself.
    Raises MegatronLMVersionError (one line, naming the function and the known refs) when the API
    matches no recorded ref or megatron.rl is not importable (no checkout on the path), and
    MegatronLMDependencyError, naming the package and the extra [megatron-lm], when Megatron-LM's
    code lacks a package it imports. Nothing is patched when either is raised.
    """
    rl = _import_megatron(RL_UTILS)
    training = arguments = None
    if patch_pretrain:
        training, arguments = _import_megatron(TRAINING), _import_megatron(ARGUMENTS)
    record = detect(rl, training, arguments)
    settings.configure(config, temperature=temperature)
    for name, new in REPLACEMENTS.items():
        _patch(rl, name, new)
    if training is not None:
        _patch_wrapped(arguments, "parse_args", _wrap_parse_args)
        _patch_wrapped(training, "pretrain", lambda fn: _wrap_pretrain(fn, record))
    _state["record"] = record
    return record


def installed() -> Optional[dict]:
    """The recorded API install() matched while the drop-ins are in place, else None."""
    rl = sys.modules.get(RL_UTILS)
    if rl is not None and all(getattr(rl, n, None) is f for n, f in REPLACEMENTS.items()):
        return _state["record"]
    return None


def uninstall() -> None:
    """Restore the originals in Megatron's modules (and any other non-megatron_cispo module that
    holds a patched name) and forget the configuration. megatron_cispo's own names stay ours."""
    for mod_name in (RL_UTILS, TRAINING, ARGUMENTS):
        mod = sys.modules.get(mod_name)
        stash = getattr(mod, STASH, None) if mod is not None else None
        if not stash:
            continue
        for name, orig in list(stash.items()):
            if name.startswith("_"):
                continue
            current = getattr(mod, name)
            setattr(mod, name, orig)
            _rebind(current, orig, name)
        delattr(mod, STASH)
    settings.configure(None)
    _state["record"] = None
