"""The planner's modules import each other at the top only, without a cycle: spec, costs,
simulate, plan, then cli and plot; the names that moved out of plan.py still resolve
there."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import aristax.planner as planner
from aristax.planner import costs, plan, spec

# the module (``aristax.planner.simulate`` the package attribute is the function)
simulate = importlib.import_module("aristax.planner.simulate")
PLANNER = Path(planner.__file__).parent


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node, [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]


def _planner_imports(path: Path) -> set[str]:
    """The aristax.planner modules a file imports (``from aristax.planner import x``
    counts as importing module x)."""
    out = set()
    for _, names in _imports(ast.parse(path.read_text())):
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["aristax", "planner"] and len(parts) > 2:
                if (PLANNER / f"{parts[2]}.py").exists():
                    out.add(parts[2])
    return out


def test_no_import_of_aristax_inside_a_function():
    """Every aristax import of the planner is at module level (the only function-level
    imports left are matplotlib's in plot.py, the optional-dependency guard)."""
    inside = []
    for path in sorted(PLANNER.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node, names in _imports(fn):
                    if not all(n.split(".")[0] == "matplotlib" for n in names):
                        inside.append(f"{path.name}:{node.lineno} {names[0]}")
    assert inside == []


def test_planner_imports_form_no_cycle():
    graph = {p.stem: _planner_imports(p) - {p.stem} for p in PLANNER.glob("*.py")
             if p.stem != "__init__"}
    assert "plan" not in graph["simulate"] and "simulate" in graph["plan"]
    assert graph["spec"] <= {"aurora", "lancet", "lysi", "topology"}
    assert "plan" not in graph["costs"] | graph["spec"]
    done, visiting = set(), []

    def visit(m):
        assert m not in visiting, f"import cycle: {' -> '.join(visiting + [m])}"
        if m in done:
            return
        visiting.append(m)
        for dep in sorted(graph.get(m, ())):
            visit(dep)
        visiting.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


@pytest.mark.parametrize("module", ["simulate", "plan", "costs", "spec", "cli"])
def test_each_module_imports_first(module):
    """Imported first in a fresh interpreter, each module loads (a cycle dodged by
    import order would fail for one of them)."""
    run = subprocess.run([sys.executable, "-c", f"import aristax.planner.{module}"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_moved_names_still_resolve_in_plan():
    assert plan.ModelSpec is spec.ModelSpec and plan.Plan is spec.Plan
    for name in ("dispatch_bytes", "link_times", "dispatch_times", "expert_compute",
                 "block_ops", "ATTENTION_FLOPS_PER_TOKEN"):
        assert getattr(plan, name) is getattr(costs, name)
    assert simulate.dispatch_times is costs.dispatch_times
    assert planner.ModelSpec is spec.ModelSpec and planner.simulate is simulate.simulate
