"""``rollopt validate``: prove that each scheduling policy keeps the learning semantics its risk class promises.

Every check runs the policy and the ``sync`` baseline on the *same* seeded workload (same tasks, same
per-request sampling seeds) on one batch-invariant embedded engine, and compares what a trainer would see.
The workload is :class:`~rollopt.environments.SyntheticEnv`: real decode of a peaked random-init model, planned
tool calls whose latencies vary (so policies really reorder work), observations and a text-dependent reward.

* **R1 token parity** (``token-parity``): greedy decoding; every trajectory's token ids, token kinds and
  reward equal the baseline's, logprobs within ``logprob_tol``. ``statistic`` = fraction of trajectories
  that differ (0 to pass).
* **R2 distribution** (``distribution``): sampling at temperature 1, n ≥ 256 trajectories per side;
  Mann-Whitney U and two-sample KS tests (scipy) on response length, turns, tool calls, reward and mean
  token logprob. ``p_value`` = the smallest over the tests; passes when it is > ``alpha`` (0.01).
  ``statistic`` = the largest KS distance (an effect size in [0, 1]); per-metric results are in ``detail``.
  R1 policies must pass it too (token parity implies it).
* **R3 off-policy** (``off-policy``): several batches with a weight update between them and over-provisioned
  groups, so stragglers carry over and resume under newer weights. Reports the staleness histogram (share
  of tokens per version lag), the engine↔trainer mismatch by staleness bucket (the batch rescored by a
  trainer holding the current weights), and whether the configured correction acts on the stale tokens.
  Passes when every generated token carries a version that the engine really had, versions never decrease
  along a trajectory, no token was lost, and the correction is active (``correction != "none"`` or a
  staleness bound is set). ``statistic`` = share of tokens with lag ≥ 1.
* **Conservation** (``conservation``, every policy: over-provisioning can be combined with any of them):
  ``conservation_steps`` rollout calls as the trainer makes them — a quota of ``conservation_tasks`` groups,
  ``conservation_extra_groups`` more started, new groups only where the carry-over leaves room — on the
  long-tail workload. Passes when (1) conservation is exact: every started trajectory was returned exactly
  once or is in the final carry-over; (2) the carry-over stays bounded (≤ the extra groups, age ≤ 2 calls);
  and (3) what the trainer receives has the distribution of what the policy sampled, and of ``sync`` without
  over-provisioning on the same seeds: Mann-Whitney U and KS tests on response length, turns and reward, each
  p > ``alpha``. With 256 trajectories a side and α = 0.01, Mann-Whitney detects a shift of 0.3 standard
  deviations with power ≈ 0.8; keeping the fastest half of each step (the bug this check was written for)
  shifts length by far more. ``statistic`` = the largest KS distance to the ``sync`` baseline.
* **e2e** (``e2e``, opt-in: ``validate(..., e2e=True)``, ``rollopt validate --e2e``; ~10 s per policy): a short
  training run (``e2e_steps`` GRPO steps on the synthetic environment, the tiny model, invariant prefill) with
  the policy as the rollout scheduler — in ``sync`` loop mode, or ``async`` with ``max_staleness`` 1 for R3
  policies, their intended use — against the same run with the ``sync`` scheduler. ``statistic`` = |mean
  reward over the run − sync's|; passes when it is ≤ ``e2e_tolerance`` (0.1 reward units, rewards lie in
  [0, 1]: about 3 standard errors of the difference of two 8-step means here, where one step's mean reward
  varies by ~0.07). R1 policies in sync mode give the identical curve (statistic 0); ``preempt`` in async mode
  measured 0.04 and 0.07 in two runs. The policy is built by name, so it must be registered.

A policy with no risk class fails with check ``risk-class``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncContextManager, Callable, Sequence

import numpy as np
import torch

from rollopt.engines.base import SamplingParams
from rollopt.config import LocalEngineConfig
from rollopt.modeling import LoadedModel
from rollopt.environments import SyntheticEnv
from rollopt.step import Environment
from rollopt.errors import ConfigError
from rollopt.executor import RolloutExecutor, episode_specs
from rollopt.schedulers import Policy, RiskClass, build_scheduler
from rollopt.session import Session, start_session
from rollopt.trajectory import Trajectory

CHECKS_BY_RISK: dict[RiskClass, tuple[str, ...]] = {
    RiskClass.R1: ("token-parity", "distribution", "conservation"),
    RiskClass.R2: ("distribution", "conservation"),
    RiskClass.R3: ("off-policy", "conservation"),
}


@dataclass(frozen=True)
class CheckResult:
    scheduler: str
    risk_class: str | None
    check: str
    passed: bool
    statistic: float
    p_value: float | None
    n: int
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ValidationConfig:
    """The workload and thresholds; the defaults are what ``rollopt validate`` runs."""

    parity_tasks: int = 16
    parity_group: int = 4
    distribution_tasks: int = 32
    distribution_group: int = 8  # 256 trajectories per side
    offpolicy_batches: int = 3
    offpolicy_tasks: int = 6
    offpolicy_extra_groups: int = 2
    group_size_offpolicy: int = 4
    conservation_steps: int = 16
    conservation_tasks: int = 4  # the quota: groups returned per call
    conservation_extra_groups: int = 4  # over-provisioned groups per call
    conservation_group: int = 4  # 16 × 4 × 4 = 256 trajectories trained
    alpha: float = 0.01
    logprob_tol: float = 1e-5
    seed: int = 0
    tokens_per_turn: tuple[int, int] = (6, 14)
    turns: tuple[int, int] = (1, 4)
    tool_latency_s: float = 0.01
    e2e_steps: int = 8
    e2e_tolerance: float = 0.1  # on |mean reward over the run − sync's|


def _env(cfg: ValidationConfig, long_tail: bool = False) -> SyntheticEnv:
    return SyntheticEnv(turns=cfg.turns, tokens_per_turn=cfg.tokens_per_turn, tool_latency_s=cfg.tool_latency_s,
                        tool_sigma=1.0, prompt_words=8, long_tail_fraction=0.2 if long_tail else 0.0,
                        long_tail_factor=6)


class Harness:
    """One tiny peaked model, its tokenizer and a fresh session (:mod:`rollopt.session`) per run."""

    def __init__(self, cfg: ValidationConfig, environment: Environment | None = None) -> None:
        from rollopt.modeling.tiny import build_model, build_tokenizer

        self.cfg = cfg
        self.environment = environment  # a user's environment instead of the synthetic workload
        self.tokenizer = build_tokenizer()
        self.model = build_model(len(self.tokenizer), init_scale=0.5, seed=cfg.seed,
                                 eos_token_id=self.tokenizer.eos_token_id)

    def make_env(self, long_tail: bool = False) -> Environment:
        """The workload: the user's environment when one was given, else the synthetic one (``long_tail``: a
        fifth of its tasks 6× longer, for the checks where stragglers matter)."""
        return self.environment if self.environment is not None else _env(self.cfg, long_tail)

    def session(self, env: Environment, policy: Policy | str) -> AsyncContextManager[Session]:
        """``policy`` on ``env`` with a fresh batch-invariant embedded engine (exact R1 parity needs invariant
        prefill) holding a copy of the model's weights (:func:`rollopt.session.start_session`)."""
        cfg = LocalEngineConfig(max_running=64, batch_invariant=True, invariant_prefill=True, seed=self.cfg.seed)
        weights = {k: v.clone() for k, v in self.model.state_dict().items()}
        return start_session(cfg, env, LoadedModel(self.model.config, weights, self.tokenizer, "tiny-llama"), policy)

    async def rollout(self, policy: Policy | str, tasks: int, group: int, temperature: float) -> list[Trajectory]:
        env = self.make_env()
        specs = episode_specs(env.tasks(tasks, self.cfg.seed), group,
                              SamplingParams(max_new_tokens=64, temperature=temperature), self.cfg.seed)
        async with self.session(env, policy) as s:
            result = await RolloutExecutor(s.env, s.engine, s.renderer, s.policy).run(specs)
        return sorted(result.trajectories, key=lambda t: t.id)


def _policy(spec: str | Policy) -> Policy:
    return build_scheduler(spec) if isinstance(spec, str) else spec


async def check_token_parity(h: Harness, spec: str | Policy, baseline: Sequence[Trajectory] | None = None) -> CheckResult:
    policy = _policy(spec)
    cfg = h.cfg
    base = baseline or await h.rollout("sync", cfg.parity_tasks, cfg.parity_group, 0.0)
    got = await h.rollout(policy, cfg.parity_tasks, cfg.parity_group, 0.0)
    by_id = {t.id: t for t in got}
    differ, worst_lp, first = 0, 0.0, None
    for ref in base:
        t = by_id.get(ref.id)
        same = (t is not None and np.array_equal(t.token_ids, ref.token_ids) and np.array_equal(t.kinds, ref.kinds)
                and t.reward == ref.reward)
        if same:
            m = ref.loss_mask
            lp = float(np.max(np.abs(t.logprobs[m] - ref.logprobs[m]))) if m.any() else 0.0
            worst_lp = max(worst_lp, lp)
            same = lp <= cfg.logprob_tol
        if not same:
            differ += 1
            first = first or ref.id
    n = len(base)
    return CheckResult(policy.name, _risk(policy), "token-parity", differ == 0 and len(got) == n, differ / max(n, 1),
                       None, n, {"max_abs_dlogprob": worst_lp, "first_mismatch": first, "trajectories": len(got)})


def _traj_stats(trajs: Sequence[Trajectory]) -> dict[str, np.ndarray]:
    return {
        "response_length": np.array([t.num_generated for t in trajs], float),
        "turns": np.array([len(t.turns) for t in trajs], float),
        "tool_calls": np.array([len(t.tool_calls) for t in trajs], float),
        "reward": np.array([t.reward if t.reward is not None else np.nan for t in trajs], float),
        "logprob_mean": np.array([float(np.mean(t.logprobs[t.loss_mask])) if t.num_generated else np.nan
                                  for t in trajs], float),
    }


def _ks_2samp(a: np.ndarray, b: np.ndarray):
    """Two-sample KS test: the exact p-value where scipy can compute it, else the asymptotic one.

    scipy's exact recursion gives up on some sample sizes with many ties (discrete metrics such as turns) and
    falls back to the asymptotic p-value with a RuntimeWarning; this makes that same fallback explicit, so the
    result does not depend on the process's warning filters.
    """
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        try:
            return stats.ks_2samp(a, b, method="exact")
        except RuntimeWarning:
            pass
    return stats.ks_2samp(a, b, method="asymp")


def _two_sample(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    from scipy import stats

    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if len(a) == 0 or len(b) == 0:
        return {"ks": 1.0, "ks_p": 0.0, "mw_p": 0.0}
    if np.array_equal(np.sort(a), np.sort(b)):
        return {"ks": 0.0, "ks_p": 1.0, "mw_p": 1.0}
    ks = _ks_2samp(a, b)
    mw = stats.mannwhitneyu(a, b, alternative="two-sided") if np.ptp(np.r_[a, b]) > 0 else None
    return {"ks": float(ks.statistic), "ks_p": float(ks.pvalue), "mw_p": float(mw.pvalue) if mw else 1.0}


async def check_distribution(h: Harness, spec: str | Policy, baseline: Sequence[Trajectory] | None = None) -> CheckResult:
    policy = _policy(spec)
    cfg = h.cfg
    base = baseline or await h.rollout("sync", cfg.distribution_tasks, cfg.distribution_group, 1.0)
    got = await h.rollout(policy, cfg.distribution_tasks, cfg.distribution_group, 1.0)
    sa, sb = _traj_stats(base), _traj_stats(got)
    per_metric = {name: _two_sample(sa[name], sb[name]) for name in sa}
    p = min(min(m["ks_p"], m["mw_p"]) for m in per_metric.values())
    effect = max(m["ks"] for m in per_metric.values())
    n = min(len(base), len(got))
    return CheckResult(policy.name, _risk(policy), "distribution", p > cfg.alpha and n >= 256, effect, p, n,
                       {"metrics": per_metric, "alpha": cfg.alpha})


async def check_off_policy(h: Harness, spec: str | Policy, correction: str = "tis",
                           max_staleness: int | None = 1) -> CheckResult:
    """See the module docstring (R3)."""
    from rollopt.batch import collate
    from rollopt.trainer.metrics import mismatch_by_staleness
    from rollopt.trainer.offpolicy import OffPolicyConfig, correct
    from rollopt.trainer.scoring import score

    policy = _policy(spec)
    cfg = h.cfg
    env = h.make_env(long_tail=True)
    trained: list[Trajectory] = []
    lags: list[np.ndarray] = []
    mismatch: dict[str, float] = {}
    broken: list[str] = []
    off = OffPolicyConfig(correction=correction, max_staleness=max_staleness)
    model = copy_model(h.model)
    generator = torch.Generator().manual_seed(cfg.seed)
    acted = 0
    async with h.session(env, policy) as s:
        executor = RolloutExecutor(s.env, s.engine, s.renderer, s.policy)
        for batch in range(cfg.offpolicy_batches):
            specs = episode_specs(env.tasks(cfg.offpolicy_tasks + cfg.offpolicy_extra_groups, cfg.seed + batch),
                                  cfg.group_size_offpolicy, SamplingParams(max_new_tokens=64, temperature=1.0),
                                  cfg.seed + batch)
            result = await executor.run(specs, target_groups=cfg.offpolicy_tasks)
            version = s.engine.version
            for t in result.trajectories:
                v = t.versions[t.loss_mask]
                if len(v) and (v.min() < 0 or v.max() > version or np.any(np.diff(v) < 0)):
                    broken.append(t.id)
            trained += result.trajectories
            batch_t = collate(result.trajectories)
            with torch.no_grad():
                trainer_lp, _ = score(model, batch_t)
            lags.append((version - batch_t.versions[batch_t.loss_mask]).numpy())
            for k, val in mismatch_by_staleness(batch_t.behavior_logprobs, trainer_lp, batch_t.versions,
                                                batch_t.loss_mask, version).items():
                if k.startswith("mismatch/") and k.endswith("/k3"):
                    mismatch[f"batch{batch}/{k}"] = val
            fix = correct(batch_t.behavior_logprobs, trainer_lp, batch_t.versions, batch_t.loss_mask, version, off)
            stale = batch_t.loss_mask & (version - batch_t.versions >= 1)
            acted += int(((fix.weights != 1.0) & stale).sum()) + fix.stale_dropped
            with torch.no_grad():  # the "trainer" moves on: perturb the weights and sync them
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 0.02)
            await s.engine.update_weights({k: v.clone() for k, v in model.state_dict().items()})
        lost = executor.carry
    all_lags = np.concatenate(lags) if lags else np.zeros(0)
    hist = {int(k): float(c) / max(len(all_lags), 1) for k, c in zip(*np.unique(all_lags, return_counts=True))}
    stale_frac = float((all_lags >= 1).mean()) if len(all_lags) else 0.0
    active = off.correction != "none" or off.max_staleness is not None
    passed = not broken and active and stale_frac > 0 and acted > 0
    return CheckResult(policy.name, _risk(policy), "off-policy", passed, stale_frac, None, int(len(all_lags)),
                       {"staleness_histogram": hist, "mismatch_k3": mismatch, "correction": off.correction,
                        "max_staleness": off.max_staleness, "correction_acted_on_tokens": acted,
                        "bad_version_trajectories": broken[:5], "still_carried_over": len(lost)})


async def _conservation_run(h: Harness, policy: Policy | str, extra_groups: int) -> dict[str, Any]:
    """The check's rollout calls (see the module docstring): started ids, returned trajectories (in order), the
    final carry-over, and the largest carry-over seen."""
    cfg = h.cfg
    env = h.make_env(long_tail=True)
    started: list[str] = []
    returned: list[Trajectory] = []
    worst_groups = worst_age = 0
    async with h.session(env, policy) as s:
        executor = RolloutExecutor(s.env, s.engine, s.renderer, s.policy)
        for step in range(cfg.conservation_steps):
            seed = cfg.seed + 1000 + step
            tasks = env.tasks(cfg.conservation_tasks + extra_groups, seed)
            specs = episode_specs(tasks[: len(tasks) - executor.carried_groups], cfg.conservation_group,
                                  SamplingParams(max_new_tokens=64, temperature=1.0), seed)
            result = await executor.run(specs, target_groups=cfg.conservation_tasks)
            started += result.started
            returned += result.trajectories
            worst_groups = max(worst_groups, result.carried_groups)
            worst_age = max(worst_age, result.carried_age_max)
        carry = executor.carry
    return {"started": started, "returned": returned, "carry": carry, "worst_groups": worst_groups,
            "worst_age": worst_age}


async def check_conservation(h: Harness, spec: str | Policy, baseline: Sequence[Trajectory] | None = None) -> CheckResult:
    """See the module docstring (conservation); ``baseline``: what ``sync`` without over-provisioning returns."""
    policy = _policy(spec)
    cfg = h.cfg
    if baseline is None:
        baseline = (await _conservation_run(h, "sync", extra_groups=0))["returned"]
    run = await _conservation_run(h, policy, cfg.conservation_extra_groups)
    counts: dict[str, int] = {}
    for t in run["returned"]:
        counts[t.id] = counts.get(t.id, 0) + 1
    carried = {t.id for t in run["carry"]}
    twice = sorted(i for i, n in counts.items() if n > 1)
    unaccounted = sorted(set(run["started"]) - set(counts) - carried)
    exact = not twice and not unaccounted and not (carried & set(counts))
    bounded = run["worst_groups"] <= cfg.conservation_extra_groups and run["worst_age"] <= 2
    sampled = run["returned"] + [t.trajectory for t in run["carry"] if t.done]
    trained = _traj_stats(run["returned"])
    tests = {}
    for name, other in (("vs_sampled", _traj_stats(sampled)), ("vs_sync", _traj_stats(baseline))):
        tests[name] = {m: _two_sample(trained[m], other[m]) for m in ("response_length", "turns", "reward")}
    p = min(min(t["ks_p"], t["mw_p"]) for side in tests.values() for t in side.values())
    effect = max(t["ks"] for t in tests["vs_sync"].values())
    n = min(len(run["returned"]), len(baseline))
    passed = exact and bounded and p > cfg.alpha and n >= 256
    return CheckResult(policy.name, _risk(policy), "conservation", passed, effect, p, n,
                       {"started": len(run["started"]), "returned": sum(counts.values()), "carried": len(carried),
                        "returned_twice": twice[:5], "unaccounted": unaccounted[:5],
                        "carried_groups_max": run["worst_groups"], "carried_age_max": run["worst_age"],
                        "tests": tests, "alpha": cfg.alpha,
                        "response_length_mean": {"trained": float(trained["response_length"].mean()),
                                                 "sync": float(_traj_stats(baseline)["response_length"].mean())}})


E2E_RECIPE = ("environment.name=synthetic", "environment.options.turns=[2, 3]",
              "environment.options.tokens_per_turn=[6, 10]", "environment.options.tool_latency_s=0.01",
              "environment.options.prompt_words=12", "model.init_scale=0.3", "rollout.tasks_per_step=4",
              "rollout.group_size=4", "rollout.max_new_tokens=16", "rollout.temperature=0.8",
              "rollout.invariant_prefill=true", "algorithm.micro_batch=8", "algorithm.lr=1e-3",
              "attribution.sequences=0")
"""The e2e training recipe (overrides of the defaults in :mod:`rollopt.trainer.recipe`)."""


async def _train_rewards(overrides: Sequence[str]) -> list[float]:
    import tempfile

    from rollopt.trainer.loop import Trainer
    from rollopt.trainer.recipe import load_recipe

    with tempfile.TemporaryDirectory(prefix="rollopt-e2e-") as out:
        rows = await Trainer(load_recipe(None, [*E2E_RECIPE, *overrides]), out).run()
    return [r["reward_mean"] for r in rows]


async def e2e_sync_curve(cfg: ValidationConfig) -> list[float]:
    """The e2e baseline: per-step mean reward of the run with the ``sync`` scheduler in ``sync`` mode."""
    return await _train_rewards([f"loop.steps={cfg.e2e_steps}", f"loop.seed={cfg.seed}", "rollout.scheduler=sync",
                                 "loop.mode=sync"])


async def check_e2e(h: Harness, spec: str | Policy, baseline: Sequence[float] | None = None) -> CheckResult:
    """See the module docstring (e2e); ``baseline`` is :func:`e2e_sync_curve` when already computed."""
    policy = _policy(spec)
    cfg = h.cfg
    base = list(baseline or await e2e_sync_curve(cfg))
    r3 = policy.risk_class is RiskClass.R3
    mode = "async" if r3 else "sync"
    got = await _train_rewards([f"loop.steps={cfg.e2e_steps}", f"loop.seed={cfg.seed}", f"loop.mode={mode}",
                                f"rollout.scheduler={policy.name}",
                                *(["off_policy.max_staleness=1", "rollout.extra_groups=1"] if r3 else [])])
    diff = abs(float(np.mean(got)) - float(np.mean(base)))
    return CheckResult(policy.name, _risk(policy), "e2e", diff <= cfg.e2e_tolerance, diff, None, len(got),
                       {"reward_curve": got, "sync_reward_curve": base, "tolerance": cfg.e2e_tolerance,
                        "loop_mode": mode})


def copy_model(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).eval()


def _risk(policy: Policy) -> str | None:
    return policy.risk_class.value if isinstance(policy.risk_class, RiskClass) else None


CHECKS: dict[str, Callable[..., Any]] = {"token-parity": check_token_parity, "distribution": check_distribution,
                                         "off-policy": check_off_policy, "conservation": check_conservation}


def save_results(results: Sequence[CheckResult], path) -> None:
    """Write one JSON record per check (``rollopt validate --json``)."""
    import json
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([r.to_dict() for r in results], indent=2))


async def validate_policies(specs: Sequence[str | Policy], cfg: ValidationConfig | None = None,
                   on_result: Callable[[CheckResult], None] = lambda r: None, e2e: bool = False,
                   environment: Environment | None = None,
                   checks: Sequence[str] | None = None) -> list[CheckResult]:
    """Run every check each policy's risk class demands (only those named in ``checks``, when given), plus
    ``e2e`` when asked; baselines are computed once and shared. ``environment``: check the policies on a user's environment (an instance) instead of the
    synthetic workload; the tiny random-init model writes no tool calls, so give it planned calls
    (``Environment.plans_calls``) to exercise its tools. ``e2e`` always trains on the synthetic workload."""
    if unknown := sorted(set(checks or ()) - set(CHECKS)):
        raise ConfigError(f"unknown check(s) {unknown}; known: {sorted(CHECKS)}")
    h = Harness(cfg or ValidationConfig(), environment)
    c = h.cfg
    baselines: dict[str, list[Trajectory]] = {}
    sync_curve: list[float] | None = None
    out: list[CheckResult] = []
    for spec in specs:
        policy = _policy(spec)
        if not isinstance(policy.risk_class, RiskClass):
            results = [CheckResult(policy.name or str(spec), None, "risk-class", False, math.nan, None, 0,
                                   {"why": "the policy declares no risk class; set risk_class = RiskClass.R1/R2/R3"})]
        else:
            results = []
            for check in CHECKS_BY_RISK[policy.risk_class]:
                if checks is not None and check not in checks:
                    continue
                if check == "token-parity":
                    if check not in baselines:
                        baselines[check] = await h.rollout("sync", c.parity_tasks, c.parity_group, 0.0)
                    results.append(await check_token_parity(h, policy, baselines[check]))
                elif check == "distribution":
                    if check not in baselines:
                        baselines[check] = await h.rollout("sync", c.distribution_tasks, c.distribution_group, 1.0)
                    results.append(await check_distribution(h, policy, baselines[check]))
                elif check == "conservation":
                    if check not in baselines:
                        baselines[check] = (await _conservation_run(h, "sync", extra_groups=0))["returned"]
                    results.append(await check_conservation(h, policy, baselines[check]))
                else:
                    results.append(await check_off_policy(h, policy))
            if e2e:
                sync_curve = sync_curve or await e2e_sync_curve(c)
                results.append(await check_e2e(h, policy, sync_curve))
        for r in results:
            on_result(r)
        out += results
    return out
