"""Regenerates the Python bindings of protos/shardtrain/v1/*.proto into shardtrain/v1/: `python protos/generate.py`."""

import pathlib
import sys

from grpc_tools import protoc

PROTOS = pathlib.Path(__file__).resolve().parent
ROOT = PROTOS.parent  # generated modules land in ROOT/shardtrain/v1, importable as shardtrain.v1


def generate(out_dir: pathlib.Path = ROOT) -> None:
    """Runs protoc with -I protos so generated imports read `from shardtrain.v1 import ...`."""
    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "shardtrain" / "v1").glob("*.proto"))
    include = str(pathlib.Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
