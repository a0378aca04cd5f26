"""A loop that waits on an event with a timeout must stop when cancelled, even when the
cancellation and the event's setting arrive together (``asyncio.wait_for`` on Python 3.11
swallowed that cancellation, and a shutdown then waited for the loop forever)."""

from __future__ import annotations

import asyncio

from checkpoint_coordinator.snapshots.pending import wait_event


def test_a_cancel_that_arrives_as_the_event_is_set_stops_the_loop() -> None:
    async def main() -> int:
        event = asyncio.Event()
        rounds = 0

        async def loop() -> None:
            nonlocal rounds
            while True:
                await wait_event(event, 10.0)
                event.clear()
                rounds += 1

        stuck = 0
        for _ in range(200):
            task = asyncio.create_task(loop())
            await asyncio.sleep(0)  # the loop waits on the event
            event.set()  # the waiter is woken ...
            task.cancel()  # ... and cancelled in the same turn of the event loop
            try:
                async with asyncio.timeout(1.0):
                    await task
            except asyncio.CancelledError:
                pass
            except TimeoutError:
                stuck += 1
                task.cancel()
        return stuck

    assert asyncio.run(main()) == 0


def test_it_returns_on_the_event_or_the_timeout() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        t0 = loop.time()
        await wait_event(event, 0.05)
        timed_out = loop.time() - t0
        loop.call_later(0.01, event.set)
        t1 = loop.time()
        await wait_event(event, 30.0)
        return timed_out, loop.time() - t1

    timed_out, woken = asyncio.run(main())
    assert timed_out >= 0.05 and woken < 30.0
