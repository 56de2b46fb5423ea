"""TaskSet (owned background tasks) and bounded_step (one step of a shutdown)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from swarmavg.dht.tasks import TaskSet, bounded_step


async def test_close_cancels_and_awaits_every_task() -> None:
    tasks = TaskSet()
    cleaned: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits still runs to its end
            cleaned.append(name)

    spawned = [tasks.spawn(forever(n), name=n) for n in ("a", "b", "c")]
    await asyncio.sleep(0)
    assert len(tasks) == 3
    assert {t.get_name() for t in tasks} == {"a", "b", "c"}
    await tasks.close()
    assert all(t.cancelled() for t in spawned)
    assert sorted(cleaned) == ["a", "b", "c"]
    assert len(tasks) == 0


async def test_finished_tasks_leave_the_set_and_return_their_result() -> None:
    tasks = TaskSet()

    async def answer() -> int:
        return 42

    task = tasks.spawn(answer())
    assert await task == 42
    await asyncio.sleep(0)  # the done callback runs one loop step later
    assert len(tasks) == 0
    assert not tasks


async def test_a_failed_task_is_logged_not_swallowed(caplog: pytest.LogCaptureFixture) -> None:
    tasks = TaskSet()

    async def broken() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="swarmavg.dht.tasks"):
        task = tasks.spawn(broken(), name="broken-one")
        await asyncio.wait([task])
        await asyncio.sleep(0)
        await tasks.close()  # a failure is not raised again by close
    [record] = [r for r in caplog.records if r.name == "swarmavg.dht.tasks"]
    assert "broken-one" in record.getMessage()
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)
    assert len(tasks) == 0


async def test_a_cancelled_task_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    tasks = TaskSet()
    with caplog.at_level(logging.DEBUG, logger="swarmavg.dht.tasks"):
        tasks.spawn(asyncio.Event().wait())
        await asyncio.sleep(0)
        tasks.cancel()
        await tasks.close()
    assert not [r for r in caplog.records if r.name == "swarmavg.dht.tasks"]


async def test_close_is_idempotent_and_the_set_stays_usable() -> None:
    tasks = TaskSet()
    await tasks.close()  # empty
    first = tasks.spawn(asyncio.sleep(10))
    await tasks.close()
    await tasks.close()
    assert first.cancelled()
    second = tasks.spawn(asyncio.sleep(10))  # a later task is closed by the next close
    await asyncio.sleep(0)
    assert len(tasks) == 1
    await tasks.close()
    assert second.cancelled()


async def test_close_also_cancels_tasks_spawned_while_closing() -> None:
    tasks = TaskSet()
    late: list[asyncio.Task[None]] = []

    async def spawns_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            late.append(tasks.spawn(asyncio.Event().wait()))

    tasks.spawn(spawns_on_cancel())
    await asyncio.sleep(0)
    async with asyncio.timeout(5.0):
        await tasks.close()
    assert late
    assert late[0].cancelled()
    assert len(tasks) == 0


async def test_cancelling_the_closer_is_not_swallowed() -> None:
    tasks = TaskSet()
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()  # cleanup that takes a while

    child = tasks.spawn(slow_to_stop())
    await asyncio.sleep(0)
    closer = asyncio.get_running_loop().create_task(tasks.close())
    await asyncio.sleep(0.01)
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    assert not child.done()  # still finishing its cleanup, and still owned by the set
    release.set()
    await tasks.close()
    assert child.cancelled()


async def test_join_waits_without_cancelling() -> None:
    tasks = TaskSet()
    done: list[int] = []

    async def work(i: int) -> None:
        await asyncio.sleep(0.01 * i)
        done.append(i)

    spawned = [tasks.spawn(work(i)) for i in range(3)]
    await tasks.join()
    assert sorted(done) == [0, 1, 2]
    assert not any(t.cancelled() for t in spawned)
    await tasks.join()  # nothing left: returns at once


async def test_bounded_step_logs_a_timeout_and_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken() -> None:
        raise OSError("gone")

    with caplog.at_level(logging.WARNING, logger="swarmavg.dht.tasks"):
        await bounded_step(asyncio.sleep(10), 0.1, "slow step")
        await bounded_step(broken(), 1.0, "broken step")
        await bounded_step(asyncio.sleep(0), 1.0, "quick step")
    messages = [r.getMessage() for r in caplog.records if r.name == "swarmavg.dht.tasks"]
    assert messages == ["slow step did not finish within 0.1 s", "broken step failed"]


async def test_bounded_step_does_not_swallow_cancellation() -> None:
    step = asyncio.get_running_loop().create_task(
        bounded_step(asyncio.Event().wait(), 10.0, "endless step")
    )
    await asyncio.sleep(0.01)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
