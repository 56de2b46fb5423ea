"""LocalCombiner: one contribution per key for the local callers of a window."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from swarmavg.averaging.request import RoundRequest
from swarmavg.averaging.result import AveragingResult
from swarmavg.peer.client.errors import DaemonUnavailableError, ValidationError
from swarmavg.peer.daemon.combiner import LocalCombiner, combine

pytestmark = pytest.mark.timeout(20)


def params(key: str = "k", weight: float = 1.0, timeout: float = 5.0) -> RoundRequest:
    return RoundRequest.build(key=key, weight=weight, timeout=timeout, min_group_size=1)


class Recorder:
    """A round function that records its calls; optionally blocks until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[np.ndarray], RoundRequest]] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.block = False
        self.fail: Exception | None = None

    async def __call__(self, arrays: list[np.ndarray], p: RoundRequest) -> AveragingResult:
        self.calls.append((arrays, p))
        self.entered.set()
        if self.block:
            await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return AveragingResult(
            tensors=arrays, group_size=1, peers=["me"], group_id="g", codec="none", partial=False
        )


def test_combine_is_the_weighted_mean_in_the_input_dtype() -> None:
    a = [np.array([1.0, 2.0], np.float16), np.array([0.0], np.float64)]
    b = [np.array([3.0, 6.0], np.float16), np.array([4.0], np.float64)]
    out = combine([a, b], [1.0, 3.0])
    assert out[0].dtype == np.float16
    np.testing.assert_array_equal(out[0], [2.5, 5.0])
    assert out[1].dtype == np.float64
    np.testing.assert_array_equal(out[1], [3.0])


async def test_same_key_in_the_window_is_one_round() -> None:
    rec = Recorder()
    combiner = LocalCombiner(rec, window=0.2)
    x = [np.ones(3, np.float32)]
    y = [np.full(3, 4.0, np.float32)]
    r1, r2, r3 = await asyncio.gather(
        combiner.submit(x, params(weight=1.0), "gpu0"),
        combiner.submit(y, params(weight=2.0), "gpu1"),
        combiner.submit(x, params(key="other"), "gpu0"),
    )
    assert len(rec.calls) == 2
    by_key = {p.key: (arrays, p) for arrays, p in rec.calls}
    arrays, p = by_key["k"]
    assert p.weight == 3.0
    np.testing.assert_array_equal(arrays[0], [3.0, 3.0, 3.0])
    assert r1 is r2
    assert r1.local_callers == 2
    assert r3.local_callers == 1
    await combiner.close()


async def test_layout_mismatch_is_rejected_for_the_joiner_only() -> None:
    rec = Recorder()
    combiner = LocalCombiner(rec, window=0.2)
    first = asyncio.ensure_future(combiner.submit([np.ones(3, np.float32)], params()))
    await asyncio.sleep(0)
    with pytest.raises(ValidationError, match="differ"):
        await combiner.submit([np.ones(4, np.float32)], params())
    assert (await first).local_callers == 1
    await combiner.close()


async def test_a_caller_that_leaves_during_the_window_is_dropped() -> None:
    rec = Recorder()
    combiner = LocalCombiner(rec, window=0.2)
    leaving = asyncio.ensure_future(combiner.submit([np.ones(2, np.float32)], params(weight=5)))
    staying = asyncio.ensure_future(combiner.submit([np.zeros(2, np.float32)], params(weight=1)))
    await asyncio.sleep(0)
    leaving.cancel()
    result = await staying
    assert result.local_callers == 1
    np.testing.assert_array_equal(rec.calls[0][0][0], [0.0, 0.0])
    await combiner.close()


async def test_round_errors_reach_every_caller_and_close_fails_waiters() -> None:
    rec = Recorder()
    rec.fail = RuntimeError("boom")
    combiner = LocalCombiner(rec, window=0.0)
    results = await asyncio.gather(
        combiner.submit([np.ones(1, np.float32)], params()),
        combiner.submit([np.ones(1, np.float32)], params()),
        return_exceptions=True,
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    assert len(rec.calls) == 1
    rec.fail = None
    rec.block = True
    rec.entered.clear()
    pending = asyncio.ensure_future(combiner.submit([np.ones(1, np.float32)], params()))
    await rec.entered.wait()  # the round is under way
    await combiner.close()
    with pytest.raises(DaemonUnavailableError):
        await pending
    with pytest.raises(DaemonUnavailableError):
        await combiner.submit([np.ones(1, np.float32)], params())


async def test_known_callers_close_the_batch_without_waiting_the_window() -> None:
    rec = Recorder()
    combiner = LocalCombiner(rec, window=30.0)  # a test timeout if anything waited for it
    combiner._known = {"gpu0": None, "gpu1": None}  # both have called before
    combiner._recent_sizes.append(2)  # and the last batch held both
    x = [np.ones(2, np.float32)]
    first = asyncio.ensure_future(combiner.submit(x, params(), "gpu0"))
    await asyncio.sleep(0)
    assert not first.done()  # waits for gpu1, which has been seen before
    second = await combiner.submit(x, params(), "gpu1")
    assert second.local_callers == 2
    assert (await first) is second
    # gpu1 stops: the next batches wait the window until the history forgets it
    combiner._window = 0.05
    for step in range(LocalCombiner.HISTORY):
        assert combiner.expected_callers() == 2
        alone = await combiner.submit(x, params(key=f"solo{step}"), "gpu0")
        assert alone.local_callers == 1
    assert combiner.expected_callers() == 1
    combiner._window = 30.0
    assert (await combiner.submit(x, params(key="fast"), "gpu0")).local_callers == 1
    await combiner.close()


async def test_a_first_call_waits_the_window_for_the_others() -> None:
    rec = Recorder()
    combiner = LocalCombiner(rec, window=0.3)
    x = [np.ones(2, np.float32)]
    first = asyncio.ensure_future(combiner.submit(x, params(), "new0"))
    await asyncio.sleep(0.05)
    assert not first.done()
    second = await combiner.submit(x, params(), "new1")
    assert second.local_callers == 2
    assert len(rec.calls) == 1
    await combiner.close()


async def test_a_batch_takes_the_earliest_deadline_and_the_summed_weight() -> None:
    rec = Recorder()
    combiner = LocalCombiner(rec, window=0.2)
    x = [np.ones(2, np.float32)]
    early = RoundRequest.build(key="k", weight=1.0, timeout=3.0, min_group_size=1)
    late = RoundRequest.build(key="k", weight=2.0, timeout=9.0, min_group_size=1)
    await asyncio.gather(combiner.submit(x, late, "gpu0"), combiner.submit(x, early, "gpu1"))
    ((_, request),) = rec.calls
    assert request.deadline == early.deadline
    assert request.weight == 3.0


async def test_a_caller_whose_inputs_fail_their_check_is_left_out_of_the_batch() -> None:
    """Inputs still being checked when the batch closes: a batch of several callers waits
    for every check, and a caller whose tensors failed gets that error alone."""
    from swarmavg.averaging.errors import InvalidTensorsError

    rec = Recorder()
    combiner = LocalCombiner(rec, window=0.2)
    loop = asyncio.get_running_loop()
    good: asyncio.Future[object] = loop.create_future()
    bad: asyncio.Future[object] = loop.create_future()
    calls = asyncio.gather(
        combiner.submit([np.ones(3, np.float32)], params(weight=1.0), "a", inputs_ready=good),
        combiner.submit([np.zeros(3, np.float32)], params(weight=1.0), "b", inputs_ready=bad),
        return_exceptions=True,
    )
    await asyncio.sleep(0)
    good.set_result(None)
    bad.set_exception(InvalidTensorsError("tensor 0 holds 1 NaN/Inf value(s)"))
    ok, refused = await calls
    assert isinstance(refused, InvalidTensorsError)
    assert isinstance(ok, AveragingResult)
    assert ok.local_callers == 1
    [(arrays, p)] = rec.calls
    np.testing.assert_array_equal(arrays[0], [1.0, 1.0, 1.0])  # b's zeros are not in it
    assert p.weight == 1.0
    await combiner.close()


async def test_inputs_only_their_client_checked_are_checked_before_a_batch_combines_them() -> None:
    """A shared-memory caller's client checked its tensors (AverageStart.inputs_checked):
    alone, the round checks them chunk by chunk; in a batch they are checked before they
    are combined, and a caller whose client lied is left out alone."""
    from swarmavg.averaging.errors import InvalidTensorsError

    rec = Recorder()
    combiner = LocalCombiner(rec, window=0.2)
    nan = np.array([0.0, np.nan, 0.0], np.float32)
    ok, refused = await asyncio.gather(
        combiner.submit([np.ones(3, np.float32)], params(weight=1.0), "a", checked_by_client=True),
        combiner.submit([nan], params(weight=1.0), "b", checked_by_client=True),
        return_exceptions=True,
    )
    assert isinstance(refused, InvalidTensorsError), refused
    assert "tensor 0 holds 1 NaN/Inf" in str(refused)
    assert isinstance(ok, AveragingResult), ok
    assert ok.local_callers == 1
    [(arrays, p)] = rec.calls
    np.testing.assert_array_equal(arrays[0], [1.0, 1.0, 1.0])
    assert p.weight == 1.0
    await combiner.close()


async def test_a_lone_caller_hands_its_clients_check_on_to_the_round() -> None:
    seen: list[bool] = []

    async def average(
        arrays: list[np.ndarray],
        p: RoundRequest,
        *,
        out: list[np.ndarray] | None = None,
        inputs_ready: object = None,
        checked_by_client: bool = False,
    ) -> AveragingResult:
        seen.append(checked_by_client)
        return AveragingResult(
            tensors=arrays, group_size=1, peers=["me"], group_id="g", codec="none", partial=False
        )

    combiner = LocalCombiner(average, window=0.0)
    x = [np.array([np.nan], np.float32)]  # not checked here: the round checks it
    await combiner.submit(x, params(), "a", checked_by_client=True)
    await combiner.submit([np.ones(1, np.float32)], params(), "a")
    assert seen == [True, False]
    await combiner.close()
