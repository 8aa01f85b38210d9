"""Regenerate the Python gRPC stubs in specedge/v1/ from protos/.

    python protos/generate.py            # rewrite specedge/v1/*_pb2*.py
    python protos/generate.py --out DIR  # write them under DIR instead (the test compares)

The stubs are committed so that an edge install needs no protoc; the test
tests/test_protos.py fails when they drift from the .proto.
"""

import argparse
import pathlib
import sys

from grpc_tools import protoc

PROTOS = pathlib.Path(__file__).resolve().parent
REPO = PROTOS.parent


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(PROTOS.glob("specedge/v*/*.proto"))
    for source in sources:
        args = [
            "protoc",
            f"-I{PROTOS}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(source.relative_to(PROTOS)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {source}")
    return sorted((out_dir / "specedge").glob("v*/*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO)
    written = generate(parser.parse_args().out)
    print("\n".join(str(p) for p in written), file=sys.stderr)


if __name__ == "__main__":
    main()
