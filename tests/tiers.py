"""Which test files reach megatron-core, read from their imports: CI's tier 2 (megatron-core 0.19.2) runs those.

    python tests/tiers.py              # the test files that reach megatron-core (tier 2 runs them)
    python tests/tiers.py --free       # the others: tier 1 only, where .ci/run blocks megatron-core
    python tests/tiers.py --why FILE   # the chain of imports from FILE to megatron-core

A file reaches megatron-core when its imports, followed through megatron_cispo, the test helpers, the
conftest files above it and the scripts it launches, reach a `megatron` module. Imports inside
functions count; so do module names that strings import or launch (`-m megatron_cispo.train`, code for
`python -c`, a forkserver's preload list) and the launch and benchmark scripts a string names.
`from megatron_cispo import Name` follows the package's lazy export table (_EXPORTS) to the module
that defines Name; `import megatron_cispo` runs only the package's own imports. The analysis errs
towards megatron-core (an import in a branch never taken counts), and what it cannot see (an
import_module of a computed name) is caught at run time: .ci/run runs the files it calls free with
megatron-core made unimportable (tests/tiers_block), so a misjudged file fails on tier 1 instead of
silently leaving tier 2 (tests/unit/test_tiers.py).
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_cispo"
MCORE = "<megatron-core>"
# a module a string imports or launches: a dotted name alone (argv's `-m NAME`, an import_module or
# preload-list entry), or an import statement in code text (`python -c`)
_DOTTED = re.compile(rf"^(?:megatron|{PACKAGE})(?:\.\w+)*$")
_CODE_IMPORT = re.compile(rf"(?:^|[\s;(])(?:import|from)\s+((?:{PACKAGE}|megatron)(?:\.\w+)*)(?!\w)")
_SCRIPT = re.compile(r"(?<![\w./-])((?:launch|benchmarks|tests)/[\w./-]+\.(?:py|sh|sbatch))")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _is_lookup(call: ast.Call) -> bool:
    """sys.modules.get(NAME) and find_spec(NAME) look a top-level module up without running it."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return name == "find_spec" or (isinstance(f, ast.Attribute) and getattr(f.value, "attr", "") == "modules")


def _is_exports(node: ast.AST) -> bool:
    return isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets)


class Graph:
    """The import graph of one checkout: nodes are package modules (dotted), test helpers (bare names),
    files (paths relative to the root) and MCORE."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self.modules = {}
        for path in (root / PACKAGE).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            self.modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        # test helpers are imported by bare name (pytest puts each test directory on sys.path)
        self.helpers = {p.stem: p for p in sorted((root / "tests").rglob("*.py")) if p.stem != "conftest"}
        self._edges: dict[Path, tuple[str, ...]] = {}

    def resolve(self, name: str) -> list[str]:
        """The nodes importing `name` runs: its parent packages and itself."""
        if name == "megatron" or name.startswith("megatron."):
            return [MCORE]
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            parts = name.split(".")
            return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in self.modules]
        return [name] if name in self.helpers else []  # the standard library, third-party packages

    def path(self, node: str) -> Path:
        return self.modules.get(node) or self.helpers.get(node) or self.root / node

    def edges(self, path: Path) -> tuple[str, ...]:
        """The nodes one file leads to: what it imports, launches or names."""
        if path not in self._edges:
            text = path.read_text()
            found = self._text_edges(text, path) if path.suffix != ".py" else self._python_edges(text, path)
            self._edges[path] = tuple(sorted(set(found) - {self._module_of(path)}))
        return self._edges[path]

    def _module_of(self, path: Path) -> str | None:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        if parts[0] != PACKAGE:
            return None
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def _lazy_exports(self, module: str) -> dict[str, str]:
        init = self.modules.get(module)
        if init is None or init.name != "__init__.py":
            return {}
        for node in ast.parse(init.read_text()).body:
            if _is_exports(node):
                return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)}
        return {}

    def _python_edges(self, text: str, path: Path) -> list[str]:
        tree, here, out, skip = ast.parse(text), self._module_of(path), [], set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    out += self.resolve(a.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative, from the file's own package
                    pkg = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                out += self.resolve(base)
                lazy = self._lazy_exports(base)
                for a in node.names:
                    if f"{base}.{a.name}" in self.modules:
                        out.append(f"{base}.{a.name}")
                    elif a.name in lazy:
                        out += self.resolve(lazy[a.name])
            elif _is_exports(node):  # lazy: reached through `from pkg import Name` only
                skip |= {id(n) for n in ast.walk(node.value)}
        return out + self._string_edges(tree, skip | _docstrings(tree), path)

    def _string_edges(self, tree: ast.AST, skip: set[int], path: Path) -> list[str]:
        """Prose (docstrings, messages) imports nothing, nor does a name only looked up
        (`sys.modules.get("megatron.core...")`, `find_spec("megatron")`): a dotted name counts as a call's
        argument or a list/tuple/set element, code text by its import statements, any string by the
        scripts it names."""
        bare = set()
        for node in ast.walk(tree):
            items = []
            if isinstance(node, ast.Call) and not _is_lookup(node):
                items = [*node.args, *(k.value for k in node.keywords)]
            elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                items = node.elts
            bare |= {id(n) for n in items if isinstance(n, ast.Constant)}
        out = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if id(node) in bare and _DOTTED.match(node.value):
                    out += self.resolve(node.value)
                out += self._text_edges(node.value, path)
        return out

    def _text_edges(self, text: str, path: Path) -> list[str]:
        """Imports in code text, and the scripts a text names (a shell script is one text)."""
        out = [n for m in _CODE_IMPORT.findall(text) for n in self.resolve(m)]
        if path.suffix != ".py":  # a script's `-m megatron_cispo.train`
            out += [n for m in re.findall(rf"-m\s+({PACKAGE}(?:\.\w+)*)", text) for n in self.resolve(m)]
        for s in _SCRIPT.findall(text):
            f = self.root / s
            if f.is_file() and f != path and not f.name.startswith("test_"):  # a test file is not run by name
                out.append(s)
        return out

    def conftests(self, test_file: Path) -> list[str]:
        tests = self.root / "tests"
        return [str((d / "conftest.py").relative_to(self.root)) for d in [test_file.parent, *test_file.parents]
                if (d == tests or tests in d.parents) and (d / "conftest.py").is_file()]

    def chain(self, test_file: Path) -> list[str] | None:
        """The shortest chain of imports from a test file to megatron-core, or None."""
        start = str(test_file.relative_to(self.root))
        parent = {start: None, **{c: start for c in self.conftests(test_file)}}
        queue = list(parent)
        while queue:
            node = queue.pop(0)
            if node == MCORE:
                out = []
                while node is not None:
                    out.append(node)
                    node = parent[node]
                return out[::-1]
            for nxt in self.edges(self.path(node)):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        return None

    def split(self) -> tuple[list[str], list[str]]:
        """(test files that reach megatron-core, those that do not), relative to the root."""
        reach, free = [], []
        for f in sorted((self.root / "tests").rglob("test_*.py")):
            (reach if self.chain(f) else free).append(str(f.relative_to(self.root)))
        return reach, free


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--free", action="store_true", help="list the files that never reach megatron-core")
    ap.add_argument("--why", metavar="FILE", help="print the import chain from FILE to megatron-core")
    a = ap.parse_args(argv)
    g = Graph()
    if a.why:
        found = g.chain(Path(a.why).resolve())
        print(" -> ".join(found) if found else f"{a.why}: no import reaches megatron-core")
        return 0
    reach, free = g.split()
    print("\n".join(free if a.free else reach))
    return 0


if __name__ == "__main__":
    sys.exit(main())
