"""The distributions: the sdist carries the contract, docs, licence and pins; the wheel built from it installs into
a fresh virtual environment, within the ranges pyproject.toml gives, and runs there."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("shardtrain", "client_sdk", "coordinator", "shard_service")
# What pip says when it cannot reach a package it needs: the test then skips, as on a machine without the index.
UNREACHABLE = ("No matching distribution", "Could not find a version", "NewConnectionError", "Network is unreachable",
               "Temporary failure in name resolution", "ConnectTimeout", "ProxyError")


@pytest.fixture(scope="module")
def distributions(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """(sdist, wheel) built as `python -m build` does: the sdist from a copy of the checkout, the wheel from the
    unpacked sdist, so a file the sdist lacks breaks the wheel too."""
    pytest.importorskip("build", reason="the dev extra installs build: pip install -c constraints.txt -e '.[dev]'")
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"  # a copy: building in the checkout would leave build/ and egg-info behind
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".whl", ".devrun", "node_modules"))
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "-o", str(work / "dist"), str(source)],
                           capture_output=True, text=True, timeout=300)
    if built.returncode != 0 and "Missing dependencies" in built.stdout + built.stderr:
        pytest.skip(f"the build backend is not installed here: {(built.stdout + built.stderr)[-300:]}")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (sdist,) = (work / "dist").glob("shardtrain-*.tar.gz")
    (wheel,) = (work / "dist").glob("shardtrain-*.whl")
    return sdist, wheel


def test_the_sdist_carries_the_protos_the_docs_the_licence_and_the_pins(distributions):
    sdist, _ = distributions
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    protos = {str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*") if p.is_file()}
    docs = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert protos and docs and protos | docs | {"LICENSE", "constraints.txt", "README.md"} <= names, \
        sorted(protos | docs - names)


def test_the_wheel_carries_the_protos_the_type_markers_and_the_metadata(distributions):
    """shardtrain/v1/*.proto are links to protos/: the installed package carries the contract beside its stubs."""
    _, wheel = distributions
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for source in (ROOT / "protos" / "shardtrain" / "v1").glob("*.proto"):
            assert archive.read(f"shardtrain/v1/{source.name}") == source.read_bytes()
        (metadata,) = (name for name in names if name.endswith(".dist-info/METADATA"))
        described = archive.read(metadata).decode()
    assert {f"{package}/py.typed" for package in PACKAGES} <= names
    assert "License-Expression: Apache-2.0" in described and "Project-URL: Source, " in described
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    pinned = [line for line in described.splitlines()
              if line.startswith("Requires-Dist:") and "==" in line.split(";")[0]]
    assert not pinned, f"runtime dependencies are ranges; exact versions belong in constraints.txt: {pinned}"


def test_the_wheel_installs_into_a_fresh_environment_and_runs(distributions, tmp_path):
    """A fresh venv gets torch and the rest from wherever this machine's pip finds them (CI's own sources), at
    the versions constraints.txt pins, and `shardtrain` works there without the checkout on the path."""
    _, wheel = distributions
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    python = str(venv / "bin" / "python")
    installed = subprocess.run([python, "-m", "pip", "install", "--no-compile", "-q", "-c", str(ROOT / "constraints.txt"),
                                str(wheel)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    said = installed.stdout + installed.stderr
    if installed.returncode != 0 and any(sign in said for sign in UNREACHABLE):
        pytest.skip(f"pip cannot reach the dependencies from here: {said.strip()[-300:]}")
    assert installed.returncode == 0, said[-3000:]
    checked = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, env=env, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    imported = subprocess.run([python, "-c", "import client_sdk, coordinator, shard_service, shardtrain.v1.shard_pb2_grpc"
                               "; print(client_sdk.__file__)"], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=120)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert str(venv) in imported.stdout, f"imported from outside the fresh environment: {imported.stdout}"
    version = subprocess.run([str(venv / "bin" / "shardtrain"), "--version"], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == "shardtrain 0.1.0", version.stdout + version.stderr
    usage = subprocess.run([str(venv / "bin" / "shardtrain"), "health", "--help"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=120)
    assert usage.returncode == 0 and "health" in usage.stdout, usage.stdout + usage.stderr
