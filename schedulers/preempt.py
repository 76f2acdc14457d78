"""``preempt``: long-tail handling by over-provisioning and abort-and-resume (slime/APRIL partial rollout).

The batch is given more groups than it must return (``target_groups``). As soon as ``target_groups`` groups
are complete, or once the batch has generated ``token_budget`` tokens, every straggler is aborted. An aborted
trajectory keeps every token and logprob it has (the engine returns the partial output) and is carried over
to the next batch, where it resumes from exactly those tokens, possibly under a newer weight version (each
token records the version that sampled it). A trajectory already carried over ``max_carry_age`` times is
never preempted again, so none starves.

Risk class R3: resumed tokens may be sampled by newer weights than the trajectory's earlier tokens; the
trainer corrects with the recorded per-token versions and logprobs.
"""

from __future__ import annotations

from rollopt.schedulers.base import Policy, RiskClass, RolloutView, Stage


class PreemptPolicy(Policy):
    name = "preempt"
    risk_class = RiskClass.R3

    def __init__(self, max_carry_age: int = 1, token_budget: int | None = None) -> None:
        if max_carry_age < 0:
            raise ValueError("max_carry_age must be >= 0")
        self.max_carry_age = max_carry_age
        self.token_budget = token_budget

    def preempt(self, view: RolloutView) -> set[str]:
        quota_met = view.target_groups is not None and view.num_complete_groups >= view.target_groups
        over_budget = self.token_budget is not None and view.generated_tokens >= self.token_budget
        if not (quota_met or over_budget):
            return set()
        complete = set(view.complete_groups())
        return {
            t.id for t in view.trajectories
            if t.live and t.stage is not Stage.PREEMPTED and t.group_id not in complete
            and t.carry_age < self.max_carry_age
        }
