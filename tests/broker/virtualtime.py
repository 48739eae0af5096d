"""An asyncio event loop on virtual time, for tests of timer logic (the group coordinator's session,
rebalance and initial-delay timers) that must not depend on how loaded the machine is.

    run_virtual(main())

The loop's clock stands still while anything is ready to run; when nothing is, it jumps straight to
the next timer instead of sleeping. So ``loop.time()`` differences are exactly the timers' delays,
``asyncio.sleep(0.3)`` lets exactly the timers due within 0.3 s fire, and a test can assert a timing
rule ("the delay was extended once", "bounded by the rebalance timeout") as an equality, however slow
the host. Real I/O and threads still work (they are polled without waiting), but a coroutine waiting
on them would see virtual time race ahead: use it for code that only uses timers.
"""

from __future__ import annotations

import asyncio
import selectors


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


class _JumpingSelector(selectors.BaseSelector):
    """Polls the real selector without blocking; where the loop would block, advances the clock instead."""

    def __init__(self, clock: _Clock) -> None:
        self._clock = clock
        self._real = selectors.DefaultSelector()

    def select(self, timeout=None):
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise RuntimeError("virtual time: nothing scheduled and nothing ready (the test would hang)")
        self._clock.now += timeout
        return []

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_key(self, fileobj):
        return self._real.get_key(fileobj)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual_clock = _Clock()
        super().__init__(_JumpingSelector(self._virtual_clock))

    def time(self) -> float:
        return self._virtual_clock.now


def run_virtual(coro, timeout: float = 300.0):
    """Run ``coro`` to completion on a fresh VirtualTimeLoop; fails after ``timeout`` virtual seconds
    (a hung test ends at once: virtual time runs out in no time)."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(asyncio.wait_for(coro, timeout))
