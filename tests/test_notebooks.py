"""The notebooks in experiments/notebooks/ run top to bottom, and are saved without outputs.

Each notebook is executed with nbclient in a fresh kernel of *this* interpreter
(``sys.executable``: a kernelspec written to a temporary JUPYTER_PATH, so a user-level
"python3" kernelspec pointing at another Python cannot be picked up), with the
repository root as its working directory. A cell that raises (the notebooks assert
what they claim) fails the test with the cell's traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "experiments" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "aristax-notebook-test"
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"mesh_layouts.ipynb", "train_inspect.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_saved_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: code cells {dirty} carry outputs or execution counts; "
                       "clear them before committing (jupyter nbconvert --clear-output --inplace)")
    assert "widgets" not in nb.metadata, f"{path.name}: saved widget state; clear it"


@pytest.fixture
def kernel_of_this_python(tmp_path, monkeypatch):
    """A kernelspec that starts ipykernel with sys.executable, found first on JUPYTER_PATH."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"aristax test ({sys.executable})",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # keep ~/.ipython untouched
    # the inline backend sends figures to the notebook, whatever MPLBACKEND the caller has
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return KERNEL_NAME


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_of_this_python):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name=kernel_of_this_python,
        resources={"metadata": {"path": str(REPO)}})  # cwd of the kernel: the repository root
    client.execute()  # raises CellExecutionError (with the traceback) when a cell fails
    errors = [o for cell in nb.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    images = sum("image/png" in o.get("data", {}) for cell in nb.cells for o in cell.get("outputs", []))
    assert images >= 3, f"{path.name} drew {images} figures; expected its plots"
