"""The daemon's allocator keeps what a round frees (swarmavg.peer.daemon.heap)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from swarmavg.peer.daemon.heap import USER_SETTINGS, glibc_version, keep_freed_memory

needs_glibc = pytest.mark.skipif(glibc_version() is None, reason="not glibc")

# A round's allocation pattern in miniature: a dozen 2 MiB chunk bodies alive at once, all
# freed, again; the page faults of the repeats are counted (the first pass may fault).
_ROUNDS = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    from swarmavg.peer.daemon.heap import keep_freed_memory

    applied = keep_freed_memory() if sys.argv[1] == "on" else False

    def one_round():
        bodies = [np.empty(2 << 20, np.uint8) for _ in range(12)]
        for body in bodies:
            body[::4096] = 1  # what recv does: touch every page

    one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        one_round()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"applied": applied, "faults": faults}))
    """
)


def _faults(mode: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, int] = json.loads(done.stdout)
    return answer


@needs_glibc
def test_freed_round_memory_is_reused_without_page_faults() -> None:
    before, after = _faults("off"), _faults("on")
    assert after["applied"]
    # 20 rounds x 24 MiB: without the thresholds glibc hands the freed bodies back every
    # round and faults all ~120,000 pages in again; with them, none come back.
    assert before["faults"] > 20 * 12 * 512 // 2
    assert after["faults"] < before["faults"] // 20


@pytest.mark.parametrize("name", USER_SETTINGS)
def test_the_users_own_glibc_settings_win(name: str) -> None:
    assert keep_freed_memory({name: "131072"}) is False


def test_glibc_version_is_a_version_or_none() -> None:
    version = glibc_version()
    assert version is None or version.split(".")[0].isdigit()
