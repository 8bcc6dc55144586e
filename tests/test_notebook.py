"""notebooks/dsa_walkthrough.ipynb runs top to bottom on CPU, and is committed with the outputs
of such a run (its figures visible where it is browsed; `scripts/run_notebook.py` refreshes
them)."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "dsa_walkthrough.ipynb"


def _stream_text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")


def _images(nb) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]


def test_notebook_is_stored_with_the_outputs_of_one_run():
    """Every code cell ran, in order, once, without error; the figures and the agreement with
    the reference (in numbers and in words) are in the file."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert len(_images(nb)) == 2
    text = _stream_text(nb)
    assert "selected sets agree on 160/160 rows: True" in text and "In words:" in text


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
    assert "selected sets agree on 160/160 rows: True" in _stream_text(nb)
    assert len(_images(nb)) == 2  # the selection map and the pool scores
