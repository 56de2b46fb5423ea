"""Start-up stays light: ml_dtypes (about 0.7 s of CPU to import, most of a daemon's
start) loads only once bfloat16 is actually needed, importlib.metadata (about 30 ms) only
once the version is asked for, and torch never on the daemon's path. Every check runs in
a fresh interpreter, since this test process has imported ml_dtypes already (other tests'
bfloat16 cases)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable

import ml_dtypes
import msgpack
import numpy as np
import pytest

from swarmavg.averaging.state.format import pack_state
from swarmavg.compression import get_codec

BF16 = np.dtype(ml_dtypes.bfloat16)
VALUES = [1.5, -2.0, 3.25, 0.0078125]  # exact in bfloat16
OFF_THE_START_PATH = ("ml_dtypes", "importlib.metadata", "torch", "sklearn")


def run_fresh(code: str, stdin: bytes = b"") -> dict[str, object]:
    """Run ``code`` in a new interpreter; return the JSON object it prints last."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        input=stdin,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    loaded: dict[str, object] = json.loads(result.stdout.decode().splitlines()[-1])
    return loaded


@pytest.mark.timeout(180)
def test_the_cli_client_and_a_daemons_objects_load_no_module_they_can_do_without() -> None:
    """What ``swarmavg peer`` imports and builds before it binds, and what a training
    process imports for the client; and every registered codec."""
    loaded = run_fresh(
        f"""
        import json, sys
        import swarmavg.peer.cli.main as cli
        import swarmavg.peer
        from swarmavg.compression import CodecInfo, decode_chunk, get_codec, known_codecs
        from swarmavg.peer.daemon.daemon import Peer

        args = cli.build_parser().parse_args(["peer", "--listen", "127.0.0.1:0"])
        peer = Peer(swarmavg.peer.PeerConfig(listen=args.listen))
        x = [1.0, -2.0, 3.0, 0.5] * 64
        import numpy as np
        for name in known_codecs():
            if "<" in name:  # a wrapper's pattern ("lz4+<codec>"), not a codec
                continue
            codec = get_codec(name)
            if name in ("none", "float16", "uint8-blockwise"):  # float32 through a codec
                decode_chunk(codec.encode(np.array(x, np.float32), CodecInfo()))
        print(json.dumps({{m: m in sys.modules for m in {OFF_THE_START_PATH!r}}}))
        """
    )
    assert loaded == dict.fromkeys(OFF_THE_START_PATH, False)


def _wire_message() -> bytes:
    return get_codec("none").encode(np.array(VALUES, BF16)).SerializeToString()


def _state() -> bytes:
    packed = pack_state([np.array(VALUES, BF16)], b"meta", version=1.0)
    m = packed.manifest
    return msgpack.packb(
        {
            "manifest": [m.root, m.version, m.chunk_size, m.header_chunks],
            "hashes": list(m.chunk_hashes),
            "sizes": list(m.chunk_sizes),
            "chunks": packed.chunks,
        }
    )


# What a fresh process does first that needs bfloat16; each prints the dtype it got and
# the values, having checked that ml_dtypes was not loaded before.
BF16_CASES: dict[str, tuple[str, Callable[[], bytes]]] = {
    "wire header naming bfloat16": (
        """
        from swarmavg.compression import decode_chunk
        from swarmavg.proto import tensor_pb2
        out = decode_chunk(tensor_pb2.TensorChunk.FromString(data))
        """,
        _wire_message,
    ),
    "state record naming bfloat16": (
        """
        import msgpack
        from swarmavg.averaging.state.format import Manifest, unpack_state
        s = msgpack.unpackb(data)
        manifest = Manifest(*s["manifest"], tuple(s["hashes"]), tuple(s["sizes"]))
        meta, (out,) = unpack_state(manifest, s["chunks"])
        assert meta == b"meta"
        """,
        _state,
    ),
    "bfloat16 codec on float32": (
        """
        import numpy as np
        from swarmavg.compression import CodecInfo, decode_chunk, get_codec
        message = get_codec("bfloat16").encode(np.array(VALUES, np.float32), CodecInfo())
        out = decode_chunk(message)
        """,
        bytes,
    ),
    "bfloat16 named as a string": (
        """
        import numpy as np
        from swarmavg.compression.dtypes import dtype_to_proto, normalize_dtype
        from swarmavg.proto import tensor_pb2
        assert dtype_to_proto("bfloat16") == tensor_pb2.BFLOAT16
        out = np.array(VALUES, normalize_dtype("bfloat16"))
        """,
        bytes,
    ),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_bfloat16_works_in_a_process_that_never_imported_ml_dtypes(case: str) -> None:
    body, make_input = BF16_CASES[case]
    prefix = f"""
        import json, sys
        data = sys.stdin.buffer.read()
        VALUES = {VALUES!r}
        import swarmavg.peer, swarmavg.compression, swarmavg.averaging.state.format
        before = "ml_dtypes" in sys.modules
        """
    suffix = """
        report = {"before": before, "after": "ml_dtypes" in sys.modules}
        report.update(dtype=out.dtype.name, values=out.astype(float).tolist())
        print(json.dumps(report))
        """
    code = "".join(textwrap.dedent(part) for part in (prefix, body, suffix))
    loaded = run_fresh(code, stdin=make_input())
    expected_dtype = "float32" if case == "bfloat16 codec on float32" else "bfloat16"
    assert loaded == {"before": False, "after": True, "dtype": expected_dtype, "values": VALUES}
