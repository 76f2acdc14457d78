import pytest

from rollopt import EnvError, Task
from rollopt.environments import CalculatorEnv, build_environment
from rollopt.environments.calculator import evaluate
from rollopt.step import Environment
from rollopt.testing import check_environment
from rollopt.toolcalls import parse_tool_calls


def test_calculator_passes_the_conformance_kit():
    assert len(check_environment(CalculatorEnv())) >= 7
    assert check_environment(CalculatorEnv(few_shot=True, difficulty=4))


def test_answers_follow_from_the_steps():
    for difficulty in (1, 3, 6):
        for task in CalculatorEnv(difficulty=difficulty).tasks(30, seed=3):
            value = evaluate(task.info["steps"][0])
            for step in task.info["steps"][1:]:
                op, n = step.split()
                value = evaluate(f"{value} {'//' if op == '/' else op} {n}")
            assert value == task.answer and isinstance(task.answer, int)
            assert len(task.info["steps"]) == difficulty + 1


def test_score_is_exact_match_on_answer_tag():
    env = CalculatorEnv()
    task = env.tasks(1, 0)[0]
    assert env.score(task, f"so <answer>{task.answer}</answer>") == 1.0
    assert env.score(task, f"<answer>{task.answer + 1}</answer>") == 0.0
    assert env.score(task, f"the answer is {task.answer}") == 0.0


def test_careless_demonstrations_make_the_same_calls_but_answer_without_the_tag():
    tasks = CalculatorEnv(difficulty=2).tasks(400, seed=5)
    correct, careless = CalculatorEnv(difficulty=2), CalculatorEnv(difficulty=2, demo_slip_rate=0.8)
    scores = []
    for task in tasks:
        good, slipped = correct.demonstration(task), careless.demonstration(task)
        assert good[:-1] == slipped[:-1]  # every call and tool result is the same
        assert correct.score(task, good[-1]["content"]) == 1.0
        scores.append(careless.score(task, slipped[-1]["content"]))
        assert str(task.answer) in slipped[-1]["content"]
    again = CalculatorEnv(difficulty=2, demo_slip_rate=0.8)  # the slips are seeded by the task id alone
    assert [again.demonstration(t) for t in tasks] == [careless.demonstration(t) for t in tasks]
    assert 0.15 <= sum(scores) / len(scores) <= 0.25
    with pytest.raises(ValueError, match="demo_slip_rate"):
        CalculatorEnv(demo_slip_rate=1.5)


@pytest.mark.parametrize("expr", ["__import__('os')", "2 ** 1000", "x + 1", "1 if 1 else 2", "9" * 300])
def test_evaluate_refuses_anything_but_arithmetic(expr):
    with pytest.raises((ValueError, SyntaxError)):
        evaluate(expr)


def test_tool_results_go_back_as_observations():
    env = CalculatorEnv()
    task = env.tasks(1, 0)[0]
    parsed = parse_tool_calls('<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>'
                              "<tool_call>{bad}</tool_call>")
    from rollopt.trajectory import ToolResult
    outcome = env.step(task, 0, parsed, [ToolResult(parsed.tool_calls[0].id, "calculate", "6")])
    assert not outcome.done
    assert [m["content"] for m in outcome.observation][0] == "6"
    assert "malformed tool call" in outcome.observation[1]["content"]


def test_unknown_environment_names_the_known_ones():
    with pytest.raises(ValueError, match="calculator"):
        build_environment("nope")


class SeedlessEnv(Environment):
    name = "seedless"

    def tasks(self, n, seed):
        return [Task(id=f"t{i}", prompt="p") for i in range(n)]

    def tools(self):
        return []

    def score(self, task, final_text):
        return 1  # an int, not a float


def test_conformance_kit_reports_every_broken_rule():
    with pytest.raises(EnvError) as info:
        check_environment(SeedlessEnv())
    message = str(info.value)
    assert "tasks_seeded" in message and "final_turn_scored" in message
