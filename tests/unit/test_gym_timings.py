"""The slowest participant per instance and operation, scoped to the snapshot that records it."""

from __future__ import annotations

import asyncio

from checkpoint_coordinator.gym.timings import SlowestCalls, record_call, recording


def test_the_longest_call_of_each_operation_wins_per_instance() -> None:
    rec = SlowestCalls()
    with recording(rec):
        record_call("i1", "commit", "agent", 0.2)
        record_call("i1", "commit", "model", 0.5)
        record_call("i1", "commit", "resources", 0.1)
        record_call("i1", "prepare", "agent", 0.05)
        record_call("i2", "commit", "agent", 0.9)
    assert rec.of_instance("i1") == {
        "commit": {"participant": "model", "seconds": 0.5},
        "prepare": {"participant": "agent", "seconds": 0.05},
    }
    assert rec.of_instance("i2") == {"commit": {"participant": "agent", "seconds": 0.9}}
    assert rec.of_instance("i3") == {}


def test_calls_outside_a_recording_and_in_another_recording_are_not_mixed() -> None:
    a, b = SlowestCalls(), SlowestCalls()
    record_call("i1", "commit", "agent", 1.0)  # no snapshot drives it: dropped

    async def call(server: str, seconds: float) -> None:
        await asyncio.sleep(0)
        record_call("i1", "commit", server, seconds)

    async def fan_out(rec: SlowestCalls, server: str) -> None:
        with recording(rec):
            # Tasks of one fan-out copy the context, and so share the recorder.
            await asyncio.gather(*(asyncio.create_task(call(f"{server}{k}", k / 10)) for k in range(3)))

    async def main() -> None:
        await asyncio.gather(fan_out(a, "a"), fan_out(b, "b"))

    asyncio.run(main())
    assert a.of_instance("i1") == {"commit": {"participant": "a2", "seconds": 0.2}}
    assert b.of_instance("i1") == {"commit": {"participant": "b2", "seconds": 0.2}}
