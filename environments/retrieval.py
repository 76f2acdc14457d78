"""Retrieval: two-hop questions over a local corpus, answered with a full-text ``search`` tool.

The corpus is a small invented world generated from ``corpus_seed`` (people, cities, countries, companies
with made-up names, so a model cannot answer from memory): one document per entity, indexed in an in-memory
SQLite FTS5 table and ranked by BM25. Every question needs two documents, e.g. "In which country was Alma
Tovren born?" needs the person's page (born in Keldra) and the city's page (Keldra is in Vostria). The reward
is exact match: 1.0 when the final turn's ``<answer>...</answer>`` equals the answer, ignoring case and
surrounding space.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import threading
from dataclasses import dataclass

from rollopt.step import Environment, Message, Task, Tool

_SYLLABLES = ["al", "ma", "tov", "ren", "kel", "dra", "vos", "tri", "an", "bel", "cor", "da", "fen", "gar", "hol",
              "ir", "jun", "ka", "lor", "mi", "nor", "os", "pel", "quin", "ras", "sel", "tam", "ul", "ver", "wyn"]
_PROFESSIONS = ["engineer", "painter", "botanist", "pilot", "chemist", "historian", "architect", "composer"]
_INDUSTRIES = ["shipping", "software", "textile", "mining", "aviation", "publishing", "brewing", "robotics"]
_SIGHTS = ["harbour", "old bridge", "glass market", "clock tower", "salt mines", "river festival"]
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)


@dataclass(frozen=True)
class _World:
    """The generated entities and the relations the questions follow."""

    documents: dict[str, str]  # title -> text
    born_in: dict[str, str]  # person -> city
    works_at: dict[str, str]  # person -> company
    city_country: dict[str, str]
    founder: dict[str, str]  # company -> person


def _name(rng: random.Random, used: set[str], parts: int, suffix: str = "") -> str:
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize() + suffix
        if name not in used:
            used.add(name)
            return name


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _build_world(seed: int, people: int) -> _World:
    rng, used = random.Random(seed), set()
    countries = [_name(rng, used, 3, "ia") for _ in range(6)]
    cities = [_name(rng, used, 2) for _ in range(18)]
    companies = [_name(rng, used, 2, " " + rng.choice(["Works", "Labs", "Group", "Trading"])) for _ in range(12)]
    persons = [f"{_name(rng, used, 2)} {_name(rng, used, 3)}" for _ in range(people)]
    city_country = {c: rng.choice(countries) for c in cities}
    born_in = {p: rng.choice(cities) for p in persons}
    works_at = {p: rng.choice(companies) for p in persons}
    founder = {c: rng.choice(persons) for c in companies}
    docs: dict[str, str] = {}
    for p in persons:
        docs[p] = (f"{p} is {_a(rng.choice(_PROFESSIONS))} who was born in {born_in[p]}. "
                   f"{p.split()[0]} works at {works_at[p]}.")
    for c in cities:
        docs[c] = f"{c} is a city in {city_country[c]}. It is known for its {rng.choice(_SIGHTS)}."
    for c in companies:
        docs[c] = f"{c} is {_a(rng.choice(_INDUSTRIES))} company founded by {founder[c]}."
    for c in countries:
        docs[c] = f"{c} is a country with {sum(v == c for v in city_country.values())} large cities."
    return _World(docs, born_in, works_at, city_country, founder)


class _Index:
    """An in-memory FTS5 index of the corpus. SQLite is compiled serialized here (``threadsafety == 3``); the
    lock keeps the one connection's cursor use whole across the tool's worker threads."""

    def __init__(self, documents: dict[str, str]) -> None:
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._lock = threading.Lock()
        self._db.execute("CREATE VIRTUAL TABLE docs USING fts5(title, body)")
        self._db.executemany("INSERT INTO docs VALUES (?, ?)", sorted(documents.items()))

    def search(self, query: str, k: int) -> list[tuple[str, str]]:
        words = re.findall(r"\w+", query)
        if not words:
            return []
        match = " OR ".join(f'"{w}"' for w in words)  # quoted: the model's punctuation is never FTS syntax
        with self._lock:
            return self._db.execute(  # bm25 weights: a title match counts ten times a body match
                "SELECT title, body FROM docs WHERE docs MATCH ? ORDER BY bm25(docs, 10.0, 1.0) LIMIT ?", (match, k)
            ).fetchall()


def normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


class RetrievalEnv(Environment):
    """Two-hop questions over a generated corpus with a ``search`` tool.

    Args:
        corpus_seed: seed of the world (the corpus); task seeds pick questions from it.
        people: number of people in the world (the corpus has people + 36 documents).
        max_turns: turns allowed per episode.
    """

    name = "retrieval"
    system_prompt = (
        "Answer questions about a fictional world using the search tool; every answer needs two searches. "
        "When you know it, reply with <answer>NAME</answer>."
    )

    def __init__(self, corpus_seed: int = 0, people: int = 60, max_turns: int = 6) -> None:
        if people < 2:
            raise ValueError("people must be >= 2")
        self.max_turns = max_turns
        self.world = _build_world(corpus_seed, people)
        self._index = _Index(self.world.documents)

    def tools(self) -> list[Tool]:
        return [Tool.from_function(self.search, timeout_s=5.0, deterministic=True)]

    def search(self, query: str, k: int = 3) -> str:
        """Full-text search over the encyclopedia; returns the best matching articles.

        Args:
            query: words to look for, e.g. a name.
            k: how many articles to return (1-10).
        """
        hits = self._index.search(query, max(1, min(k, 10)))
        return "\n".join(f"[{title}] {body}" for title, body in hits) or "No article matches."

    def tasks(self, n: int, seed: int) -> list[Task]:
        rng, w = random.Random(seed), self.world
        people = sorted(w.born_in)
        out = []
        for i in range(n):
            kind = rng.choice(["born_country", "employer_founder", "founder_city"])
            if kind == "born_country":
                p = rng.choice(people)
                city = w.born_in[p]
                question, hops, answer = f"In which country was {p} born?", [p, city], w.city_country[city]
            elif kind == "employer_founder":
                p = rng.choice(people)
                company = w.works_at[p]
                question, hops, answer = f"Who founded the company that {p} works at?", [p, company], w.founder[company]
            else:
                company = rng.choice(sorted(w.founder))
                question, hops, answer = (f"In which city was the founder of {company} born?",
                                          [company, w.founder[company]], w.born_in[w.founder[company]])
            out.append(Task(id=f"qa-{seed}-{i}", prompt=question, answer=answer, info={"kind": kind, "hops": hops}))
        return out

    def demonstration(self, task: Task) -> list[Message]:
        """Search for each hop's entity (its own article ranks first), then answer."""
        messages: list[Message] = []
        for entity in task.info["hops"]:
            call = json.dumps({"name": "search", "arguments": {"query": entity, "k": 1}})
            messages += [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                         {"role": "tool", "content": self.search(entity, 1)}]
        return messages + [{"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]

    def score(self, task: Task, final_text: str) -> float:
        found = ANSWER_RE.findall(final_text)
        return 1.0 if found and normalize(found[-1]) == normalize(task.answer) else 0.0
