"""The baseline tree of issue 16's authentication A/B: this code with signatures' cryptography off.

Makes a git worktree of ``--commit`` at ``--out`` and changes two lines of its
``dht/identity.py``: ``Identity.sign`` returns 64 zero bytes and ``verify_signature`` accepts
any signature of the right length. Everything else (headers, nonces, digests, the replay
cache, signed records' bookkeeping) runs as in the real code, so an A/B against it with
``benchmarks/auth_ab.py`` measures what the Ed25519 signatures and verifications cost a
round. The compiled kernel is copied from this checkout. Never run such a tree outside a
benchmark: it accepts forged messages. Prints ONE JSON line.

    python benchmarks/noauth_tree.py --out ../noauth
    python benchmarks/auth_ab.py --before ../noauth --peers 4,8 --rounds 5 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATCHES = (
    (
        "        return False\n    try:\n"
        "        _public_key(public_key).verify(payload, signature)",
        "        return False\n    return True  # A/B baseline: signatures' cryptography off\n"
        "    try:\n        _public_key(public_key).verify(payload, signature)",
    ),
    (
        "        return self._signing_key.sign(payload).signature",
        "        return bytes(SIGNATURE_BYTES)  # A/B baseline: signatures' cryptography off",
    ),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the worktree goes (must not exist)")
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(out), args.commit],
        check=True,
        capture_output=True,
    )
    identity = out / "dht" / "identity.py"
    text = identity.read_text()
    for old, new in PATCHES:
        if text.count(old) != 1:
            raise SystemExit(f"{identity}: the code to patch changed; update {__file__}")
        text = text.replace(old, new)
    identity.write_text(text)
    kernels = sorted((ROOT / "compression").glob("_native*.so"))
    for kernel in kernels:
        shutil.copy2(kernel, out / "compression" / kernel.name)
    print(json.dumps({"benchmark": "noauth_tree", "tree": str(out), "kernels": len(kernels)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
