"""The package as a user installs it (issue 20, items 9 and 10): ranges in the metadata and exact
pins only in CI, one NIXL flavour in ``dev``, the license, one version, a changelog, an editable
install that mypy follows, and an API reference that builds from the docstrings."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import kvgeom

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _requirements() -> list[str]:
    return list(PROJECT["dependencies"]) + [r for extra in PROJECT["optional-dependencies"].values() for r in extra]


def test_the_package_states_ranges_and_ci_pins_them() -> None:
    pinned = [r for r in _requirements() if "==" in r or "===" in r]
    assert not pinned, f"exact pins belong to ci/constraints.txt: {pinned}"
    extras = PROJECT["optional-dependencies"]
    for name in ("nixl", "nixl-cu12", "nixl-cu13"):
        assert any(r.startswith("torch>=") for r in extras[name]), name
    assert any(r.startswith("nixl>=") for r in extras["nixl"])
    constraints = (ROOT / "ci" / "constraints.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in constraints if line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0" and "nixl-cu13" in pins
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-c ci/constraints.txt" in ci and '-e ".[dev]"' in ci and '"torch==2.13.0"' in ci


def test_dev_installs_one_nixl_flavour() -> None:
    """The ``nixl`` meta package depends on nixl-cu12 and nixl-cu13 both (1.8 GB on a CPU machine):
    ``dev`` names one flavour and never the meta package."""
    extras = PROJECT["optional-dependencies"]
    seen: set[str] = set()
    todo = ["dev"]
    while todo:  # the extras dev pulls in, transitively
        extra = todo.pop()
        seen.add(extra)
        for r in extras[extra]:
            m = re.match(r"kvgeom\[(.*)\]", r)
            if m:
                todo += [e.strip() for e in m.group(1).split(",") if e.strip() not in seen]
    names = {re.split(r"[<>=!\[ ;]", r)[0] for e in seen for r in extras[e]}
    assert "nixl" not in names and len(names & {"nixl-cu12", "nixl-cu13"}) == 1, names


def test_license_version_and_changelog() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190  # the full text
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    assert "License :: OSI Approved :: Apache Software License" in PROJECT["classifiers"]
    assert PROJECT["authors"] and PROJECT["classifiers"]
    # one version: kvgeom.__version__, read by setuptools
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvgeom.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvgeom.__version__)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(kvgeom.__version__)}\b", changelog, re.M)


def _user_python(tmp_path: Path, pth: str) -> Path:
    """A bare venv whose site-packages holds only ``pth`` as an editable install's .pth file."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=False, system_site_packages=False)
    (site,) = env.glob("lib/python*/site-packages")
    (site / "__editable__.kvgeom-0.pth").write_text(pth)
    return env / "bin" / "python"


def _mypy(python: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    user = tmp_path / "user_project.py"
    user.write_text("import kvgeom\n\nversion: str = kvgeom.__version__\nplan = kvgeom.plan_transfer\n")
    return subprocess.run([sys.executable, "-m", "mypy", "--python-executable", str(python), "--no-incremental",
                           "--cache-dir", str(tmp_path / "cache"), str(user)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)


@pytest.mark.timeout(900)
def test_mypy_in_a_users_project_finds_an_editable_kvgeom(tmp_path: Path) -> None:
    """setuptools' default editable install of a flat layout is an import hook that mypy cannot
    follow (``Cannot find implementation or library stub``); ``package-dir = {"" = "."}`` makes it
    a plain path entry. Built with the project's own PEP 660 hook, on a copy of the checkout."""
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name if src.exists() else (src.mkdir() or src / name))
    for pkg in ("kvgeom", "kvgeom_nixl"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; "
                            f"print(build_meta.build_editable({str(out)!r}))"], capture_output=True, text=True,
                           cwd=src, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        pths = {n: z.read(n).decode() for n in z.namelist() if n.endswith(".pth")}
        assert not [n for n in z.namelist() if "finder" in n], z.namelist()
    (pth,) = pths.values()
    assert pth.strip() == str(src)  # a plain path entry, no import hook
    done = _mypy(_user_python(tmp_path / "good", pth), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # the control: the same user project without the path entry is the error the issue saw
    bad = _mypy(_user_python(tmp_path / "bad", "import sys\n"), tmp_path)
    assert bad.returncode == 1 and "Cannot find implementation or library stub" in bad.stdout


@pytest.mark.timeout(900)
def test_the_api_reference_builds_from_the_docstrings(tmp_path: Path) -> None:
    """docs/quickstart.md's pdoc command, into a temporary folder (pdoc is in the docs and dev extras)."""
    pytest.importorskip("pdoc", reason="pdoc is in the docs extra")
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    (command,) = [line for line in quickstart.splitlines() if line.startswith("python -m pdoc ")]
    args = command.split()[3:]
    assert args[-2:] == ["-o", "docs/api"]
    faces = ["kvgeom"] + sorted(f"kvgeom.{d.name}" for d in (ROOT / "kvgeom").iterdir() if (d / "__init__.py").is_file())
    assert sorted(args[:-2]) == sorted([*faces, "kvgeom_nixl"])  # every public face, as the boundary test lists them
    done = subprocess.run([sys.executable, "-m", "pdoc", *args[:-1], str(tmp_path / "api")], capture_output=True,
                          text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    pages = {p.relative_to(tmp_path / "api").as_posix() for p in (tmp_path / "api").rglob("*.html")}
    assert {"kvgeom.html", "kvgeom_nixl.html", *(f"{f.replace('.', '/')}.html" for f in faces)} <= pages
    assert "plan_transfer" in (tmp_path / "api" / "kvgeom.html").read_text()
    assert "Warning" not in done.stderr, done.stderr[-3000:]
