"""Every megatron-core name the package uses imports on the installed megatron-core (each CI tier).

The list, megatron_cispo/megatron_core_names.txt, is read from the source here: each
`from megatron.core... import x` / `import megatron.core.x`, and each attribute read through such a
name (`mpu.get_data_parallel_group`). An import inside `try: ... except ImportError|AttributeError`,
or on a line marked `# mcore-optional`, is optional: a version probe. After changing imports,
regenerate the list:

    .venv/bin/python tests/unit/test_megatron_core_names.py --write
"""
import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_cispo import mcore

PKG = Path(mcore.__file__).resolve().parent
RUNNER = ("runner/", "demo/", "testing.py", "train.py")  # not the library (imports run one way)
_PROBE_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception"}


def _catches_probe_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(isinstance(k, ast.Name) and k.id in _PROBE_ERRORS for k in kinds):
            return True
    return False


def scan_source(source: str) -> dict[str, bool]:
    """{dotted megatron-core name: required} for one module's source."""
    tree = ast.parse(source)
    lines = source.splitlines()
    optional_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and _catches_probe_error(node):
            for inner in node.body:
                optional_lines.update(range(inner.lineno, inner.end_lineno + 1))
    found: dict[str, bool] = {}

    def add(name, line):
        required = line not in optional_lines and "mcore-optional" not in lines[line - 1]
        found[name] = found.get(name, False) or required

    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                add(f"{node.module}.{a.name}", node.lineno)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("megatron.core"):
                    if a.asname:
                        aliases[a.asname] = a.name
                    add(a.name, node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and isinstance(node.ctx, ast.Load):
            add(f"{aliases[node.value.id]}.{node.attr}", node.lineno)
    return found


def scan_package() -> str:
    """The text of megatron_core_names.txt for the package as it is now."""
    uses: dict[str, dict] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        side = "runner" if rel.startswith(RUNNER) else "library"
        for name, required in scan_source(path.read_text()).items():
            entry = uses.setdefault(name, {"required": False, "sides": set(), "files": []})
            entry["required"] |= required
            entry["sides"].add(side)
            entry["files"].append(rel)
    out = ["# megatron-core names megatron_cispo uses: name, required|optional:library|runner, files.",
           "# Generated: python tests/unit/test_megatron_core_names.py --write (checked by that test)."]
    for name, e in sorted(uses.items()):
        side = "library" if "library" in e["sides"] else "runner"
        kind = f"{'required' if e['required'] else 'optional'}:{side}"
        out.append(f"{name} {kind} {','.join(e['files'])}")
    return "\n".join(out) + "\n"


def test_the_names_file_lists_every_megatron_core_name_the_source_uses():
    want = scan_package()
    assert mcore.NAMES_FILE.read_text() == want, (
        "megatron_cispo/megatron_core_names.txt is out of date with the source; regenerate it with "
        "`python tests/unit/test_megatron_core_names.py --write` and review the diff")


def test_every_required_name_imports_on_the_installed_megatron_core():
    missing = mcore.missing_names("all")
    assert not missing, f"megatron-core {mcore.version_str()} lacks: {missing}"
    mcore.require_names("library")  # and the runtime check agrees


def test_the_scan_finds_imports_attribute_reads_and_probes():
    src = ("from megatron.core import parallel_state as mpu\n"
           "import megatron.core.tensor_parallel as tp\n"
           "def f():\n"
           "    try:\n"
           "        from megatron.core.new_thing import helper\n"
           "    except ImportError:\n"
           "        helper = None\n"
           "    from megatron.core.old import gone  # mcore-optional: 0.16 only\n"
           "    return mpu.get_data_parallel_group(), tp.vocab_parallel_cross_entropy, getattr(mpu, 'x', 0)\n")
    assert scan_source(src) == {
        "megatron.core.parallel_state": True, "megatron.core.tensor_parallel": True,
        "megatron.core.parallel_state.get_data_parallel_group": True,
        "megatron.core.tensor_parallel.vocab_parallel_cross_entropy": True,
        "megatron.core.new_thing.helper": False, "megatron.core.old.gone": False}


def test_a_missing_name_is_one_import_error_line_naming_it_and_the_tested_versions(monkeypatch, tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("megatron.core.parallel_state.get_data_parallel_group required:library step.py\n"
                     "megatron.core.parallel_state.no_such_function_anywhere required:library step.py\n"
                     "megatron.core.no_such_module.x optional:library step.py\n"
                     "megatron.core.parallel_state.runner_only_missing required:runner runner/x.py\n")
    monkeypatch.setattr(mcore, "NAMES_FILE", names)
    mcore.require_names.cache_clear()
    with pytest.raises(ImportError) as err:
        mcore.require_names("library")
    msg = str(err.value)
    assert "\n" not in msg and "megatron.core.parallel_state.no_such_function_anywhere" in msg
    assert "runner_only_missing" not in msg and "no_such_module" not in msg
    assert mcore.version_str() in msg and "0.16.1" in msg and "0.19.2" in msg
    mcore.require_names.cache_clear()


def test_a_dependency_megatron_core_cannot_import_is_one_line_naming_it(tmp_path, monkeypatch):
    # as megatron-core >= 0.18 without triton: its module imports, bare, a package that is absent
    pkg = tmp_path / "fake_mcore_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "needs_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(mcore.MegatronCoreMissing) as err:
        mcore.resolve("fake_mcore_pkg.needs_dep.thing")
    assert "'no_such_dependency_xyz', which is not installed" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ImportError):  # a module of megatron-core's own that is absent: a missing name
        mcore.resolve("fake_mcore_pkg.no_such_module.thing")
    names = tmp_path / "names.txt"
    names.write_text("fake_mcore_pkg.needs_dep.thing required:library step.py\n")
    monkeypatch.setattr(mcore, "NAMES_FILE", names)
    mcore.require_names.cache_clear()
    with pytest.raises(mcore.MegatronCoreMissing, match="'no_such_dependency_xyz', which is not installed"):
        mcore.require_names("library")  # the dependency's line, not "lacks fake_mcore_pkg.needs_dep.thing"
    mcore.require_names.cache_clear()


def test_the_cpu_import_of_megatron_core_names_a_missing_dependency_in_one_line():
    code = ("import sys; sys.modules['packaging'] = None\n"  # megatron.core imports it, bare, on both tiers
            "from megatron_cispo.runner.cpu_compat import import_megatron_core\n"
            "import_megatron_core()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "MegatronCoreMissing: import megatron.core (megatron-core" in proc.stderr, proc.stderr[-2000:]


def test_no_megatron_core_at_all_is_one_line(monkeypatch):
    monkeypatch.setattr(mcore, "installed_version", lambda: None)
    mcore.require_names.cache_clear()
    with pytest.raises(mcore.MegatronCoreMissing, match=r"^megatron-core is not installed: megatron_cispo needs "
                                                        r"megatron-core>=0.16.1 \(tested: 0.16.1, 0.19.2\)$"):
        mcore.require_names("library")
    mcore.require_names.cache_clear()


def test_the_installed_version_is_read_without_importing_megatron_core():
    import megatron.core.package_info as info  # the truth, imported here only to compare

    assert mcore.installed_version() == (int(info.MAJOR), int(info.MINOR), int(info.PATCH))


@pytest.mark.parametrize("version,warns", [((0, 16, 1), False), ((0, 19, 2), False), ((0, 18, 0), False),
                                           ((0, 15, 3), True), ((0, 20, 0), True)])
def test_a_version_outside_the_supported_range_warns_once_naming_the_range(monkeypatch, version, warns):
    monkeypatch.setattr(mcore, "installed_version", lambda: version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcore.warn_if_untested()
    assert len(caught) == int(warns)
    if warns:
        assert ">=0.16.1,<0.20.0" in str(caught[0].message) and "0.19.2" in str(caught[0].message)


def test_setup_py_declares_the_supported_range_and_requires_only_its_floor():
    setup_py = (PKG.parent / "setup.py").read_text()
    low, high = (mcore.version_str(v) for v in mcore.SUPPORTED)
    assert f'MEGATRON_CORE_SUPPORTED = ("{low}", "{high}")' in setup_py
    assert 'f"megatron-core>={MEGATRON_CORE_SUPPORTED[0]}",' in setup_py  # newer: a warning, not a refusal


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    mcore.NAMES_FILE.write_text(scan_package())
    print(f"wrote {mcore.NAMES_FILE}")
