"""The retrieval environment: a seeded corpus in SQLite FTS5, two-hop questions, exact-match reward."""

import pytest

from rollopt import ToolCall
from rollopt.environments import RetrievalEnv, build_environment
from rollopt.step import execute_tool_call
from rollopt.testing import check_environment


@pytest.fixture(scope="module")
def env():
    return RetrievalEnv()


def test_conformance_and_registry(env):
    assert len(check_environment(env)) == 7
    assert isinstance(build_environment("retrieval", corpus_seed=3), RetrievalEnv)


def test_corpus_is_seeded(env):
    assert RetrievalEnv(corpus_seed=0).world == env.world
    assert RetrievalEnv(corpus_seed=1).world.documents != env.world.documents


def test_every_question_takes_two_hops_and_the_demonstration_finds_the_answer(env):
    tasks = env.tasks(40, seed=5)
    assert {t.info["kind"] for t in tasks} == {"born_country", "employer_founder", "founder_city"}
    for task in tasks:
        first, second = task.info["hops"]
        assert second in env.search(first, 1)  # hop 1 names hop 2 ...
        assert task.answer in env.search(second, 1)  # ... whose article names the answer
        assert task.answer not in env.search(first, 1)  # one hop is not enough
        assert env.score(task, env.demonstration(task)[-1]["content"]) == 1.0


def test_exact_match_ignores_case_and_space_only(env):
    task = env.tasks(1, 0)[0]
    assert env.score(task, f"<answer>  {task.answer.upper()} </answer>") == 1.0
    assert env.score(task, f"<answer>{task.answer}x</answer>") == 0.0
    assert env.score(task, task.answer) == 0.0


async def test_search_tolerates_any_query_text(env):
    for query in ['"unbalanced', "NEAR(", "*", "", "a OR AND b"]:
        result = await execute_tool_call(env.tools(), ToolCall("c", "search", {"query": query}))
        assert result.ok, (query, result)
