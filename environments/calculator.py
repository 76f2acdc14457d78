"""Calculator: seeded multi-step arithmetic word problems that need a calculator tool.

Each problem chains ``difficulty`` operations on integers (multiply, add, subtract, divide exactly), told
as a short story, so a model that cannot do arithmetic in its head needs several tool calls. The answer is
always an integer; the reward is 1.0 when the final turn says ``<answer>N</answer>`` with the exact answer.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re

from rollopt.step import Environment, Message, Task, Tool, tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def evaluate(expression: str) -> int | float:
    """Evaluate an arithmetic expression of numbers, + - * / // % and parentheses; anything else is refused."""
    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unsupported syntax {type(node).__name__}; use numbers, + - * / // % and parentheses")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = walk(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@tool(timeout_s=5.0, deterministic=True)
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: numbers with + - * / // % and parentheses, e.g. "(17 * 23) - 40".
    """
    return str(evaluate(expression))


_STARTS = [
    ("A shop has {a} boxes with {b} apples in each box.", "apples"),
    ("A library has {a} shelves holding {b} books each.", "books"),
    ("A farmer plants {a} rows of {b} trees.", "trees"),
]
_STEPS = {
    "add": "Then {n} more {thing} arrive.",
    "sub": "Then {n} {thing} are taken away.",
    "mul": "Then the number of {thing} is multiplied by {n}.",
    "div": "Then the {thing} are shared equally among {n} groups, and we look at one group.",
}

_EXAMPLE: list[Message] = [
    {"role": "user", "content": "A shop has 12 boxes with 7 apples in each box. Then 5 apples are taken away. "
                                "How many apples are there now?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 7"}}\n</tool_call>'},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculate", "arguments": {"expression": "84 - 5"}}\n</tool_call>'},
    {"role": "tool", "content": "79"},
    {"role": "assistant", "content": "<answer>79</answer>"},
]

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class CalculatorEnv(Environment):
    """Multi-step arithmetic word problems with a ``calculate`` tool.

    Args:
        difficulty: number of operations after the first product (1–6); larger means more tool calls.
        max_operand: largest number that appears in a problem.
        max_turns: turns allowed per episode.
        few_shot: put one worked example (a tool call, its result, the answer) before the problem; small
            instruct models need it to use the tool format at all.
        show_tool_schemas: render the tool's JSON schema into the prompt (off for a model warm-started on
            the tool, which makes the prompt ~400 tokens shorter).
        system_prompt: replace the default system prompt ("" for none).
        demo_slip_rate: share of :meth:`demonstration` episodes written by a careless tutor, who makes every
            call right but writes the answer as plain text, without the ``<answer>`` tags (so it scores 0). A warm
            start on them learns the tool format and the habit; RL on the reward has to unlearn it. 0 (the
            default) gives correct demonstrations only.
    """

    name = "calculator"
    system_prompt = (
        "You are a careful math assistant. Use the calculate tool for every arithmetic step. "
        "When you know the result, reply with the final answer as <answer>NUMBER</answer>."
    )

    def __init__(self, difficulty: int = 2, max_operand: int = 50, max_turns: int = 8, few_shot: bool = False,
                 show_tool_schemas: bool = True, system_prompt: str | None = None,
                 demo_slip_rate: float = 0.0) -> None:
        if not 1 <= difficulty <= 6:
            raise ValueError(f"difficulty must be in 1..6, got {difficulty}")
        if max_operand < 4:
            raise ValueError("max_operand must be >= 4")
        if not 0.0 <= demo_slip_rate <= 1.0:
            raise ValueError(f"demo_slip_rate must be in [0, 1], got {demo_slip_rate}")
        self.demo_slip_rate = demo_slip_rate
        self.difficulty, self.max_operand, self.max_turns = difficulty, max_operand, max_turns
        self.few_shot = few_shot
        self.show_tool_schemas = show_tool_schemas
        if system_prompt is not None:
            self.system_prompt = system_prompt or None

    def reset(self, task: Task) -> list[Message]:
        messages = super().reset(task)
        return messages[:-1] + _EXAMPLE + messages[-1:] if self.few_shot else messages

    def tools(self) -> list[Tool]:
        return [calculate]

    def _problem(self, rng: random.Random) -> tuple[str, int, list[str]]:
        template, thing = rng.choice(_STARTS)
        a, b = rng.randint(2, self.max_operand), rng.randint(2, self.max_operand)
        value, text, steps = a * b, [template.format(a=a, b=b)], [f"{a} * {b}"]
        for _ in range(self.difficulty):
            divisors = [d for d in range(2, min(value, self.max_operand) + 1) if value % d == 0]
            ops = ["add", "mul"] + (["sub"] if value > 2 else []) + (["div"] if divisors else [])
            op = rng.choice(ops)
            if op == "add":
                n = rng.randint(1, self.max_operand)
                value += n
            elif op == "sub":
                n = rng.randint(1, min(value - 1, self.max_operand))
                value -= n
            elif op == "mul":
                n = rng.randint(2, 9)
                value *= n
            else:
                n = rng.choice(divisors)
                value //= n
            text.append(_STEPS[op].format(n=n, thing=thing))
            steps.append(f"{'+-*/'[['add', 'sub', 'mul', 'div'].index(op)]} {n}")
        text.append(f"How many {thing} are there now?")
        return " ".join(text), value, steps

    def tasks(self, n: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            prompt, answer, steps = self._problem(rng)
            out.append(Task(id=f"calc-{seed}-{i}", prompt=prompt, answer=answer,
                            info={"steps": steps, "difficulty": self.difficulty}))
        return out

    def demonstration(self, task: Task) -> list[Message]:
        """One ``calculate`` call per step (the previous result as the left operand), then the answer; or, for a
        ``demo_slip_rate`` share of tasks (chosen by a generator seeded with the task id), the careless version
        that makes every call but gives the answer without the ``<answer>`` tags the score needs."""
        messages: list[Message] = []
        value = None
        for step in task.info["steps"]:
            expression = step if value is None else f"{value} {step}"
            value = evaluate(expression)
            call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
            messages += [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                         {"role": "tool", "content": str(value)}]
        slips = random.Random(task.id).random() < self.demo_slip_rate
        answer = f"The answer is {value}." if slips else f"<answer>{value}</answer>"
        return messages + [{"role": "assistant", "content": answer}]

    def score(self, task: Task, final_text: str) -> float:
        found = ANSWER_RE.findall(final_text)
        return 1.0 if found and int(found[-1]) == task.answer else 0.0
