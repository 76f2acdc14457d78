"""Python tool: seeded programming/math problems solved by writing code and running it in the sandbox.

Each task is one of a few problem families (sums of primes, inclusion–exclusion counts, Fibonacci numbers
modulo m, digit sums of factorials, Collatz step counts) with random parameters and an integer answer computed
here by a reference implementation. The model's one tool, ``run_python``, runs a program in a
:class:`~rollopt.environments.sandbox.SandboxPool` and returns its output; by default each trajectory gets
its own persistent interpreter (variables survive between calls), released by :meth:`close_episode` when the
episode ends. The reward is 1.0 when the final turn says ``<answer>N</answer>`` with the exact answer.

The environment owns no pool until it is entered: run rollouts inside ``async with PythonToolEnv() as env``
(or pass an open pool). Outside, ``run_python`` fails with a ``sandbox_unavailable`` record. A forked
trajectory starts a fresh interpreter (a process cannot be cloned into another sandbox), and so does a
trajectory whose running call was cancelled (e.g. preempted): a half-run program's interpreter is killed, and
the next call's output starts with a note that earlier variables are gone.
"""

from __future__ import annotations

import json
import math
import random
from typing import Callable

from rollopt.environments.calculator import ANSWER_RE
from rollopt.environments.sandbox import SandboxLimits, SandboxPool
from rollopt.errors import ErrorRecord, ToolFailed
from rollopt.step import Environment, Message, Task, Tool, ToolContext


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\0\0"
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(range(i * i, n, i)))
    return sum(i for i in range(n) if sieve[i])


def _fib_mod(k: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(k):
        a, b = b, (a + b) % m
    return a


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _factorial_digit_sum(k: int) -> int:
    value = 1
    for i in range(2, k + 1):
        value *= i
    return sum(map(int, str(value)))


# family -> (draw parameters, prompt, reference answer, a solution program)
_FAMILIES: dict[str, tuple[Callable[[random.Random], dict], str, Callable[..., int], str]] = {
    "primes": (lambda r: {"n": r.randint(100, 10_000)},
               "What is the sum of all prime numbers below {n}?", _primes_below,
               "print(sum(p for p in range(2, {n}) if all(p % d for d in range(2, int(p ** 0.5) + 1))))"),
    "divisible": (lambda r: {"n": r.randint(1_000, 10 ** 6), "a": r.randint(2, 30), "b": r.randint(31, 97)},
                  "How many integers from 1 to {n} (inclusive) are divisible by {a} or by {b}?",
                  lambda n, a, b: n // a + n // b - n // math.lcm(a, b),
                  "print(sum(1 for i in range(1, {n} + 1) if i % {a} == 0 or i % {b} == 0))"),
    "fibonacci": (lambda r: {"k": r.randint(50, 2_000), "m": r.randint(1_000, 10 ** 6)},
                  "Let F(1) = F(2) = 1 and F(k) = F(k-1) + F(k-2). What is F({k}) modulo {m}?", _fib_mod,
                  "a, b = 0, 1\nfor _ in range({k}):\n    a, b = b, (a + b) % {m}\nprint(a)"),
    "digits": (lambda r: {"k": r.randint(20, 300)},
               "What is the sum of the decimal digits of {k}! (the factorial of {k})?", _factorial_digit_sum,
               "import math\nprint(sum(map(int, str(math.factorial({k})))))"),
    "collatz": (lambda r: {"n": r.randint(10, 10 ** 6)},
                "Starting from {n}, repeatedly halve the number if it is even or replace it by 3n+1 if it is odd. "
                "How many steps does it take to reach 1?", _collatz_steps,
                "n, steps = {n}, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    steps += 1\n"
                "print(steps)"),
}


class PythonToolEnv(Environment):
    """Programming/math problems with a sandboxed ``run_python`` tool.

    Args:
        pool: an open :class:`SandboxPool` to use; by default the environment opens its own when entered.
        pool_size: workers of the pool it opens itself.
        limits: limits of the pool it opens itself.
        stateful: give each trajectory a persistent interpreter (else every call starts from scratch).
        families: the problem families to draw from (default: all).
        max_turns: turns allowed per episode.
    """

    name = "python_tool"
    system_prompt = (
        "You solve problems by writing Python programs. Call run_python with a complete program that prints "
        "what you need; variables persist between calls. When you know the result, reply with the final "
        "answer as <answer>NUMBER</answer>."
    )

    def __init__(self, pool: SandboxPool | None = None, pool_size: int = 4, limits: SandboxLimits | None = None,
                 stateful: bool = True, families: tuple[str, ...] | None = None, max_turns: int = 6) -> None:
        unknown = set(families or ()) - set(_FAMILIES)
        if unknown:
            raise ValueError(f"unknown problem families {sorted(unknown)}; known: {sorted(_FAMILIES)}")
        self.families = tuple(families or _FAMILIES)
        self.pool_size, self.limits, self.stateful, self.max_turns = pool_size, limits, stateful, max_turns
        self._pool, self._owned_pool = pool, None

    @property
    def pool(self) -> SandboxPool | None:
        """The pool the tool runs in (``None`` until the environment is entered or given one)."""
        return self._pool

    async def __aenter__(self) -> "PythonToolEnv":
        if self._pool is None:
            self._owned_pool = SandboxPool(self.pool_size, self.limits)
            self._pool = await self._owned_pool.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._owned_pool is not None:
            pool, self._pool, self._owned_pool = self._owned_pool, None, None
            await pool.__aexit__(*exc_info)

    def tasks(self, n: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            family = rng.choice(self.families)
            draw, prompt, answer, solution = _FAMILIES[family]
            params = draw(rng)
            out.append(Task(id=f"py-{seed}-{i}", prompt=prompt.format(**params), answer=answer(**params),
                            info={"family": family, "params": params, "solution": solution.format(**params)}))
        return out

    def tools(self) -> list[Tool]:
        return [Tool.from_function(self.run_python, timeout_s=120.0)]

    async def run_python(self, code: str, context: ToolContext) -> str:
        """Run a Python program in a sandbox and return what it printed (stdout and stderr).

        Args:
            code: a complete Python program; print the values you need. Only the standard library is available.
        """
        if self._pool is None:
            raise ToolFailed(ErrorRecord("sandbox_unavailable", "PythonToolEnv has no open SandboxPool; run "
                                         "rollouts inside `async with PythonToolEnv() as env`"))
        session = context.trajectory_id if self.stateful and context.trajectory_id else None
        result = await self._pool.run(code, session=session)
        note = "[the interpreter was restarted: earlier variables are gone]\n" if result.restarted else ""
        if result.error is not None:
            raise ToolFailed(result.error, f"{note}{result.output}Error ({result.error.kind}): {result.error.message}")
        return note + (result.output or "(no output)")

    async def close_episode(self, trajectory_id: str) -> None:
        if self._pool is not None and self.stateful:
            await self._pool.release(trajectory_id)

    def demonstration(self, task: Task) -> list[Message]:
        """Run the reference program once, then answer."""
        call = json.dumps({"name": "run_python", "arguments": {"code": task.info["solution"]}})
        return [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                {"role": "tool", "content": f"{task.answer}\n"},
                {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]

    def score(self, task: Task, final_text: str) -> float:
        found = ANSWER_RE.findall(final_text)
        return 1.0 if found and int(found[-1]) == task.answer else 0.0
