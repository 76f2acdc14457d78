"""`rollopt validate`: every shipped policy passes the checks of its risk class, and deliberately broken
policies (test-only) fail the check of theirs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rollopt.schedulers import SCHEDULERS, Policy, RiskClass
from rollopt.validate import (Harness, ValidationConfig, check_distribution, check_e2e, check_off_policy,
                              check_token_parity, validate_policies)


class TruncatingPolicy(Policy):
    """Claims R1 but halves every turn's token budget (a "cut the long tail" optimization gone wrong)."""

    name = "truncating"
    risk_class = RiskClass.R1

    def sampling(self, view, tid, params):
        return replace(params, max_new_tokens=max(1, params.max_new_tokens // 2))


class HotterPolicy(Policy):
    """Claims R2 but samples at a higher temperature than asked."""

    name = "hotter"
    risk_class = RiskClass.R2

    def sampling(self, view, tid, params):
        return replace(params, temperature=params.temperature * 1.5)


class UndeclaredPolicy(Policy):
    name = "undeclared"


@pytest.fixture(scope="module")
def harness() -> Harness:
    return Harness(ValidationConfig())


def test_validate_all_shipped_policies_pass_and_the_cli_writes_records(tmp_path, capsys):
    from rollopt.cli import main

    out = tmp_path / "validate.json"
    checks = ["--check", "token-parity", "--check", "distribution", "--check", "off-policy"]  # conservation: below
    assert main(["validate", "--all", *checks, "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert {r["scheduler"] for r in records} == set(SCHEDULERS)
    for r in records:
        assert set(r) >= {"scheduler", "risk_class", "check", "passed", "statistic", "p_value", "n"} and r["passed"]
        if r["check"] == "distribution":
            assert r["n"] >= 256 and r["p_value"] > 0.01
        if r["check"] == "token-parity":
            assert r["statistic"] == 0 and r["detail"]["max_abs_dlogprob"] <= 1e-5
    offpolicy = [r for r in records if r["check"] == "off-policy"]
    assert [r["scheduler"] for r in offpolicy] == ["preempt"]
    hist = offpolicy[0]["detail"]["staleness_histogram"]
    assert float(hist.get("1", 0)) > 0 and offpolicy[0]["detail"]["correction_acted_on_tokens"] > 0
    assert "token-parity" in capsys.readouterr().out


async def test_a_policy_that_truncates_fails_token_parity(harness):
    result = await check_token_parity(harness, TruncatingPolicy())
    assert not result.passed and result.statistic > 0.5 and result.detail["first_mismatch"]


async def test_a_policy_that_heats_sampling_fails_the_distribution_test(harness):
    result = await check_distribution(harness, HotterPolicy())
    assert not result.passed and result.p_value < 0.01 and result.n >= 256
    assert result.detail["metrics"]["logprob_mean"]["ks"] > 0.2


async def test_an_off_policy_rollout_without_a_correction_fails(harness):
    result = await check_off_policy(harness, "preempt", correction="none", max_staleness=None)
    assert not result.passed and result.statistic > 0  # stale tokens exist, and nothing corrects them


async def test_a_policy_without_a_risk_class_fails_validation():
    results = await validate_policies([UndeclaredPolicy()], ValidationConfig())
    assert [(r.check, r.passed) for r in results] == [("risk-class", False)]


async def test_e2e_an_r1_policy_trains_the_identical_reward_curve():
    """Token parity (batch-invariant engine, invariant prefill, seeded sampling) carries over to training."""
    h = Harness(ValidationConfig(e2e_steps=4))
    result = await check_e2e(h, "overlap+prefix")
    assert result.passed and result.check == "e2e" and result.n == 4 and result.statistic == 0.0
    assert result.detail["reward_curve"] == result.detail["sync_reward_curve"]
    assert result.detail["loop_mode"] == "sync"


@pytest.mark.slow
def test_validate_e2e_all_policies_within_tolerance(tmp_path):
    from rollopt.cli import main

    out = tmp_path / "validate.json"
    assert main(["validate", "--all", "--e2e", "--json", str(out)]) == 0
    e2e = [r for r in json.loads(out.read_text()) if r["check"] == "e2e"]
    assert {r["scheduler"] for r in e2e} == set(SCHEDULERS)
    for r in e2e:
        assert r["passed"] and r["statistic"] <= r["detail"]["tolerance"] and r["n"] == 8
        if r["risk_class"] == "R1":
            assert r["statistic"] == 0.0


async def test_conservation_check_passes_for_the_policies_that_over_provision_differently():
    """The check that would have caught the dropped carry-over (README, ``rollopt validate``): ``sync`` (a
    barrier), ``async`` and ``overlap+prefix+preempt`` (R3, preemption), 256 trained trajectories each."""
    results = await validate_policies(["sync", "async", "overlap+prefix+preempt"], ValidationConfig(),
                                      checks=["conservation"])
    assert [(r.scheduler, r.check) for r in results] == [("sync", "conservation"), ("async", "conservation"),
                                                         ("overlap+prefix+preempt", "conservation")]
    for r in results:
        d = r.detail
        assert r.passed and r.n >= 256 and r.p_value > 0.01, d
        assert d["returned_twice"] == [] and d["unaccounted"] == []
        assert d["started"] == d["returned"] + d["carried"] and d["carried_groups_max"] <= 4
