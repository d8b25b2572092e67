"""The notebooks run top to bottom (nbclient, kernel python3) and are committed without outputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat", reason="running notebooks needs the notebook extra (nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="running notebooks needs the notebook extra (nbclient)")
    pytest.importorskip("ipykernel", reason="running notebooks needs a python3 Jupyter kernel (ipykernel)")
    pytest.importorskip("matplotlib", reason="the notebooks draw with matplotlib (notebook extra)")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.skip("no 'python3' Jupyter kernel spec is installed (python -m ipykernel install --user)")
    assert nbclient is not None and shutil.which("jupyter") is not None
    # the README's command (nbclient's `jupyter execute`), on a copy so that the checkout stays clean
    work = tmp_path / path.name
    shutil.copy(path, work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["jupyter", "execute", "--timeout=300", "--kernel_name=python3", "--output=executed",
                           str(work)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    nb = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 2, f"{path.name}: expected the decode and prefill drawings"
    if path.stem == "tour":
        _check_tour_strategies(nb)


def _check_tour_strategies(nb: Any) -> None:
    """Issue 20 (6): the strategy loop printed ``auto copies 0`` (auto chose packed) under prose that
    said auto weighs direct against staged. The loop now prints every strategy, packed included, and
    auto's choice; the prose before it names packed and the choice the notebook printed."""
    (i, cell), = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and "for strategy in" in c.source]
    text = "".join(o.get("text", "") for o in cell.get("outputs", []))
    rows = {line.split()[0]: line for line in text.splitlines() if " descriptors " in line and line.split()[0] in
            ("direct", "staged", "packed", "auto")}
    assert set(rows) == {"direct", "staged", "packed", "auto"}, text
    chose = [line for line in text.splitlines() if line.startswith("auto chose ")]
    assert len(chose) == 1, text
    picked = chose[0].split()[2].rstrip(":")
    assert rows["auto"].split()[1:3] == rows[picked].split()[1:3]  # auto's descriptors are its pick's
    prose = nb.cells[i - 1].source
    assert nb.cells[i - 1].cell_type == "markdown" and "packed" in prose and "against packed" in prose
