"""The package as a user installs it: the wheel's name and contents, and a pytest plugin that costs
nothing."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = out.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, built by setuptools' PEP 517 hook in this environment (no build isolation, as
    the wheel above)."""
    out = tmp_path_factory.mktemp("sdist")
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, timeout=300
    )
    (tar,) = out.glob("*.tar.gz")
    return tar


def test_the_license_and_its_metadata_ship_in_the_wheel_and_the_sdist(
    wheel: Path, sdist: Path
) -> None:
    """Apache-2.0 as an SPDX expression (PEP 639) with the LICENSE file, in both distributions;
    the sdist holds the package and no tests (the suite runs from a clone)."""
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.lstrip().startswith("Apache License\n") and "Version 2.0" in license_text
    whl = zipfile.ZipFile(wheel)
    meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    (lic,) = [n for n in whl.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert whl.read(lic).decode() == license_text
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        member = tar.extractfile(f"{sdist.name[: -len('.tar.gz')]}/LICENSE")
        assert member is not None and member.read().decode() == license_text
        pkg_info = tar.extractfile(f"{sdist.name[: -len('.tar.gz')]}/PKG-INFO")
        assert pkg_info is not None
        sdist_meta = pkg_info.read().decode()
    for text in (meta, sdist_meta):
        head = text.split("\n\n", 1)[0].splitlines()  # the headers, before the description
        assert "License-Expression: Apache-2.0" in head and "License-File: LICENSE" in head
        assert not any(h.startswith(("License:", "Classifier: License ::")) for h in head)
        assert "Requires-Dist: numpy>=1.26" in head  # torch warns on import without it
        urls = {h.split(", ", 1)[0] for h in head if h.startswith("Project-URL: ")}
        assert {"Project-URL: Documentation", "Project-URL: Repository"} <= urls, urls
        assert "Classifier: Typing :: Typed" in head
    # the description is the README, whose links work on the package index (absolute)
    readme = (ROOT / "README.md").read_text()
    assert readme in meta and "](docs/" not in readme and "](notebooks/" not in readme
    assert readme.index("pip install torch-fastdist") < readme.index("git clone ")
    assert {"LICENSE", "README.md", "pyproject.toml", "src/fastdist/__init__.py"} <= names
    assert {"src/fastdist/comm/native/fakecomm.c", "src/fastdist_pytest/__init__.py"} <= names
    assert not [n for n in names if n.startswith("tests/")]


def test_the_wheel_is_torch_fastdist_with_both_packages(wheel: Path) -> None:
    # "fastdist" on the index is an unrelated project
    assert wheel.name.startswith("torch_fastdist-"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    for f in (
        "fastdist/__init__.py",
        "fastdist/py.typed",
        "fastdist/comm/native/fakecomm.c",
        "fastdist/nn/parallelize.py",
        "fastdist_pytest/__init__.py",
        "fastdist_pytest/py.typed",
    ):
        assert f in names, f
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "\nName: torch-fastdist\n" in text
    entry = zipfile.ZipFile(wheel).read(meta.replace("METADATA", "entry_points.txt")).decode()
    assert (
        "[pytest11]\nfastdist = fastdist_pytest" in entry
        and "fastdist = fastdist.__main__:main" in entry
    )


def test_the_installed_wheel_imports_and_runs(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    code = (
        "import fastdist, torch; m = fastdist.Mesh({'tp': 2}); print(fastdist.__file__); "
        "print(fastdist.simulate(lambda x: fastdist.psum(x, m, 'tp'), m)(torch.ones(2)).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1] == "[2.0, 2.0]"


def test_the_pytest_plugin_imports_neither_torch_nor_fastdist(tmp_path: Path) -> None:
    """pytest loads the plugin in every run of the environment; only a test that uses the fixture
    pays for torch."""
    (tmp_path / "test_lazy.py").write_text(
        "import sys\n\n"
        "def test_nothing_heavy_loaded():\n"
        "    assert 'torch' not in sys.modules and 'fastdist' not in sys.modules\n\n"
        "def test_the_fixture_still_works(fastdist_mesh):\n"
        "    assert dict(fastdist_mesh.shape) == {'dp': 2, 'tp': 2}\n"
    )
    env = {
        "PYTHONPATH": str(ROOT / "src"),
        "PATH": "/usr/bin:/bin",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "fastdist_pytest",
            "-p",
            "no:cacheprovider",
            "test_lazy.py",
        ],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 passed" in res.stdout


def test_the_installed_entry_point_is_the_light_plugin() -> None:
    eps = [ep for ep in metadata.entry_points(group="pytest11") if ep.name == "fastdist"]
    assert [ep.value for ep in eps] == ["fastdist_pytest"], eps


def test_a_fresh_venv_installs_the_wheel_with_its_dependencies(wheel: Path, tmp_path: Path) -> None:
    """What a user gets from ``pip install torch-fastdist``: a new virtual environment (nothing
    from this one), pip resolving torch and einops itself, then the package, its CLI and the
    pytest plugin working there. Pinned by constraints.txt to the CPU torch, as the README's
    install is."""
    env_dir = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", str(env_dir)], check=True, capture_output=True, timeout=120
    )
    py = str(env_dir / "bin" / "python")
    install = subprocess.run(
        [py, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    check = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    code = (
        "import fastdist, torch, einops; m = fastdist.Mesh({'dp': 2, 'tp': 2}); "
        "print(fastdist.__file__); "
        "f = fastdist.simulate(lambda x: fastdist.psum(x, m, 'tp'), m); "
        "print(f(torch.arange(4.)).tolist())"
    )
    run = subprocess.run(
        [py, "-c", code], env=clean, capture_output=True, text=True, timeout=300, check=True
    )
    # no warning on import (torch's "Failed to initialize NumPy" without numpy): nothing on stderr
    assert run.stderr == "", run.stderr
    out = run.stdout.splitlines()
    assert out[0].startswith(str(env_dir)), out
    assert out[1] == "[1.0, 1.0, 5.0, 5.0]", out
    cli = subprocess.run(
        [py, "-m", "fastdist", "--help"], env=clean, capture_output=True, text=True, timeout=300
    )
    assert cli.returncode == 0 and "usage:" in cli.stdout, cli.stdout + cli.stderr
    (tmp_path / "test_fixture.py").write_text(
        "def test_mesh(fastdist_mesh):\n"
        "    assert dict(fastdist_mesh.shape) == {'dp': 2, 'tp': 2}\n"
    )
    # the plugin loads from the installed entry point (pytest itself is not a dependency)
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "pytest"], check=True, capture_output=True, timeout=300
    )
    res = subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_fixture.py"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr
