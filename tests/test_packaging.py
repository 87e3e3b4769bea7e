"""The distribution installs one namespace: aristax, aristax.pallas_kernels, aristax.parallel."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPING = {"aristax": "aristax", "aristax.pallas_kernels": "pallas_kernels",
           "aristax.parallel": "parallel"}


def _package_dirs() -> set[str]:
    found = set()
    for name, folder in MAPPING.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == _package_dirs()


def test_wheel_installs_and_imports(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("aristax-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "aristax/pallas_kernels/ragged_dot/api.py" in names
    assert "aristax/parallel/__init__.py" in names
    assert not any(n.startswith(("pallas_kernels/", "parallel/")) for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True)
    code = ("import aristax, aristax.pallas_kernels, aristax.parallel, aristax.cli;"
            "print(aristax.__file__)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path,
                         capture_output=True, text=True).stdout
    assert out.strip().startswith(str(site)), out
    # the benchmark scripts are not in the wheel: `aristax bench` says where they are
    bench = subprocess.run([sys.executable, "-m", "aristax.cli", "bench"], env=env,
                           cwd=tmp_path, capture_output=True, text=True)
    assert bench.returncode == 1 and "pip install -e ." in bench.stderr, bench.stderr


def _aristax_imports(path: pathlib.Path) -> set[str]:
    """The aristax modules a file imports, at any level (function-level ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("aristax")}


def test_dependencies_point_one_way():
    """kernels <- core <- parallel <- layers/models/train: the kernels import nothing
    of aristax but themselves, the core nothing above it, parallel nothing above it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    core = ("config", "routing", "dispatch", "experts", "moe", "sharding")
    above_parallel = ("aristax.layers", "aristax.models", "aristax.train")
    for path in (root / "pallas_kernels").rglob("*.py"):
        bad = {n for n in _aristax_imports(path) if not n.startswith("aristax.pallas_kernels")}
        assert not bad, (path, bad)
    for name in core:
        bad = {n for n in _aristax_imports(root / "aristax" / f"{name}.py")
               if n.startswith(("aristax.parallel",) + above_parallel)}
        assert not bad, (name, bad)
    for path in (root / "parallel").rglob("*.py"):
        bad = {n for n in _aristax_imports(path) if n.startswith(above_parallel)}
        assert not bad, (path, bad)


def _private_uses(path: pathlib.Path) -> set[str]:
    """Private names (``_x``) that ``path`` takes from another aristax module: imported
    by name, or read as an attribute of a module it imported."""
    tree = ast.parse(path.read_text())
    modules, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aristax"):
            for alias in node.names:
                if alias.name.startswith("_") and alias.name != "__future__":
                    used.add(f"{node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith("aristax"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            used.add(f"{node.value.id}.{node.attr}")
    return used


def test_kernel_backends_share_only_public_code():
    """A kernel backend uses no private name of another module (shared code lives in
    public common modules), and a backend family imports no other family's backends:
    Triton files import no Mosaic GPU module and the other way round."""
    root = pathlib.Path(__file__).resolve().parents[1] / "pallas_kernels"
    families = {"triton": "mosaic_gpu", "mosaic_gpu": "triton"}
    for path in root.rglob("*.py"):
        assert not _private_uses(path), (path, _private_uses(path))
        family = next((f for f in families if path.stem.startswith(f)), None)
        if family is not None:
            other = {n for n in _aristax_imports(path) if families[family] in n}
            assert not other, (path, other)


SOURCE_DIRS = ("aristax", "parallel", "pallas_kernels")
MAX_FUNCTION_LINES = 80


def _functions(root: pathlib.Path, folders):
    """(path, function node) for every function and method, nested ones too, in the
    .py files under ``root / folder`` for each folder."""
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield path, node


def long_functions(root: pathlib.Path = ROOT) -> list[str]:
    """"path:line name (N lines)" for each function longer than MAX_FUNCTION_LINES, counted
    from its def line to its last line."""
    return [f"{path.relative_to(root)}:{fn.lineno} {fn.name} "
            f"({fn.end_lineno - fn.lineno + 1} lines)"
            for path, fn in _functions(root, SOURCE_DIRS + ("experiments/benchmarks",))
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES]


def function_level_aristax_imports(root: pathlib.Path = ROOT) -> list[str]:
    """"path:line function: import" for each import of an aristax module (or a relative
    one) inside a function body. Module-level imports, ``if TYPE_CHECKING:`` ones
    included, are not listed."""
    found = []
    for path, fn in _functions(root, SOURCE_DIRS):
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["aristax." if node.level else node.module or ""]
            else:
                continue
            if any(n == "aristax" or n.startswith("aristax.") for n in names):
                found.append(f"{path.relative_to(root)}:{node.lineno} {fn.name}: "
                             f"{ast.unparse(node)}")
    return found


def test_no_function_is_longer_than_80_lines():
    """Issue 30: no function (def line to last line, methods and nested functions
    included) over 80 lines in the library, the kernels, parallel and the benchmarks."""
    long = long_functions()
    print("\n".join(long))
    assert long == [], "functions over 80 lines:\n" + "\n".join(long)


def test_no_aristax_import_inside_a_function():
    """Issue 30: aristax modules are imported at module level only (a command's heavy
    handler module is imported by name when it runs: ``aristax.cli.resolve``)."""
    inside = function_level_aristax_imports()
    print("\n".join(inside))
    assert inside == [], "aristax imports inside functions:\n" + "\n".join(inside)
