"""The committed Python stubs are exactly what `python protos/generate.py` makes from the .proto files."""

from __future__ import annotations

import filecmp
import pathlib
import shutil
import subprocess
import sys

from tests.node_tools import node_tools

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ROOT / "shardtrain" / "v1"


def test_committed_stubs_match_the_protos(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), str(tmp_path)], check=True)
    fresh = sorted(p.name for p in (tmp_path / "shardtrain" / "v1").iterdir())
    committed = sorted(p.name for p in GENERATED.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_grpc.py")))
    assert fresh == committed
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "shardtrain" / "v1", GENERATED, fresh, shallow=False)
    assert not mismatch and not errors, \
        f"stubs drifted from the .proto files; run python protos/generate.py: {mismatch}"


def buf(*args: str, cwd: pathlib.Path = ROOT / "protos") -> subprocess.CompletedProcess:
    return subprocess.run([str(node_tools() / "node_modules" / ".bin" / "buf"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_contract_passes_buf_lint_and_has_no_breaking_change_since_v1():
    """protos/buf.yaml: STANDARD rules, with the exceptions it explains; protos/v1.binpb: the v1 contract that
    every later version must keep on the wire and in JSON."""
    lint = buf("lint")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    breaking = buf("breaking", "--against", "v1.binpb")
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr


def test_buf_breaking_catches_a_renumbered_field(tmp_path):
    changed = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", changed)
    shard = changed / "shardtrain" / "v1" / "tensor.proto"
    shard.write_text(shard.read_text().replace("int64 offset = 3;", "int64 offset = 16;"))
    breaking = buf("breaking", "--against", str(ROOT / "protos" / "v1.binpb"), cwd=changed)
    assert breaking.returncode != 0 and 'field "3" with name "offset" on message "TensorChunk" was deleted' in \
        breaking.stdout, breaking.stdout + breaking.stderr
