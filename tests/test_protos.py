"""The committed Python stubs are exactly what `python protos/generate.py` makes from the .proto files."""

from __future__ import annotations

import filecmp
import pathlib
import subprocess
import sys

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
