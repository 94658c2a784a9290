"""examples/quickstart.ipynb runs top to bottom in a real Jupyter kernel: the loss falls, both figures are drawn, the
shards read a DataSource's batches and the checkpoint restores."""

from __future__ import annotations

import pathlib

import pytest

nbclient = pytest.importorskip("nbclient", reason="needs nbclient and ipykernel (the dev extras)")
nbformat = pytest.importorskip("nbformat")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"


@pytest.mark.timeout(300)
def test_the_quickstart_notebook_runs_and_draws_its_figures(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises if a cell fails
    printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.outputs if output.output_type == "stream")
    assert "loss fell from" in printed and "restored on 2 stages: True" in printed
    assert "2560 rows in 40 batches, read by the shards" in printed
    images = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
              if "image/png" in output.get("data", {})]
    assert len(images) == 2  # history.plot() and model.timeline().plot()
