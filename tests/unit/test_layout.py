"""The package layout is the data flow: library <- base <- hf <- rollout <- runner <- demo <- train.py, and
no arrow back up.

Inside the library the parts have an order too (ORDER: schema <- presets <- config <- losses <-
step <- integrations, the logprob ops beside them), so two library modules cannot import each
other, not even lazily inside a function, as config.py and losses/presets.py once did.

Every module's imports are parsed with `ast` (module level and inside functions alike), resolved
to a megatron_cispo module and checked against the floor rule; `import megatron_cispo` must not
load megatron-core or touch torch.cuda, and its public names are exactly the documented ones.
"""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "megatron_cispo"
# order inside the library: a part imports only parts of a lower order (or itself), so no two parts
# can import each other; parts of one order are independent of each other
ORDER = {"schema": 0, "vocab_softmax": 0, "mcore": 0, "presets": 1, "kept_set": 1, "config": 2, "logprobs": 2, "fused_head": 2,
         "fused_grad": 3,
         "losses": 3, "step": 4, "integrations": 5, "__init__": 6}
LIBRARY = set(ORDER)
# floor of each top-level part; a module may import only from its own floor or below. base holds what
# hf, rollout and runner share (parameter names, durable writes); hf (Hugging Face files in and out)
# is a leaf above it; rollout (engines, prompts, rewards, the weight stream) uses hf; the runner builds,
# trains, saves and exports with all of them; tools and export_hf are entry points like train
FLOOR = {**{name: 0 for name in LIBRARY}, "base": 1, "hf": 2, "rollout": 3, "runner": 4, "demo": 5,
         "train": 6, "testing": 6, "tools": 6, "export_hf": 6}
TOP = max(FLOOR.values())
NAMES = {0: "library", 1: "base", 2: "hf", 3: "rollout", 4: "runner", 5: "demo", 6: "train/testing"}
DOC = PKG.parent / "docs" / "architecture.md"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path):
    """(line, absolute module) for every import in `path` that names the package."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from . import x` names submodule x; `from .m import f` names module m
            targets = [f"{prefix}.{a.name}" for a in node.names] if not node.module else [prefix]
        else:
            continue
        for t in targets:
            if t == root.name or t.startswith(root.name + "."):
                yield node.lineno, t


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violations(root: Path = PKG) -> list[str]:
    """Every import in the package that goes up a floor, as 'file:line: a (floor) imports b (floor)'."""
    out = []
    for path in sorted(root.rglob("*.py")):
        src = _part(_module_name(path, root))
        for line, target in _imports(path, root):
            dst = _part(target)
            if dst not in FLOOR:
                continue  # a plain attribute import from the package root, e.g. __version__
            where = f"{path.relative_to(root.parent)}:{line}: {src}"
            if FLOOR[dst] > FLOOR[src] or (FLOOR[src] == TOP and dst != src and FLOOR[dst] == TOP):
                out.append(f"{where} ({NAMES[FLOOR[src]]}) imports {target} ({NAMES[FLOOR[dst]]})")
            elif FLOOR[src] == FLOOR[dst] == 0 and dst != src and ORDER[dst] >= ORDER[src]:
                out.append(f"{where} (library order {ORDER[src]}) imports {target} (order {ORDER[dst]}); "
                           f"see ORDER")
    return out


def test_every_top_level_part_has_a_floor():
    parts = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert parts == set(FLOOR), f"give each new top-level module a floor in FLOOR: {parts ^ set(FLOOR)}"


def test_imports_run_one_way_library_runner_demo_train():
    assert violations() == []


@pytest.mark.parametrize("where, line", [
    ("losses/cispo.py", "from ..runner import checkpoint"),          # library -> runner
    ("step/reduce.py", "from megatron_cispo.testing import spawn"),   # library -> testing
    ("logprobs.py", "import megatron_cispo.rollout.task"),                # library -> demo
    ("runner/model.py", "from ..demo import task"),                   # runner -> demo
    ("runner/loop.py", "from .. import train"),                         # runner -> train
    ("hf/load.py", "    from ..runner.model import build_model"),  # hf is a leaf: not even lazily
    ("runner/loop.py", "    from ..demo.report import finish_run"),  # runner -> demo (train.py passes it)
    ("rollout/sampler.py", "from ..runner.metrics import say"),       # rollout -> runner
    ("hf/export.py", "from ..rollout.weight_stream import stream_buckets"),  # hf -> rollout
    ("rollout/weight_stream.py", "from ..runner import checkpoint_save"),  # rollout -> runner
    ("base/files.py", "from ..hf.arch import HFArch"),                # base -> hf
    ("config.py", "    from .runner.cpu_compat import CpuCompat"),   # inside a function, too
    # inside the library: the order
    ("config.py", "    from .losses.presets import expand_preset"),  # the old config <-> presets circle
    ("presets.py", "from .config import LossConfig"),                # presets sit below config
    ("losses/cispo.py", "from ..step import policy_step"),           # losses -> step
    ("logprobs.py", "from .fused_head import fused_token_logprobs"), # one order: independent
    ("schema.py", "import megatron_cispo"),                          # the package root re-exports all
])
def test_a_planted_upward_import_is_reported(tmp_path, where, line):
    root = tmp_path / "megatron_cispo"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    target = root / where
    body = f"def _planted():\n{line}\n" if line.startswith(" ") else f"{line}\n"
    target.write_text(target.read_text() + "\n" + body)
    found = violations(root)
    assert len(found) == 1 and found[0].startswith(f"megatron_cispo/{where}:"), found


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_import_megatron_cispo_loads_no_megatron_core_and_never_touches_cuda():
    proc = _run("""
        import sys, torch
        touched = []
        for name in ("is_available", "current_device", "device_count", "_lazy_init", "synchronize", "set_device"):
            real = getattr(torch.cuda, name)
            setattr(torch.cuda, name, lambda *a, _n=name, _r=real, **k: touched.append(_n) or _r(*a, **k))
        import megatron_cispo
        assert "megatron.core" not in sys.modules, "import megatron_cispo loaded megatron.core"
        for name in megatron_cispo.__all__:   # resolving every public name imports the whole library
            getattr(megatron_cispo, name)
        assert "megatron.core" not in sys.modules, "a library import loaded megatron.core"
        above = ("base", "hf", "rollout", "runner", "demo")
        assert not any(m.startswith(tuple(f"megatron_cispo.{p}" for p in above)) for m in sys.modules)
        assert torch.overrides._get_current_function_mode_stack() == [], "a TorchFunctionMode is active"
        assert touched == [], f"torch.cuda touched: {touched}"
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_public_names_are_listed_resolvable_and_documented_in_one_place():
    import megatron_cispo

    doc = megatron_cispo.__doc__
    assert sorted(megatron_cispo.__all__) == sorted(set(megatron_cispo.__all__))
    for name in megatron_cispo.__all__:
        assert getattr(megatron_cispo, name) is not None
        assert f"\n    {name} " in doc, f"{name} is exported but not described in megatron_cispo/__init__.py"
    assert "init_distributed" not in megatron_cispo.__all__ and "CpuCompat" not in megatron_cispo.__all__
    with pytest.raises(AttributeError):
        megatron_cispo.init_distributed  # noqa: B018 - the CPU layer is the runner's, not the library's


def map_problems(root: Path = PKG, doc: str | None = None) -> list[str]:
    """docs/architecture.md's module map against the package: every module (a subpackage's __init__.py
    aside) named in its folder's row or a row of its own, and every .py name there one that exists.
    A folder row's `name.py` is relative to the folder; one that names a module elsewhere
    (`rollout/async_feed.py` in the demo row) is a cross-reference."""
    doc = DOC.read_text() if doc is None else doc
    section = doc.split("## The module map", 1)[1].split("\n## ", 1)[0]
    modules = {str(p.relative_to(root)) for p in root.rglob("*.py")
               if p.name != "__init__.py" or p.parent == root}
    named, problems = set(), []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("floor", "---", "example"):
            continue
        row = cells[1].strip("`")
        if not row.endswith("/"):
            named.add(row)
            continue
        for name in re.findall(r"`([\w/]+\.py)`", cells[2]):
            if row + name in modules:
                named.add(row + name)
            elif name not in modules:
                problems.append(f"the {row} row names {name}, which is not a module")
    problems += [f"{m} is not in the module map" for m in sorted(modules - named)]
    problems += [f"the map names {m}, which is not a module" for m in sorted(named - modules)]
    return problems


def test_the_module_map_names_every_module_and_only_modules():
    assert map_problems() == []


def test_a_module_added_without_a_line_in_the_map_is_reported(tmp_path):
    root = tmp_path / "megatron_cispo"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "step" / "new_part.py").write_text('"""planted"""\n')
    (root / "hf" / "load.py").unlink()
    assert map_problems(root) == ["the hf/ row names load.py, which is not a module",
                                  "step/new_part.py is not in the module map"]


def _groups(line: str) -> list[set[str]]:
    return [set(group.split(", ")) for group in line.split(" < ")]


def test_the_import_order_the_doc_states_is_the_one_enforced_here():
    text = DOC.read_text()
    floors, library = (re.search(rf"^{key}:\s+(.+)$", text, re.M) for key in ("floors", "library"))
    assert floors and library, "docs/architecture.md's import rule lost its 'floors:' or 'library:' line"
    assert _groups(floors[1]) == [{"library"}] + [{p for p, f in FLOOR.items() if f == i} for i in range(1, TOP + 1)]
    assert _groups(library[1]) == [{p for p, o in ORDER.items() if o == i} for i in range(max(ORDER.values()) + 1)]


def parallel_state_readers(root: Path = PKG) -> list[str]:
    """Modules under step/ that import megatron-core's parallel_state (its globals), as 'file:line'."""
    out = []
    for path in sorted((root / "step").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "megatron.core.parallel_state" or n.startswith("megatron.core.parallel_state.") for n in names):
                out.append(f"{path.relative_to(root)}:{node.lineno}")
    return out


def test_only_step_groups_reads_megatrons_parallel_state_under_step():
    """The step takes its process groups as a pg_collection; step/groups.py's default_groups is the one
    place that falls back to megatron's globals (and it looks them up in sys.modules, importing nothing)."""
    assert parallel_state_readers() == []


def test_a_planted_parallel_state_import_under_step_is_reported(tmp_path):
    root = tmp_path / "megatron_cispo"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    path = root / "step" / "packing.py"
    path.write_text(path.read_text() + "\n\ndef _planted():\n    from megatron.core import parallel_state as mpu\n")
    assert [f.split(":")[0] for f in parallel_state_readers(root)] == ["step/packing.py"]
