"""The committed gRPC stubs are exactly what protos/ generates."""

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", REPO / "protos" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    written = generate.generate(tmp_path)
    assert written, "protoc produced nothing"
    for fresh in written:
        committed = REPO / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run python protos/generate.py"
        assert committed.read_bytes() == fresh.read_bytes(), f"{committed} is stale: run python protos/generate.py"
