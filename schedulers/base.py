"""The policy interface: pure decision logic over a snapshot of the rollout.

A policy owns no tasks, clients or clocks. The executor (``rollopt.executor``) calls it with a
:class:`RolloutView` whenever the rollout's state changes and carries out what it decides:

* ``may_generate(view, tid)``: may trajectory ``tid`` start its next turn now? (a barrier says no until
  every live trajectory has reached the same point);
* ``may_run_tools(view, tid)``: may trajectory ``tid`` run the tool calls of the turn it just decoded?
* ``early_tool_start``: start each tool call as soon as its closing tag appears in the decode stream;
* ``shared_prefill``: prefill a shared prefix (a GRPO group's prompt, a tree fork point) once before the
  children that share it start;
* ``priority(view, tid)``: engine priority of the trajectory's next request (higher runs first);
* ``kv_pool(view, tid)``: which of the engine's KV pools (servers behind a router) the trajectory's requests run
  in, asked once each time its gate opens (default None: the engine places it);
* ``keep_warm(view, tid)``: ask the engine to keep the KV of the trajectory's next request cached this many
  seconds after it ends (or until the trajectory's next turn reuses it), so the history survives the turn's
  tool calls (default: the policy's constant ``keep_warm_s``);
* ``preempt(view)``: which running trajectories to abort now; they keep every token and are carried over;
* ``sampling(view, tid, params)``: the sampling params of the trajectory's next turn (default: unchanged).
  A policy that changes them changes what is sampled, and its risk class must say so (``rollopt validate``
  checks it).

Every policy declares its :class:`RiskClass`; a policy without one cannot be registered.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Collection, Iterable, Iterator

from rollopt.config import SamplingParams


class RiskClass(str, enum.Enum):
    """How a scheduling optimization may change learning semantics (DESIGN invariant 4)."""

    R1 = "R1"
    """Token parity: greedy output is token-identical to the synchronous baseline."""
    R2 = "R2"
    """Distribution-preserving: sampled trajectories have the baseline's distribution."""
    R3 = "R3"
    """Off-policy: tokens may come from older weight versions; the trainer must correct it and the run logs it."""


class Stage(str, enum.Enum):
    """Where a trajectory is, as a policy sees it."""

    GATE = "gate"  # waiting to start its next turn
    GENERATE = "generate"  # a request is in the engine
    TOOLS = "tools"  # its turn is decoded; tool calls are running
    DONE = "done"
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class TrajectoryView:
    id: str
    group_id: str
    turn: int
    stage: Stage
    generated_tokens: int
    carry_age: int = 0  # batches this trajectory has already been carried over
    context_tokens: int = 0  # tokens of its history so far (prompt, turns, observations)
    last_tool: str | None = None  # the tool its latest tool call named (None before any)
    kv_pool: int | None = None  # the KV pool its requests run in (``Policy.kv_pool``; None: the engine's choice)

    @property
    def started(self) -> bool:
        """Whether it has sent a request (its KV exists somewhere): past its first gate."""
        return self.turn > 0 or self.stage is not Stage.GATE

    @property
    def live(self) -> bool:
        return self.stage not in (Stage.DONE, Stage.PREEMPTED)


@dataclass
class _Tally:
    """What policies ask of a view on every state change, kept so that replacing one trajectory's entry
    updates it in O(1) Python work, instead of a pass over every trajectory. Counts are plain dicts without
    zero entries; a derived tally copies only the counts the change moves (copy on write), so views stay
    immutable snapshots."""

    positions: dict[str, int]  # trajectory id -> index; shared by the views of a batch until one is added
    group_size: dict[str, int]  # in order of first appearance; shared like ``positions``
    group_order: tuple[str, ...]  # the keys of ``group_size``; shared likewise
    live_turns: dict[int, int]  # turn -> live trajectories in it
    live_not_in_tools: dict[int, int]  # turn -> live trajectories in it not running its tools
    group_done: dict[str, int]  # group -> members done
    complete_groups: int  # groups whose members are all done
    generated_tokens: int
    active_tokens: int = 0  # context tokens of the started, live ones generating or in tools (not at a gate)
    generating: int = 0  # trajectories with a request in the engine
    generating_tokens: int = 0  # context tokens of those
    first_waiting: int = 0  # position of the first live trajectory that has not started (len: none)
    pool_active_tokens: dict[int, int] = field(default_factory=dict)  # ``active_tokens`` per placed KV pool
    pool_generating_tokens: dict[int, int] = field(default_factory=dict)  # ``generating_tokens`` per placed pool

    @classmethod
    def of(cls, entries: Sequence[TrajectoryView]) -> "_Tally":
        sizes = dict(Counter(t.group_id for t in entries))
        tally = cls({t.id: i for i, t in enumerate(entries)}, sizes, tuple(sizes), {}, {}, {}, 0,
                    sum(t.generated_tokens for t in entries))
        for t in entries:
            tally._count_footprint(t, +1)
            live_turn, not_in_tools_turn, done_group = _counted_as(t)
            if live_turn is not None:
                _bump(tally.live_turns, live_turn, +1)
            if not_in_tools_turn is not None:
                _bump(tally.live_not_in_tools, not_in_tools_turn, +1)
            if done_group is not None:
                tally._count_done(done_group, +1)
        tally.first_waiting = _first_waiting(entries, 0)
        return tally

    def replaced(self, old: TrajectoryView, new: TrajectoryView) -> "_Tally":
        (live0, tools0, done0), (live1, tools1, done1) = _counted_as(old), _counted_as(new)
        tally = _Tally(self.positions, self.group_size, self.group_order, self.live_turns, self.live_not_in_tools,
                       self.group_done, self.complete_groups,
                       self.generated_tokens - old.generated_tokens + new.generated_tokens,
                       self.active_tokens, self.generating, self.generating_tokens, self.first_waiting,
                       self.pool_active_tokens, self.pool_generating_tokens)
        if old.kv_pool is not None or new.kv_pool is not None:  # copy on write
            tally.pool_active_tokens = self.pool_active_tokens.copy()
            tally.pool_generating_tokens = self.pool_generating_tokens.copy()
        tally._count_footprint(old, -1)
        tally._count_footprint(new, +1)
        if live0 != live1:
            tally.live_turns = _moved(self.live_turns, live0, live1)
        if tools0 != tools1:
            tally.live_not_in_tools = _moved(self.live_not_in_tools, tools0, tools1)
        if done0 != done1:
            tally.group_done = self.group_done.copy()
            for group, delta in ((done0, -1), (done1, +1)):
                if group is not None:
                    tally._count_done(group, delta)
        return tally

    def _count_footprint(self, t: TrajectoryView, sign: int) -> None:
        generating = t.stage is Stage.GENERATE
        self.generating += sign * generating
        self.generating_tokens += sign * t.context_tokens * generating
        if generating or t.stage is Stage.TOOLS:  # live and started, not at a gate
            self.active_tokens += sign * t.context_tokens
            if t.kv_pool is not None:
                _bump(self.pool_active_tokens, t.kv_pool, sign * t.context_tokens)
                if generating:
                    _bump(self.pool_generating_tokens, t.kv_pool, sign * t.context_tokens)

    def _count_done(self, group: str, delta: int) -> None:
        size = self.group_size[group]
        self.complete_groups -= self.group_done.get(group, 0) == size
        _bump(self.group_done, group, delta)
        self.complete_groups += self.group_done.get(group, 0) == size


def _first_waiting(entries: Sequence[TrajectoryView], start: int) -> int:
    """The first position from ``start`` whose trajectory is live and has not started (len: none)."""
    while start < len(entries) and (entries[start].started or not entries[start].live):
        start += 1
    return start


def _counted_as(t: TrajectoryView) -> tuple[int | None, int | None, str | None]:
    """Where an entry counts: (its turn if live, its turn if live and not in tools, its group if done)."""
    if t.stage is Stage.DONE:
        return None, None, t.group_id
    if t.stage is Stage.PREEMPTED:
        return None, None, None
    return t.turn, (t.turn if t.stage is not Stage.TOOLS else None), None


def _moved(counts: dict, old_key, new_key) -> dict:
    """A copy of ``counts`` with one count moved from ``old_key`` to ``new_key`` (None: nowhere)."""
    counts = counts.copy()
    if old_key is not None:
        _bump(counts, old_key, -1)
    if new_key is not None:
        _bump(counts, new_key, +1)
    return counts


def _bump(counts: dict, key, delta: int) -> None:
    n = counts.get(key, 0) + delta
    if n:
        counts[key] = n
    else:
        del counts[key]


class Entries(Sequence):
    """A view's entries in batch order: an immutable sequence kept in chunks of :attr:`CHUNK`, so that the copy with
    one entry replaced (:meth:`replaced`) copies one chunk and the index of chunks (at 4,096 trajectories, 64 + 64
    references instead of 4,096: a flat tuple made each state change O(trajectories)). Equal to the tuple of the
    same entries. (Hand-written rather than a persistent-vector library: pyrsistent, the one on PyPI, has had no
    release since 2023, and this is all that is needed.)"""

    CHUNK = 64
    __slots__ = ("_chunks", "_len")

    def __init__(self, entries: Iterable["TrajectoryView"] = ()) -> None:
        flat = tuple(entries)
        self._chunks = tuple(flat[i:i + self.CHUNK] for i in range(0, len(flat), self.CHUNK))
        self._len = len(flat)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return tuple(self)[index]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(index)
        return self._chunks[index // self.CHUNK][index % self.CHUNK]

    def __iter__(self) -> Iterator["TrajectoryView"]:
        return itertools.chain.from_iterable(self._chunks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (Entries, tuple)) and len(self) == len(other) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Entries({tuple(self)!r})"

    def replaced(self, index: int, entry: "TrajectoryView") -> "Entries":
        """A copy with entry ``index`` replaced by ``entry``."""
        c, k = divmod(index, self.CHUNK)
        chunk = self._chunks[c]
        copy = object.__new__(Entries)
        copy._chunks = self._chunks[:c] + (chunk[:k] + (entry,) + chunk[k + 1:],) + self._chunks[c + 1:]
        copy._len = self._len
        return copy


@dataclass(frozen=True)
class RolloutView:
    """A snapshot of one batch. ``target_groups`` is how many complete groups the batch must return (None:
    all of them).

    Built once from its entries in O(n); :meth:`with_entry` derives the next snapshot after one trajectory
    changed in O(1) Python work (and a copy of one chunk of :class:`Entries`), so a policy's per-change questions
    (``view[tid]``, ``min_live_turn``, ``complete_groups()``, ``generated_tokens``) stay cheap at thousands of
    concurrent trajectories. ``trajectories`` is given as any sequence and kept as :class:`Entries`.
    """

    trajectories: Sequence[TrajectoryView]
    target_groups: int | None = None
    now: float = 0.0
    kv_tokens: int | None = None
    """The engine's KV capacity in tokens (:attr:`EngineInfo.kv_tokens`); None: not reported."""
    tool_latency: "ToolLatencies | None" = None
    """Latencies of the tool calls finished so far in this batch, per tool (None: not tracked)."""
    kv_pools: int = 1
    """How many separate KV pools ``kv_tokens`` sums (:attr:`EngineInfo.kv_pools`: servers behind a router)."""
    max_running: int | None = None
    """Requests the engine decodes at once at most (:attr:`EngineInfo.max_running`); None: not reported."""
    _tally: _Tally = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.trajectories, Entries):
            object.__setattr__(self, "trajectories", Entries(self.trajectories))
        object.__setattr__(self, "_tally", _Tally.of(self.trajectories))

    def with_entry(self, entry: TrajectoryView, now: float) -> "RolloutView":
        """This view with the entry of trajectory ``entry.id`` replaced by ``entry``, at time ``now``."""
        pos = self._tally.positions[entry.id]
        view = object.__new__(RolloutView)
        entries = self.trajectories.replaced(pos, entry)
        tally = self._tally.replaced(self.trajectories[pos], entry)
        if pos == tally.first_waiting:  # within a batch trajectories only start or end, so only the first waiting
            tally.first_waiting = _first_waiting(entries, pos)  # one's change moves it: amortized O(1) scans
        view.__dict__.update(trajectories=entries, target_groups=self.target_groups, now=now,
                             kv_tokens=self.kv_tokens, tool_latency=self.tool_latency, kv_pools=self.kv_pools,
                             max_running=self.max_running, _tally=tally)
        return view

    def __getitem__(self, tid: str) -> TrajectoryView:
        return self.trajectories[self._tally.positions[tid]]

    def __contains__(self, tid: str) -> bool:
        return tid in self._tally.positions

    @property
    def group_order(self) -> tuple[str, ...]:
        """Group ids in order of first appearance."""
        return self._tally.group_order

    @property
    def min_live_turn(self) -> int | None:
        """The earliest turn any live trajectory is in (None when none is live)."""
        return min(self._tally.live_turns, default=None)

    def live_not_in_tools(self, turn: int) -> int:
        """How many live trajectories are in ``turn`` and not running its tools."""
        return self._tally.live_not_in_tools.get(turn, 0)

    def group_complete(self, group: str) -> bool:
        """Whether every member of ``group`` is done."""
        return self._tally.group_done.get(group, 0) == self._tally.group_size[group]

    @property
    def num_complete_groups(self) -> int:
        """How many groups have all their members done (O(1))."""
        return self._tally.complete_groups

    def complete_groups(self) -> list[str]:
        """Groups whose members are all done, in order of first appearance."""
        return [g for g in self._tally.group_order if self.group_complete(g)]

    @property
    def generated_tokens(self) -> int:
        return self._tally.generated_tokens

    @property
    def active_tokens(self) -> int:
        """Context tokens of the started, live trajectories that are generating or running tools, summed: the KV
        in use now (a started trajectory held at its gate is not counted; O(1))."""
        return self._tally.active_tokens

    @property
    def first_waiting(self) -> str | None:
        """The first trajectory, in batch order, that is live and has not started (None: none); amortized O(1)."""
        pos = self._tally.first_waiting
        return self.trajectories[pos].id if pos < len(self.trajectories) else None

    @property
    def generating(self) -> int:
        """Trajectories with a request in the engine (O(1))."""
        return self._tally.generating

    @property
    def generating_tokens(self) -> int:
        """Context tokens of the trajectories with a request in the engine, summed: the KV decoding now (O(1))."""
        return self._tally.generating_tokens

    def pool_active_tokens(self, pool: int) -> int:
        """:attr:`active_tokens` of the trajectories placed in KV pool ``pool`` (``TrajectoryView.kv_pool``; O(1))."""
        return self._tally.pool_active_tokens.get(pool, 0)

    def pool_generating_tokens(self, pool: int) -> int:
        """:attr:`generating_tokens` of the trajectories placed in KV pool ``pool`` (O(1))."""
        return self._tally.pool_generating_tokens.get(pool, 0)



class ToolLatencies:
    """Latencies of finished tool calls, per tool, learned online (the executor records; policies read).
    Keeps the last ``window`` per tool; quantiles are computed over them when asked."""

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self._seen: dict[str, list[float]] = {}
        self._next: dict[str, int] = {}

    def record(self, tool: str, seconds: float) -> None:
        seen = self._seen.setdefault(tool, [])
        if len(seen) < self.window:
            seen.append(seconds)
        else:
            i = self._next.get(tool, 0)
            seen[i] = seconds
            self._next[tool] = (i + 1) % self.window

    def count(self, tool: str | None = None) -> int:
        """Calls recorded for ``tool`` (None: every tool), up to the window."""
        return len(self._seen.get(tool, ())) if tool is not None else sum(map(len, self._seen.values()))

    def quantile(self, q: float, tool: str | None = None) -> float | None:
        """The ``q`` quantile of ``tool``'s recorded latencies (None: over every tool); None before any."""
        values = self._seen.get(tool, []) if tool is not None else [v for vs in self._seen.values() for v in vs]
        if not values:
            return None
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]


class Policy:
    """Base class: the defaults are per-trajectory asynchrony with nothing else (each hook is neutral)."""

    name: ClassVar[str] = ""
    risk_class: ClassVar[RiskClass | None] = None
    early_tool_start: ClassVar[bool] = False
    shared_prefill: ClassVar[bool] = False
    barrier: ClassVar[bool] = False
    keep_warm_s: float = 0.0

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        return True

    def may_run_tools(self, view: RolloutView, tid: str) -> bool:
        return True

    def admission_candidates(self, view: RolloutView, not_started: Collection[str]) -> Iterable[str]:
        """Of the trajectories waiting at ``may_generate`` that have not started, those whose gate may be open
        now (a superset; default: all of them). The executor re-checks only these after a state change, so a
        policy that admits in a fixed order returns just the next one and a change costs O(1), not O(waiting)."""
        return not_started

    def resume_candidates(self, view: RolloutView, paused: Collection[str]) -> Iterable[str]:
        """Of the started trajectories waiting at ``may_generate`` (held between turns), those whose gate may be
        open now (a superset; default: all of them). Like :meth:`admission_candidates`: a policy that resumes held
        trajectories in an order returns just the next one, and a change costs O(1), not O(held)."""
        return paused

    def priority(self, view: RolloutView, tid: str) -> int:
        return 0

    def kv_pool(self, view: RolloutView, tid: str) -> int | None:
        """The KV pool (of ``view.kv_pools``: servers behind a router) trajectory ``tid``'s requests run in until
        its gate next opens; asked once as it passes ``may_generate``. None (the default): the engine places it."""
        return None

    def keep_warm(self, view: RolloutView, tid: str) -> float:
        return self.keep_warm_s

    def preempt(self, view: RolloutView) -> set[str]:
        return set()

    def sampling(self, view: RolloutView, tid: str, params: SamplingParams) -> SamplingParams:
        return params

    @property
    def preempts(self) -> bool:
        """Whether this policy can preempt at all (it defines ``preempt``); if not, the executor neither asks
        it on every state change nor pays for cancel scopes around tool calls."""
        return _overrides(self, "preempt")

    def describe(self) -> str:
        return f"{self.name} ({self.risk_class.value if self.risk_class else 'no risk class'})"


_RISK_ORDER = [RiskClass.R1, RiskClass.R2, RiskClass.R3]


def _overrides(policy: Policy, hook: str) -> bool:
    """Whether ``policy`` defines ``hook`` itself (a part that keeps the neutral default need not be asked)."""
    return getattr(type(policy), hook) is not getattr(Policy, hook)


class CompositePolicy(Policy):
    """Several policies at once: gates are AND-ed, flags OR-ed, priorities summed, preemptions united; the
    risk class is the most permissive of the parts. Each hook asks only the parts that define it, since the
    executor calls the hooks on every state change."""

    def __init__(self, parts: list[Policy]) -> None:
        self.parts = parts
        self.name = "+".join(p.name for p in parts)  # type: ignore[misc]
        self.risk_class = max((p.risk_class for p in parts), key=_RISK_ORDER.index)  # type: ignore[misc]
        self.early_tool_start = any(p.early_tool_start for p in parts)  # type: ignore[misc]
        self.shared_prefill = any(p.shared_prefill for p in parts)  # type: ignore[misc]
        self.barrier = any(p.barrier for p in parts)  # type: ignore[misc]
        self.keep_warm_s = max(p.keep_warm_s for p in parts)
        self._asked = {hook: [p for p in parts if _overrides(p, hook)]
                       for hook in ("may_generate", "may_run_tools", "admission_candidates", "resume_candidates",
                                    "priority", "kv_pool", "keep_warm",
                                    "preempt", "sampling")}

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        return all(p.may_generate(view, tid) for p in self._asked["may_generate"])

    def may_run_tools(self, view: RolloutView, tid: str) -> bool:
        return all(p.may_run_tools(view, tid) for p in self._asked["may_run_tools"])

    def admission_candidates(self, view: RolloutView, not_started: Collection[str]) -> Iterable[str]:
        """Each part narrows what the previous one left (gates are AND-ed: open for all parts ⊆ every part's)."""
        for p in self._asked["admission_candidates"]:
            not_started = list(p.admission_candidates(view, not_started))
        return not_started

    def resume_candidates(self, view: RolloutView, paused: Collection[str]) -> Iterable[str]:
        """Narrowed part by part, as :meth:`admission_candidates`."""
        for p in self._asked["resume_candidates"]:
            paused = list(p.resume_candidates(view, paused))
        return paused

    def priority(self, view: RolloutView, tid: str) -> int:
        return sum(p.priority(view, tid) for p in self._asked["priority"])

    def kv_pool(self, view: RolloutView, tid: str) -> int | None:
        """The first part's placement that names one."""
        return next((pool for p in self._asked["kv_pool"] if (pool := p.kv_pool(view, tid)) is not None), None)

    def keep_warm(self, view: RolloutView, tid: str) -> float:
        return max([self.keep_warm_s, *(p.keep_warm(view, tid) for p in self._asked["keep_warm"])])

    @property
    def preempts(self) -> bool:
        return bool(self._asked["preempt"])

    def preempt(self, view: RolloutView) -> set[str]:
        asked = self._asked["preempt"]
        return asked[0].preempt(view) if len(asked) == 1 else set().union(*(p.preempt(view) for p in asked))

    def sampling(self, view: RolloutView, tid: str, params: SamplingParams) -> SamplingParams:
        for p in self._asked["sampling"]:
            params = p.sampling(view, tid, params)
        return params
