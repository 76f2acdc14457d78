"""``las``: program-level least attained service (Autellix's PLAS, applied to rollout trajectories).

When the engine has more requests than it can batch, the next turn of the trajectory that has so far received
the least decode service (generated tokens over all its turns) runs first. Short episodes are not stuck
behind long ones, so a batch's cheap trajectories finish (and free their tools and memory) early, while a
long trajectory is delayed by at most the service the others still need. Where every request fits in the
batch (engine ``max_running`` ≥ live trajectories) the order does not matter and this policy changes nothing.

Priority: higher runs first, so a trajectory's priority is minus its generated tokens. Combined with other
policies the priorities are summed (``CompositePolicy``).

Risk class R1: only the order of admission changes; with the batch-invariant engine a request's tokens do not
depend on which others share its steps.
"""

from __future__ import annotations

from rollopt.schedulers.base import Policy, RiskClass, RolloutView


class LeastAttainedServicePolicy(Policy):
    name = "las"
    risk_class = RiskClass.R1

    def priority(self, view: RolloutView, tid: str) -> int:
        return -view[tid].generated_tokens
