"""notebooks/dsa_walkthrough.ipynb runs top to bottom on CPU, and is committed without outputs."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "dsa_walkthrough.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_notebook_runs_top_to_bottom(monkeypatch):
    # The kernel inherits this environment: force the CPU, and let it import the checkout.
    # (Figures go through the kernel's inline backend, so MPLBACKEND must not be forced.)
    monkeypatch.delenv("MPLBACKEND", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # "python3" is the running interpreter: jupyter_client runs a kernelspec whose argv starts
    # with "python" under sys.executable. Any cell error raises CellExecutionError.
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")
    assert "selected sets agree on 160/160 rows: True" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the selection map and the pool scores
