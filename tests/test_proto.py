"""The committed generated code must equal a fresh generation from the `.proto` files."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmavg.proto import generate

PROTO_DIR = Path(generate.__file__).resolve().parent


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="regeneration needs the dev extra (grpcio-tools)")
    fresh = {p.name: p.read_bytes() for p in generate.generate(tmp_path)}
    committed = {
        p.name: p.read_bytes()
        for pattern in ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
        for p in PROTO_DIR.glob(pattern)
    }
    assert sorted(fresh) == sorted(committed), "generated files differ from the committed set"
    stale = [name for name, data in fresh.items() if committed[name] != data]
    assert not stale, f"regenerate with `python -m swarmavg.proto.generate`: {stale} are stale"


def test_every_proto_declares_v1_package() -> None:
    for proto in PROTO_DIR.glob("*.proto"):
        assert "package swarmavg.v1;" in proto.read_text(), proto.name


def test_generated_imports_resolve_in_namespace() -> None:
    from swarmavg.proto import common_pb2, tensor_pb2

    chunk = tensor_pb2.TensorChunk(codec="none", dtype=tensor_pb2.FLOAT32, shape=[2, 3])
    assert tensor_pb2.TensorChunk.FromString(chunk.SerializeToString()) == chunk
    assert common_pb2.RequestHeader(run_id="r").run_id == "r"
