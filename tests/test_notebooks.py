"""The notebooks run top to bottom in a fresh kernel (a failing cell fails the test)."""

from __future__ import annotations

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_five_notebooks_stored_without_outputs():
    assert [n.stem[:2] for n in NOTEBOOKS] == ["01", "02", "03", "04", "05"]
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_runs_top_to_bottom(path, monkeypatch):
    # The kernel starts as a user's would: no test settings, keras_ipu importable.
    for name in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if output.get("output_type") == "error"]
    assert errors == []


def test_the_porting_notebook_holds_the_examples_verbatim():
    """Each example cell is an `examples/` file: the seed's code with its imports changed."""
    notebook = nbformat.read(ROOT / "notebooks" / "05_porting_from_ipu_tensorflow.ipynb",
                             as_version=4)
    named = [cell.source for cell in notebook.cells if cell.cell_type == "markdown"
             and cell.source.startswith("`examples/")]
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"][1:]
    assert len(named) == len(code) >= 7
    for name, source in zip(named, code):
        path = ROOT / name.strip("`")
        assert source.strip() == path.read_text().strip(), path.name
