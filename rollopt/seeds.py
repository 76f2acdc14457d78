"""How every seed is derived from a run's seed: one place, so two streams never collide by accident.

A request's sampling seed is ``episode seed + TURN·turn + SEGMENT·segment`` (a preempted or failed-over turn
resumes as a new segment with a new seed); an episode's seed is ``step seed·SAMPLE + i·G + j`` for sample ``j``
of task ``i`` (:func:`rollopt.episodes.episode_specs`), and a fork's branch ``b`` adds ``BRANCH·b``. The
trainer's step ``k`` uses ``run seed·STEP + k`` for its tasks and sampling, and evaluation ``EVAL + run seed``
(a stream no training step reaches). The strides are primes or powers of ten far apart, so the streams of
realistic runs (fewer than 10⁶ trajectories a step, 10³ turns) never overlap.
"""

TURN = 7919
SEGMENT = 104729
SAMPLE = 1_000_000
BRANCH = 1_000_003
STEP = 1_000_003
EVAL = 7_777_777


def request_seed(episode_seed: int | None, turn: int, segment: int) -> int | None:
    """The sampling seed of one engine request (None: unseeded)."""
    return None if episode_seed is None else episode_seed + TURN * turn + SEGMENT * segment


def step_seed(run_seed: int, step: int) -> int:
    return run_seed * STEP + step
