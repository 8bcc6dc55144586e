"""Run notebooks/dsa_walkthrough.ipynb top to bottom on the CPU and store its outputs in the
file (the committed notebook shows one run's outputs): `.venv/bin/python scripts/run_notebook.py`
from the checkout (needs the `notebook` or `test` extra)."""

import os
import sys

import nbclient
import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "dsa_walkthrough.ipynb")


def main() -> int:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.pop("MPLBACKEND", None)  # figures go through the kernel's inline backend
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": ROOT}}).execute()
    nbformat.write(nb, NOTEBOOK)
    print(f"wrote {NOTEBOOK} with the outputs of this run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
