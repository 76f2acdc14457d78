"""What makes a run on the virtual clock repeat exactly: durations on a grid, and a seeded task order.

The simulated engine runs under trio's ``MockClock(autojump_threshold=0)``, which jumps to the next sleeper's
deadline. Two things made the same run give different schedules depending on what ran before it:

* **Task order.** Trio runs each batch of runnable tasks forwards or backwards at random (its scheduler generator
  is seeded by the OS). On the virtual clock many requests arrive at one instant, and the router places a new
  key by the in-flight counts it sees as they come, so ``async`` on the simulated single-turn reasoning workload
  (1,024 trajectories, 8 servers) took 100.93 s or 106.23 s from one process to the next (measured).
  :func:`start_repeatable_run` seeds that generator. Trio also has two ways to order a batch: by default it
  runs the batch as its queue holds it (the order sleepers sharing a deadline wake in follows ``id()`` of their
  cancel scopes: memory addresses) or reversed; once Hypothesis has run a test in the process (its trio plugin sets
  ``trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING``) it sorts the batch by task creation and shuffles it. The
  same seeded run gave 3.45M prefill tokens in a fresh process and 3.98M after any Hypothesis test (measured on
  ``tests/test_kv_policy.py``'s 256 simulated agents: which tests ran earlier decided the result).
  :func:`start_repeatable_run` therefore also switches trio to the sorted order, whatever ran before.
* **Rounding.** A deadline is ``now + seconds`` in floating point, rounded according to ``now``'s magnitude, so
  the same run started at another time saw its events at relative times differing in the last bits (measured:
  a makespan of 95.87074279785156 s against …158 s), enough to split a tie or join two events. Every multiple
  of :data:`TICK_S` (2⁻³⁰ s, about 1 ns) below 2²³ s (97 days) is a float64 and sums of them are exact, so when
  every sleep is :func:`on_grid` (the sim's iterations and pins, the simulated workloads' tools) and the run
  starts on the grid, each event lands at the same relative time whenever the run starts. A tool that sleeps an
  arbitrary duration still runs; only this guarantee is lost.
"""

from __future__ import annotations

import math

import anyio

TICKS_PER_S = 1 << 30
TICK_S = 1 / TICKS_PER_S


def on_grid(seconds: float) -> float:
    """``seconds`` rounded up to a whole number of ticks: a duration the virtual clock adds exactly."""
    return math.ceil(seconds * TICKS_PER_S) / TICKS_PER_S


async def start_repeatable_run(seed: int) -> None:
    """Before a run on the virtual clock: wait for the next tick (so the run starts on the grid even if an
    earlier sleep did not end on it) and make the order in which trio runs the tasks woken at one virtual instant
    a function of ``seed`` (sorted by task creation, then shuffled by the seeded generator: the order Hypothesis's
    trio plugin switches on, independent of memory addresses and of whether a Hypothesis test ran earlier). A no-op
    outside trio (a real engine's clock).

    Seeded, a run whose durations are :func:`on_grid` repeats exactly; different seeds sample the order, a real
    source of spread (arrivals microseconds apart at real servers are as arbitrary). Trio's scheduler generator
    has no public API (trio's own Hypothesis hook seeds it the same way).
    """
    import sniffio

    try:
        if sniffio.current_async_library() != "trio":
            return
    except sniffio.AsyncLibraryNotFoundError:
        return
    from trio._core import _run

    now = anyio.current_time()
    if on_grid(now) != now:
        await anyio.sleep_until(on_grid(now))  # the clock lands on it exactly: now + (tick - now) is exact

    scheduler_random = getattr(_run, "_r", None)
    if scheduler_random is None or not hasattr(_run, "_ALLOW_DETERMINISTIC_SCHEDULING"):
        raise RuntimeError("this trio has no scheduler generator trio._core._run._r to seed or no "
                           "_ALLOW_DETERMINISTIC_SCHEDULING switch: install trio 0.35 "
                           "(the version measured) or update rollopt.engines.virtual_clock.start_repeatable_run")
    _run._ALLOW_DETERMINISTIC_SCHEDULING = True  # what Hypothesis's trio plugin sets; never switched back
    scheduler_random.seed(seed)
