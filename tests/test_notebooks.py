"""The notebooks run top to bottom (nbclient, kernel python3) and are committed without outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_the_two_notebooks_exist() -> None:
    assert {p.stem for p in NOTEBOOKS} >= {"tour", "hybrid"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name}: strip outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat", reason="running notebooks needs the notebook extra (nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="running notebooks needs the notebook extra (nbclient)")
    pytest.importorskip("ipykernel", reason="running notebooks needs a python3 Jupyter kernel (ipykernel)")
    pytest.importorskip("matplotlib", reason="the notebooks draw with matplotlib (notebook extra)")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.skip("no 'python3' Jupyter kernel spec is installed (python -m ipykernel install --user)")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError (with the cell and traceback) if any cell fails
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 2, f"{path.name}: expected the decode and prefill drawings"
