"""`rollopt validate`: every shipped policy passes the checks of its risk class, and deliberately broken
policies (test-only) fail the check of theirs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rollopt.schedulers import SCHEDULERS, Policy, RiskClass
from rollopt.validate import Harness, ValidationConfig, check_distribution, check_off_policy, check_token_parity, validate


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
    assert main(["validate", "--all", "--json", str(out)]) == 0
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
    results = await validate([UndeclaredPolicy()], ValidationConfig())
    assert [(r.check, r.passed) for r in results] == [("risk-class", False)]
