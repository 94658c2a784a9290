"""The suite's Node.js tools (tests/node): installed from their lockfile on first use."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

NODE_DIR = pathlib.Path(__file__).resolve().parent / "node"


def node_tools() -> pathlib.Path:
    """tests/node with its packages installed (npm ci, the first time); skips where Node.js is missing."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("needs Node.js and npm")
    if not (NODE_DIR / "node_modules" / ".bin" / "buf").exists() or \
            not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, capture_output=True,
                       timeout=600)
    return NODE_DIR
