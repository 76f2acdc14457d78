"""``lpf``: longest predicted first — the GRPO group's siblings predict how long a trajectory will run, and the
work predicted longest starts first (Seer's context-aware scheduling, arXiv 2511.14617, on rollout trajectories).

Per-trajectory async (``async``, verl's AgentLoop) sends every trajectory at once; the engine runs
``max_running`` of them and queues the rest in arrival order. Which ones wait is luck: when a long trajectory
waits behind short ones, it starts late and runs alone at the end of the step, with the engine nearly idle (the
tail that makes the last 10% of requests take half the rollout time in Seer's traces). Members of one group answer
the same prompt, so their lengths are correlated; this policy uses that, without changing a token:

* **Probes first.** The first member of every group that has none started goes before any other waiting
  trajectory (one probe per group, in batch order), so every group soon has a member whose progress measures it.
* **Then the longest group first.** A group's predicted length is the most tokens any started member has
  generated so far, finished or still running (a probe still decoding after 5k tokens says more than one that
  finished at 500). The waiting members of the group predicted longest start first; ties in batch order.
* **Holding back, only as far as the engine would.** Trajectories that have not started wait at their gate only
  while the engine's batch is full (:attr:`RolloutView.generating` ≥ :attr:`RolloutView.max_running`): the policy
  decides who fills a free row instead of the engine's arrival order. A started trajectory is never held (its next
  turn goes to the engine at once). On an engine that reports no ``max_running`` it is ``async``.

The ranking is recomputed from the snapshot at most every ``refresh_s`` seconds of the rollout's clock, when a
waiting trajectory asks and a row is free (an O(trajectories) pass); between refreshes each admission costs O(1).
A fresher ranking changes which of two nearly equal groups goes first, not the rule.

**Where it pays and where it cannot** (README, *Length-aware scheduling*): where more trajectories are sent than the
engine runs at once and a group's members share part of their length. The simulated single-turn reasoning workload
(H200, Llama-3.1-8B shape, 256 rows a server): 1,024 on one server 1.03× over ``async`` (286.8 s against 296.5 s),
4,096 on 8 servers 1.10× [1.04–1.13] (197.4 s against 217.5 s); the real embedded engine (256 answers, 16 rows): a
tie, 1.02× [0.95–1.07]. The lower bound there is the longest answer decoded alone, and in a full batch it runs longer
whatever the start order. Where every trajectory fits the batch (``max_running`` ≥ live trajectories) there is no
queue and nothing to order: it is ``async``. It does not manage KV (the software-engineering agent at 1,024 thrashes
as under ``async``: 1.01×), and it admits in its own order, so it does not combine with ``kv`` (or ``auto``), which
admits in batch order by KV.

Risk class R1: only the order in which trajectories start changes; a request's tokens do not depend on when it
runs or beside which others (batch-invariant engine; ``rollopt validate`` checks greedy token parity).
"""

from __future__ import annotations

from typing import Collection, Iterable

from rollopt.schedulers.base import Policy, RiskClass, RolloutView


class LongestPredictedFirstPolicy(Policy):
    name = "lpf"
    risk_class = RiskClass.R1

    def __init__(self, refresh_s: float = 1.0) -> None:
        if not refresh_s >= 0:
            raise ValueError(f"refresh_s must be >= 0, got {refresh_s}")
        self.refresh_s = refresh_s
        self._ranking: list[str] = []  # trajectories not started at the last ranking, best first
        self._next = 0  # the first entry of ``_ranking`` that may still be waiting
        self._ranked_at: float | None = None
        self._batch: tuple[str, ...] | None = None  # the group order of the batch ranked (a new batch ranks anew)

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        if view.max_running is None or view[tid].started:
            return True
        return view.generating < view.max_running and self._head(view) == tid

    def admission_candidates(self, view: RolloutView, not_started: Collection[str]) -> Iterable[str]:
        """Only the head of the ranking, and only while the engine has a free row (amortized O(1))."""
        if view.max_running is None:
            return not_started
        if view.generating >= view.max_running:
            return ()
        head = self._head(view)
        return (head,) if head is not None and head in not_started else ()

    def predicted_tokens(self, view: RolloutView) -> dict[str, int]:
        """Each group's predicted length: the most tokens any of its started members has generated (O(n))."""
        longest: dict[str, int] = {}
        for t in view.trajectories:
            if t.started:
                longest[t.group_id] = max(longest.get(t.group_id, 0), t.generated_tokens)
        return longest

    def ranking(self, view: RolloutView) -> list[str]:
        """The trajectories not started, in the order they should start: one probe of each group with no member
        started (batch order), then the rest by their group's predicted length, longest first (then batch order)."""
        longest = self.predicted_tokens(view)
        probed: set[str] = set()
        keyed = []
        for position, t in enumerate(view.trajectories):
            if not t.live or t.started:
                continue
            if t.group_id not in longest and t.group_id not in probed:
                probed.add(t.group_id)
                keyed.append(((0, 0, position), t.id))
            else:
                keyed.append(((1, -longest.get(t.group_id, 0), position), t.id))
        return [tid for _, tid in sorted(keyed)]

    def _head(self, view: RolloutView) -> str | None:
        """The first trajectory of the ranking that has not started (re-ranked when ``refresh_s`` has passed, the
        batch is new, or the ranking ran out)."""
        stale = (self._ranked_at is None or self._batch is not view.group_order
                 or view.now - self._ranked_at >= self.refresh_s)
        for _ in range(2):
            if stale:
                self._ranking, self._next = self.ranking(view), 0
                self._ranked_at, self._batch = view.now, view.group_order
            while self._next < len(self._ranking):
                tid = self._ranking[self._next]
                if tid in view and view[tid].live and not view[tid].started:
                    return tid
                self._next += 1
            stale = True  # ran out: trajectories added since (forks) are ranked once more
        return None
