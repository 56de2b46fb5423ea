"""ChannelPool: caching, idle close and close()."""

from __future__ import annotations

import time

import pytest

from swarmavg.dht.channels import ChannelPool


async def test_channel_is_cached_and_closed() -> None:
    pool = ChannelPool()
    a = pool.channel("127.0.0.1:1")
    assert pool.channel("127.0.0.1:1") is a
    assert pool.channel("127.0.0.1:2") is not a
    assert len(pool) == 2
    await pool.close()
    await pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.channel("127.0.0.1:1")


async def test_idle_channels_are_closed() -> None:
    pool = ChannelPool(idle_timeout=30.0)
    try:
        pool.channel("127.0.0.1:1")
        assert pool.close_idle() == []
        assert "127.0.0.1:1" in pool
        pool.channel("127.0.0.1:2")
        assert sorted(pool.close_idle(time.monotonic() + 31)) == ["127.0.0.1:1", "127.0.0.1:2"]
        assert "127.0.0.1:1" not in pool
        # a fresh channel is opened on the next use
        pool.channel("127.0.0.1:1")
        assert "127.0.0.1:1" in pool
    finally:
        await pool.close()


def test_rejects_bad_timeout() -> None:
    with pytest.raises(ValueError, match="idle_timeout"):
        ChannelPool(idle_timeout=0)
