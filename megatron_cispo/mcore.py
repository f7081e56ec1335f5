"""Which megatron-core this package supports, and the megatron-core names it uses.

    installed_version()     # (0, 19, 2), read from megatron/core/package_info.py, nothing imported
    warn_if_untested()      # once, at `import megatron_cispo`: a version outside SUPPORTED
    require_names("library")  # one ImportError line naming what this megatron-core lacks

Every `from megatron.core... import` in the package, and every attribute read through such an
import, is listed in megatron_core_names.txt; tests/unit/test_megatron_core_names.py keeps the
list equal to the source and imports each name on every CI tier, so a release that drops one is
one failing test here, and one line in a user's job (require_names), not a traceback mid-step.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import warnings
from functools import lru_cache
from pathlib import Path

# The range setup.py declares: the releases CI runs (0.16.1, 0.19.2) and those between them, whose
# differences were read from their source (docs/launch.md, "megatron-core versions").
SUPPORTED = ((0, 16, 1), (0, 20, 0))  # [low, high)
TESTED = ("0.16.1", "0.19.2")
NAMES_FILE = Path(__file__).with_name("megatron_core_names.txt")


@lru_cache(maxsize=1)
def installed_version() -> tuple[int, int, int] | None:
    """megatron-core's (major, minor, patch), read from the package_info.py that `import megatron.core`
    would load (a fork on PYTHONPATH shadows the wheel), without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        info = Path(root) / "core" / "package_info.py"
        if info.is_file():
            values = {}
            for node in ast.parse(info.read_text()).body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                    values.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
            try:
                return int(values["MAJOR"]), int(values["MINOR"]), int(values["PATCH"])
            except (KeyError, ValueError):
                return None
    return None


def version_str(version=None) -> str:
    version = version or installed_version()
    return "none" if version is None else ".".join(map(str, version))


def warn_if_untested() -> None:
    """One warning when the installed megatron-core is outside SUPPORTED; never an error: a version
    is refused only for a name it lacks (require_names)."""
    version = installed_version()
    if version is not None and not SUPPORTED[0] <= version < SUPPORTED[1]:
        warnings.warn(f"megatron_cispo supports megatron-core >={version_str(SUPPORTED[0])},<"
                      f"{version_str(SUPPORTED[1])} (tested: {', '.join(TESTED)}); found {version_str(version)}. "
                      "Run the test suite (bash tests/run.sh) before training on it.", stacklevel=2)


def names(scope: str = "all") -> list[tuple[str, bool]]:
    """(dotted name, required) for each megatron-core name the package uses; scope "library" keeps
    the names that the library modules use (not runner/, demo/, testing.py, train.py)."""
    out = []
    for line in NAMES_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, kind, _files = line.split(maxsplit=2)
        if scope == "library" and kind.endswith("runner"):
            continue
        out.append((name, not kind.startswith("optional")))
    return out


class MegatronCoreMissing(ImportError):
    """The installed megatron-core lacks names this package needs, or cannot be imported (one line)."""


def import_failed(module: str, err: ModuleNotFoundError) -> MegatronCoreMissing:
    """One line for `import module` failing on a package megatron-core needs (e.g. triton, which
    0.18+ imports bare) rather than on megatron-core's own module."""
    return MegatronCoreMissing(f"import {module} (megatron-core {version_str()}) failed: it needs the module "
                               f"{err.name!r}, which is not installed; pip install {err.name} (torch pinned)")


def resolve(dotted: str):
    """Import `a.b.c.name` as a module, or as an attribute of the longest importable prefix; a module
    that fails on a missing dependency raises MegatronCoreMissing (import_failed)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and not (module == e.name or module.startswith(e.name + ".")):
                raise import_failed(module, e) from None
            continue
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def missing_names(scope: str = "all") -> list[str]:
    missing = []
    for name, required in names(scope):
        if required:
            try:
                resolve(name)
            except MegatronCoreMissing:
                raise  # a missing dependency: its own line, not a list of the names behind it
            except (ImportError, AttributeError):
                missing.append(name)
    return missing


@lru_cache(maxsize=2)
def require_names(scope: str = "library") -> None:
    """Raise MegatronCoreMissing naming every required megatron-core name that is missing."""
    if installed_version() is None:
        raise MegatronCoreMissing(f"megatron-core is not installed: megatron_cispo needs megatron-core"
                                  f">={version_str(SUPPORTED[0])} (tested: {', '.join(TESTED)})")
    missing = missing_names(scope)
    if missing:
        raise MegatronCoreMissing(f"megatron-core {version_str()} lacks {', '.join(missing)}, which megatron_cispo "
                                  f"uses (tested: {', '.join(TESTED)}); install megatron-core=={TESTED[-1]}")
