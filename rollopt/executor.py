"""The executor: runs a batch of episodes against an engine under a scheduling policy, and does all the I/O.

Each trajectory is one task in an anyio task group, driven through the stages GATE → GENERATE → TOOLS →
(GATE of the next turn | DONE). At each GATE it waits until the policy's ``may_generate`` says go; every
state change re-evaluates the gates and the policy's ``preempt``. The policy itself (``rollopt.schedulers``)
is pure decision logic.

Guarantees (tests check each):

* **Every token is kept exactly once.** Streamed tokens are buffered and appended to the trajectory when the
  request ends, however it ends (finished, aborted, failed, cancelled). A preempted turn resumes with the
  trajectory's tokens as the prompt and the remaining ``max_new_tokens``; an abort the policy did not ask
  for (e.g. the engine paused for a weight update) is resumed at once.
* **Failures are data.** An engine failure fails only its trajectory (with its partial tokens); an
  environment that raises fails only its trajectory; tool failures are typed records in the turn.
* **Conservation.** Every trajectory a call starts (from a spec or by a fork) is returned by exactly one call
  or waits in the carry-over (:class:`~rollopt.episodes.CarryOver`, :attr:`RolloutExecutor.carry`): whole
  groups that were complete beyond the call's quota, and groups with preempted members. The next call
  returns the carried complete groups first, and they count toward its quota; preempted members resume
  first. ``carry_age`` grows by one per call, and the preempt policy exempts any at its ``max_carry_age``, so
  the buffer is bounded in age; callers bound its size by adding fewer new groups while it holds some
  (``rollopt.trainer.loop`` adds ``tasks_per_step + extra_groups − carried groups``).
* **Every dispatched step is one graph node** with start/end times (``RolloutResult.graph``); a ``generate``
  node also records ``first_token``, when its first token arrived, and a suspension is a ``preempted`` mark.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import anyio

from rollopt import seeds
from rollopt.chat import ChatRenderer
from rollopt.engines.base import Engine, EngineFailure, EngineInfo, FinishReason, GenerateRequest, SamplingParams
from rollopt.episodes import CarriedTrajectory, CarryOver, EpisodeSpec, episode_specs
from rollopt.errors import ConfigError, EngineError, ErrorRecord
from rollopt.graph import RolloutGraph
from rollopt.schedulers import Policy, RolloutView, Stage, ToolLatencies, TrajectoryView, build_scheduler
from rollopt.step import Environment, EpisodeContext, ToolContext, accepts_context, execute_tool_call
from rollopt.toolcalls import CLOSE_TAG, ParsedTurn, ToolCallStream
from rollopt.trajectory import Status, TokenSpan, ToolCall, ToolResult, Trajectory, Turn

MAX_RESUBMITS = 8
"""How many unrequested aborts (engine pauses) one turn survives before its trajectory ends as aborted."""


def request_id(trajectory_id: str, turn: int, segment: int) -> str:
    """The engine request id of a trajectory's turn and segment (a preempted turn resumes as a new segment):
    ``{trajectory}.t{turn}.r{segment}``, never a prefix of another live one (SGLang's requirement)."""
    return f"{trajectory_id}.t{turn}.r{segment}"


def parse_request_id(rid: str) -> tuple[str, int, int] | None:
    """``(trajectory id, turn, segment)`` of a turn's request id (:func:`request_id`); None for any other id
    (a shared-prefix prefill, an engine calibration request). A simulated engine's script reads it."""
    head, _, segment = rid.rpartition(".r")
    trajectory, _, turn = head.rpartition(".t")
    if not (trajectory and turn.isdigit() and segment.isdigit()):
        return None
    return trajectory, int(turn), int(segment)


@dataclass(eq=False)
class TrajectoryRun:
    """The executor's mutable state of one trajectory (exported between calls as a
    :class:`~rollopt.episodes.CarriedTrajectory`)."""

    spec: EpisodeSpec
    traj: Trajectory
    turn: int = 0
    stage: Stage = Stage.GATE
    carry_age: int = 0
    turn_start: int | None = None  # offset of the current turn's first generated token, while it is open
    segments: int = 0  # engine requests used by the current turn
    pending: ParsedTurn | None = None  # a decoded turn whose tools still have to run
    preempt_requested: bool = False
    suspended: bool = False  # preempted in this batch, waiting in the carry-over buffer
    rid: str | None = None
    last_node: str | None = None
    last_tool: str | None = None  # the tool its latest call named
    kv_pool: int | None = None  # where its requests run (``Policy.kv_pool``, asked as its gate opens)
    tool_scopes: list[anyio.CancelScope] = field(default_factory=list)
    early_tools: dict[str, "_ToolSlot"] = field(default_factory=dict)  # started while the turn decoded
    _view: tuple[tuple, TrajectoryView] | None = field(default=None, repr=False, compare=False)

    @property
    def id(self) -> str:
        return self.traj.id

    def carried(self) -> CarriedTrajectory:
        """This trajectory as a carry-over record (it shares the trajectory object; see :meth:`CarryOver.copy`)."""
        return CarriedTrajectory(self.spec, self.traj, self.stage.value, self.turn, self.carry_age, self.turn_start,
                                 self.segments, self.pending)

    @classmethod
    def resumed(cls, record: CarriedTrajectory) -> "TrajectoryRun":
        return cls(spec=record.spec, traj=record.trajectory, turn=record.turn, stage=Stage(record.stage),
                   carry_age=record.carry_age, turn_start=record.turn_start, segments=record.segments,
                   pending=record.pending)

    def view(self) -> TrajectoryView:
        """The policy's view of this trajectory; rebuilt only when what it shows changed (the executor asks
        for every trajectory's view after each state change of any one of them)."""
        key = (self.turn, self.stage, self.suspended, self.carry_age, len(self.traj), self.last_tool, self.kv_pool)
        if self._view is None or self._view[0] != key:
            stage = Stage.PREEMPTED if self.suspended else self.stage
            self._view = (key, TrajectoryView(self.id, self.traj.group_id, self.turn, stage, self.traj.num_generated,
                                              self.carry_age, len(self.traj), self.last_tool, self.kv_pool))
        return self._view[1]


@dataclass(eq=False)
class _ToolSlot:
    call: ToolCall
    done: anyio.Event = field(default_factory=anyio.Event)
    result: ToolResult | None = None


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]  # every trajectory of the returned (complete) groups
    graph: RolloutGraph
    wall_s: float
    carried_over: int  # trajectories left in the executor's carry-over buffer
    preempted: int  # trajectories preempted in this batch
    tokens_streamed: int  # generated tokens received from the engine in this batch
    started: tuple[str, ...] = ()  # trajectories this call started: one per spec, plus every fork's clones
    carried_groups: int = 0  # groups in the carry-over buffer
    carried_age_max: int = 0  # the largest carry_age in the buffer (calls a trajectory has waited)


class RolloutExecutor:
    """Runs batches of episodes; keeps the carry-over buffer between batches (:attr:`carry`)."""

    def __init__(self, env: Environment, engine: Engine, renderer: ChatRenderer, policy: Policy | str = "overlap",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.env, self.engine, self.renderer = env, engine, renderer
        self.policy = build_scheduler(policy) if isinstance(policy, str) else policy
        self._preempts = self.policy.preempts  # asked on every state change: a policy that cannot is not asked
        self.clock = clock
        self._carry: list[TrajectoryRun] = []
        self._tools = env.tools()
        self._tool_schemas = env.prompt_tool_schemas()

    # ------------------------------------------------------------------------------------------ carry-over
    @property
    def carry(self) -> CarryOver:
        """An independent snapshot of the carry-over buffer (safe to keep while later calls run)."""
        return CarryOver(tuple(r.carried() for r in self._carry)).copy()

    @property
    def carried_groups(self) -> int:
        """How many groups the carry-over buffer holds (what the next call returns or resumes first)."""
        return len({r.traj.group_id for r in self._carry})

    def restore_carry(self, carry: CarryOver) -> None:
        """Replace the buffer with ``carry`` (e.g. from a checkpoint); the next :meth:`run` resumes it."""
        self._carry = [TrajectoryRun.resumed(record) for record in carry.copy()]

    # ------------------------------------------------------------------------------------------ batch
    async def run(self, specs: Sequence[EpisodeSpec], target_groups: int | None = None) -> RolloutResult:
        """Run carried-over trajectories and ``specs``; return once ``target_groups`` groups (default: all)
        are complete and every other trajectory is done or preempted.

        Carried groups that are already complete come back first and count toward ``target_groups``; the
        groups not returned (complete beyond the quota, or with preempted members) stay in :attr:`carry`."""
        _check_ids(self._carry, specs)
        batch = _Batch(self, target_groups, await self.engine.info())
        carried, self._carry = self._carry, []
        try:
            return await batch.run(carried, specs)
        finally:
            self._carry = batch.leftover if batch.done else carried  # a failed call keeps what it was given


class _Batch:
    """One call of :meth:`RolloutExecutor.run`: the trajectories it drives and the state that lives only while
    it runs (graph, snapshot, gates, shared prefills, counters, task group). The executor keeps nothing of it
    but the trajectories it did not return."""

    def __init__(self, executor: RolloutExecutor, target_groups: int | None, info: EngineInfo) -> None:
        self.env, self.engine, self.renderer, self.policy = (executor.env, executor.engine, executor.renderer,
                                                             executor.policy)
        self._preempts, self.clock = executor._preempts, executor.clock
        self._tools, self._tool_schemas = executor._tools, executor._tool_schemas
        self._step_ctx, self._score_ctx = accepts_context(self.env.step), accepts_context(self.env.score)
        self._sampling_ctx = accepts_context(self.env.turn_sampling)
        self._calls_ctx = accepts_context(self.env.calls_for_turn)
        self._graph, self._t0 = RolloutGraph(), self.clock()
        self._target = target_groups
        self._max_context, self._kv_tokens, self._kv_pools = info.max_context, info.kv_tokens, info.kv_pools
        self._max_running = info.max_running
        self._tool_latency = ToolLatencies()
        self._changed: anyio.Event | None = None  # set on the next state change; made only when a gate waits
        # trajectories waiting at may_generate, each woken by its own event only when the policy's
        # admission_candidates (not started yet) or resume_candidates (started) names them
        self._admission_waiters: dict[str, anyio.Event] = {}
        self._started_waiters: dict[str, anyio.Event] = {}
        self._view: RolloutView | None = None
        self._prefills: dict[tuple, anyio.Event | None] = {}  # shared prefix -> its prefill (None: not shared)
        self._sharers: Counter[tuple | None] | None = None  # trajectories per prefix key; None: count again
        self._streamed, self._preempted = 0, 0
        self._runs: list[TrajectoryRun] = []
        self._started: list[str] = []
        self._completion_order: list[str] = []
        self.leftover: list[TrajectoryRun] = []  # what the executor carries over (set when the batch ends)
        self.done = False

    async def run(self, carried: list[TrajectoryRun], specs: Sequence[EpisodeSpec]) -> RolloutResult:
        for run in carried:
            run.carry_age += 1
            run.preempt_requested = run.suspended = False
            run.last_node = self._graph.add("prompt", run.id, start=self._now(), resumed=True)
            self._graph.finish(run.last_node, self._now())
        prompts: dict[str, TokenSpan] = {}  # rendered once per distinct initial conversation (a GRPO group's)
        self._runs = carried + [self._start(spec, prompts) for spec in specs]
        # groups already complete (carried over, or every member failed its reset) lead the completion order:
        # returned first, counted toward the quota
        pending = {r.traj.group_id for r in self._runs if r.stage is not Stage.DONE}
        self._completion_order = list(dict.fromkeys(r.traj.group_id for r in self._runs
                                                    if r.traj.group_id not in pending))
        self._started = [spec.trajectory_id for spec in specs]
        async with anyio.create_task_group() as self._tg:
            for run in list(self._runs):
                if run.stage is not Stage.DONE:
                    self._tg.start_soon(self._drive, run)
        return self._collect()

    def _collect(self) -> RolloutResult:
        groups: dict[str, list[TrajectoryRun]] = {}
        for run in self._runs:
            groups.setdefault(run.traj.group_id, []).append(run)
        complete = [g for g in self._completion_order if all(r.stage is Stage.DONE for r in groups[g])]
        returned = complete if self._target is None else complete[: self._target]
        out = [r.traj for g in returned for r in groups[g]]
        returned = set(returned)
        self.leftover = [r for g, members in groups.items() if g not in returned for r in members]
        self.done = True
        end = self._now()
        self._graph.close(end)
        return RolloutResult(out, self._graph, end, len(self.leftover), self._preempted, self._streamed,
                             started=tuple(self._started), carried_groups=len(groups) - len(returned),
                             carried_age_max=max((r.carry_age for r in self.leftover), default=0))

    def _start(self, spec: EpisodeSpec, prompts: dict[str, TokenSpan]) -> TrajectoryRun:
        """A new trajectory with its rendered prompt. An environment whose ``reset`` (or a prompt that cannot
        be rendered) raises fails this trajectory alone, as data: it starts done, with no tokens and an ``env``
        error record, and its group is returned (and dropped by the trainer) like any failed group."""
        try:
            messages = self.env.reset(spec.task)
            key = json.dumps(messages, sort_keys=True, default=repr)
            if key not in prompts:
                prompts[key] = TokenSpan.prompt(self.renderer.prompt(messages, self._tool_schemas))
            prompt = prompts[key]
        except Exception as exc:
            traj = Trajectory.start(spec.trajectory_id, spec.task.id, spec.group_id, ())
            traj.finish(Status.FAILED, ErrorRecord.from_exception("env", exc, hook="reset", task=spec.task.id))
            run = TrajectoryRun(spec=spec, traj=traj, stage=Stage.DONE)
            run.last_node = self._graph.add("prompt", run.id, start=self._now(), tokens=0)
            self._graph.finish(run.last_node, self._now(), status="error", error="env")
            return run
        traj = Trajectory.start(spec.trajectory_id, spec.task.id, spec.group_id, prompt)
        run = TrajectoryRun(spec=spec, traj=traj)
        run.last_node = self._graph.add("prompt", run.id, start=self._now(), tokens=len(prompt))
        self._graph.finish(run.last_node, self._now())
        return run

    def _now(self) -> float:
        return self.clock() - self._t0

    @staticmethod
    def _context(run: TrajectoryRun, accepted: bool) -> dict[str, EpisodeContext]:
        """The ``context`` keyword for an environment hook that takes it (none for one that does not)."""
        return {"context": EpisodeContext(run.id, run.spec.task, run.turn, run.traj)} if accepted else {}

    # ------------------------------------------------------------------------------------------ state
    def view(self) -> RolloutView:
        """The policy's snapshot; rebuilt after each state change (token counts may lag by one change)."""
        if self._view is None:
            self._view = RolloutView(tuple(r.view() for r in self._runs), self._target, self._now(), self._kv_tokens,
                                     self._tool_latency, self._kv_pools, self._max_running)
        return self._view

    def _notify(self, changed: TrajectoryRun) -> None:
        """``changed`` changed state: wake the gates and let the policy preempt.

        Every change of a trajectory's state is followed by a notify naming it, so the next snapshot is the
        last one with only that trajectory's entry replaced (:meth:`RolloutView.with_entry`): the cost of a
        change stays O(1) in Python work at hundreds of concurrent trajectories. A new trajectory (a fork)
        rebuilds the snapshot.
        """
        old = self._view
        self._view = old.with_entry(changed.view(), self._now()) if old is not None and changed.id in old else None
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        self._wake_gate_waiters()
        for tid in self.policy.preempt(self.view()) if self._preempts else ():
            run = next(r for r in self._runs if r.id == tid)
            if run.preempt_requested or run.stage is Stage.DONE:
                continue
            run.preempt_requested = True
            for waiters in (self._admission_waiters, self._started_waiters):
                if (event := waiters.pop(tid, None)) is not None:
                    event.set()
            if run.rid is not None:
                self._tg.start_soon(self.engine.abort, run.rid)
            for scope in run.tool_scopes:
                scope.cancel()

    def _wake_gate_waiters(self) -> None:
        """Wake the may_generate waiters whose gate may have opened: those the policy's ``admission_candidates``
        (not started) and ``resume_candidates`` (started) name (O(1) for a policy that admits and resumes in an
        order; waking thousands of waiters on every change made a 4,096-trajectory rollout quadratic)."""
        for waiters, candidates in ((self._admission_waiters, self.policy.admission_candidates),
                                    (self._started_waiters, self.policy.resume_candidates)):
            if waiters:
                for tid in list(candidates(self.view(), waiters.keys())):
                    if (event := waiters.pop(tid, None)) is not None:
                        event.set()

    async def _wait_to_generate(self, run: TrajectoryRun) -> None:
        """Wait until ``may_generate`` opens for ``run`` (re-checked when :meth:`_wake_gate_waiters` wakes it)
        or it is preempted."""
        while not (run.preempt_requested or self.policy.may_generate(self.view(), run.id)):
            waiters = self._started_waiters if self.view()[run.id].started else self._admission_waiters
            waiters[run.id] = event = anyio.Event()
            try:
                await event.wait()
            finally:
                waiters.pop(run.id, None)

    async def _wait_until(self, run: TrajectoryRun, gate: Callable[[RolloutView, str], bool]) -> None:
        """Wait until ``gate`` opens for ``run`` (re-checked on every state change) or it is preempted."""
        while not (run.preempt_requested or gate(self.view(), run.id)):
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _set_stage(self, run: TrajectoryRun, stage: Stage) -> None:
        run.stage = stage
        self._notify(run)
        group = run.traj.group_id
        if stage is Stage.DONE and group not in self._completion_order and self.view().group_complete(group):
            self._completion_order.append(group)

    # ------------------------------------------------------------------------------------------ driver
    async def _drive(self, run: TrajectoryRun) -> None:
        while run.stage is not Stage.DONE:
            if run.stage is Stage.GATE:
                self._set_stage(run, Stage.GATE)
                await self._wait_to_generate(run)
                if run.preempt_requested:
                    return self._suspend(run)
                run.kv_pool = self.policy.kv_pool(self.view(), run.id)  # counted there from the next notify on
                await self._shared_prefill(run)
                self._set_stage(run, Stage.GENERATE)
            if run.stage is Stage.GENERATE:
                if not await self._generate(run):
                    return self._suspend(run)
            if run.stage is Stage.TOOLS:
                if not await self._tools_and_step(run):
                    return self._suspend(run)
        try:
            await self.env.close_episode(run.id)  # the episode ended: its tools' per-episode state goes
        except Exception as exc:  # the contract says it must not raise; the episode's data stands, noted
            run.traj.metadata["close_episode_error"] = ErrorRecord.from_exception("env", exc, hook="close_episode")

    def _fail_env(self, run: TrajectoryRun, exc: Exception, hook: str) -> bool:
        """An environment hook raised: this episode fails as data (its tokens stay), the batch goes on."""
        self._end(run, Status.FAILED, ErrorRecord.from_exception("env", exc, hook=hook, turn=run.turn))
        return True

    def _suspend(self, run: TrajectoryRun) -> None:
        self._preempted += 1
        self._graph.mark(run.id, "preempted", self._now())
        run.suspended = True
        run.rid = None
        run.early_tools.clear()
        self._notify(run)

    def _end(self, run: TrajectoryRun, status: Status, error: ErrorRecord | None = None) -> None:
        run.traj.finish(status, error)
        node = self._graph.add("reward", run.id, after=run.last_node, start=self._now(), reward=run.traj.reward)
        self._graph.finish(node, self._now(), status=status.value)
        run.turn_start = None
        self._set_stage(run, Stage.DONE)

    async def _shared_prefill(self, run: TrajectoryRun) -> None:
        """``shared_prefill`` policies: the first member of a group (or fork) to reach its first turn prefills
        the shared prefix once; the others wait for it, then find it in the prefix cache."""
        if not self.policy.shared_prefill or run.turn_start is not None:
            return
        key = self._prefix_key(run)
        if key is None:
            return
        if key in self._prefills:
            if (pending := self._prefills[key]) is not None:
                await pending.wait()
            return
        if self._sharers is None:  # one pass over the batch, again only after a fork added trajectories
            self._sharers = Counter(self._prefix_key(r) for r in self._runs)
        if self._sharers[key] < 2:
            self._prefills[key] = None
            return
        done = self._prefills[key] = anyio.Event()
        node = self._graph.add("prefill", run.id, after=run.last_node, start=self._now(), tokens=len(run.traj))
        try:
            result = await self.engine.generate(GenerateRequest(f"{run.id}.prefill{run.turn}",
                                                                tuple(run.traj.token_ids.tolist()),
                                                                SamplingParams(max_new_tokens=0),
                                                                affinity=run.traj.group_id, kv_pool=run.kv_pool))
            self._graph.finish(node, self._now(), cached_tokens=result.cached_tokens)
        except EngineError as exc:  # only an optimization failed: the children prefill themselves
            self._graph.finish(node, self._now(), status="error", error=str(exc))
        finally:
            done.set()

    @staticmethod
    def _prefix_key(run: TrajectoryRun) -> tuple | None:
        """What ``run``'s next turn shares with others: its group's prompt (turn 0) or its fork point."""
        if run.turn == 0:
            return ("prompt", run.traj.group_id)
        fork = run.traj.metadata.get("fork_point")
        return ("fork", fork) if fork is not None and fork[1] == run.turn - 1 else None

    async def _generate(self, run: TrajectoryRun) -> bool:
        """Decode (or resume) the current turn. Returns False if the trajectory was preempted."""
        traj = run.traj
        try:
            turn_sampling = self.env.turn_sampling(run.spec.task, run.turn, run.spec.sampling,
                                                   **self._context(run, self._sampling_ctx))
        except Exception as exc:
            return self._fail_env(run, exc, "turn_sampling")
        sampling = self.policy.sampling(self.view(), run.id, turn_sampling)
        if run.turn_start is None:
            run.turn_start, run.segments = len(traj), 0
        run.suspended = False
        parser = ToolCallStream(id_prefix=f"{run.id}.t{run.turn}.c") if self.policy.early_tool_start else None
        # the engine may hold back every token but the first and, when tools start early, those that may
        # close a tool call: the trajectory's task then wakes a few times per turn, not once per token
        closers = self.renderer.ids_containing(CLOSE_TAG[-1]) if parser is not None else frozenset()
        fed = 0
        already = len(traj) - run.turn_start
        room = min(sampling.max_new_tokens - already, self._max_context - len(traj))
        if room < 1:
            return self._close_turn(run, FinishReason.LENGTH)
        while True:
            seed = seeds.request_seed(sampling.seed, run.turn, run.segments)
            request = GenerateRequest(request_id(traj.id, run.turn, run.segments), tuple(traj.token_ids.tolist()),
                                      replace(sampling, max_new_tokens=room, seed=seed),
                                      priority=self.policy.priority(self.view(), run.id), affinity=traj.group_id,
                                      kv_pool=run.kv_pool,
                                      keep_warm_s=self.policy.keep_warm(self.view(), run.id),
                                      stream_tokens=closers)
            run.segments += 1
            run.rid = request.rid
            node = self._graph.add("generate", run.id, after=run.last_node, start=self._now(), turn=run.turn,
                                   segment=run.segments - 1, prompt_tokens=len(request.input_ids))
            ids: list[int] = []
            lps: list[float] = []
            vers: list[int] = []
            result, failure, first_token = None, None, None
            try:
                async for chunk in self.engine.stream(request):
                    if chunk.token_ids and first_token is None:
                        first_token = self._now()  # when the first token reached the executor
                    ids += chunk.token_ids
                    lps += chunk.logprobs
                    vers += chunk.versions
                    if chunk.result is not None:
                        result = chunk.result
                    if parser is not None and not closers.isdisjoint(chunk.token_ids):  # a call may have closed
                        fed = self._start_early_tools(run, parser, fed, traj.token_ids[run.turn_start:].tolist() + ids)
            except EngineError as exc:
                failure = exc
            finally:
                self._streamed += len(ids)
                if ids:  # every streamed token is kept, however the request ended
                    traj.append(TokenSpan.generated(ids, lps, vers))
                run.rid = None
            if failure is not None:
                self._graph.finish(node, self._now(), status="error", tokens=len(ids), first_token=first_token)
                return self._fail_engine(run, failure, streamed=len(ids))
            assert result is not None
            self._graph.finish(node, self._now(), status=result.finish_reason.value, tokens=len(ids),
                               cached_tokens=result.cached_tokens, first_token=first_token)
            run.last_node = node
            if result.finish_reason is not FinishReason.ABORT:
                return self._close_turn(run, result.finish_reason)
            if run.preempt_requested:
                return False
            if run.segments > MAX_RESUBMITS:
                self._close_turn(run, FinishReason.ABORT)
                return True
            room -= len(ids)  # an abort we did not ask for (engine paused): resume at once

    def _start_early_tools(self, run: TrajectoryRun, parser: ToolCallStream, fed: int, turn_ids: list[int]) -> int:
        """Feed the turn's text so far to the parser; start each call whose closing tag just appeared."""
        text = self.renderer.decode(turn_ids)
        if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            text = text[:-1]
        for item in parser.feed(text[fed:]):
            if isinstance(item, ToolCall) and item.id not in run.early_tools:
                slot = run.early_tools[item.id] = _ToolSlot(item)
                self._tg.start_soon(self._early_tool, run, slot)
        return len(text)

    async def _early_tool(self, run: TrajectoryRun, slot: _ToolSlot) -> None:
        try:
            with anyio.CancelScope() as scope:
                run.tool_scopes.append(scope)
                slot.result = await self._execute(run, slot.call)
        finally:
            slot.done.set()

    async def _execute(self, run: TrajectoryRun, call: ToolCall) -> ToolResult:
        started = self._now()
        node = self._graph.add("tool", run.id, after=run.last_node, start=started, tool=call.name, call=call.id)
        try:
            result = await execute_tool_call(self._tools, call, context=ToolContext(run.id, run.spec.task))
        except BaseException:
            self._graph.finish(node, self._now(), status="cancelled")
            raise
        self._graph.finish(node, self._now(), status="ok" if result.ok else "error",
                           error=result.error.kind if result.error else "")
        self._tool_latency.record(call.name, self._now() - started)
        run.last_tool = call.name
        return result

    def _fail_engine(self, run: TrajectoryRun, exc: EngineError, streamed: int) -> bool:
        """Fail the trajectory, keeping its tokens. The ``streamed`` tokens of the failed request are already
        appended; an :class:`EngineFailure`'s ``partial`` holds the request's whole output, so only tokens
        beyond ``streamed`` are added (none are duplicated)."""
        partial = exc.partial if isinstance(exc, EngineFailure) else None
        if partial is not None and len(partial.output_ids) > streamed:
            extra = slice(streamed, len(partial.output_ids))
            run.traj.append(TokenSpan.generated(partial.output_ids[extra], partial.logprobs[extra],
                                                partial.versions[extra]))
        self._record_turn(run, "abort")
        self._end(run, Status.FAILED, ErrorRecord.from_exception("engine", exc, turn=run.turn))
        return True

    def _record_turn(self, run: TrajectoryRun, finish_reason: str) -> ParsedTurn:
        start = run.turn_start if run.turn_start is not None else len(run.traj)
        ids = run.traj.token_ids[start:].tolist()
        stream = ToolCallStream(id_prefix=f"{run.id}.t{run.turn}.c")
        stream.feed(self.renderer.decode(ids))
        parsed = stream.close()
        run.traj.turns.append(Turn(index=run.turn, gen_start=start, gen_end=len(run.traj), finish_reason=finish_reason,
                                   text=parsed.content, tool_calls=parsed.tool_calls, parse_errors=parsed.errors))
        return parsed

    def _close_turn(self, run: TrajectoryRun, reason: FinishReason) -> bool:
        parsed = self._record_turn(run, reason.value)
        if reason is FinishReason.ABORT:
            self._end(run, Status.ABORTED)
        elif reason is FinishReason.LENGTH and ((self.env.end_on_truncated_turn and not self.env.plans_calls)
                                                or len(run.traj) >= self._max_context):
            # a turn cut by max_new_tokens (unless the environment decides or plans it) or by the context ends
            # the episode
            try:
                run.traj.reward = self.env.score(run.spec.task, parsed.content, **self._context(run, self._score_ctx))
            except Exception as exc:
                return self._fail_env(run, exc, "score")
            self._end(run, Status.TRUNCATED)
        else:
            run.pending = parsed
            self._set_stage(run, Stage.TOOLS)
        return True

    async def _run_tools(self, run: TrajectoryRun, calls: list[ToolCall]) -> list[ToolResult]:
        """Every call of the turn, concurrently; calls started early are awaited, not run twice."""
        results: dict[str, ToolResult] = {}

        async def one(call: ToolCall) -> None:
            slot = run.early_tools.get(call.id)
            if slot is not None and slot.call == call:
                await slot.done.wait()
                if slot.result is not None:
                    results[call.id] = slot.result
                    return
            results[call.id] = await self._execute(run, call)

        async def every() -> None:
            if len(calls) == 1:  # the common case needs no task group
                await one(calls[0])
            elif calls:
                async with anyio.create_task_group() as tg:
                    for call in calls:
                        tg.start_soon(one, call)

        preempted = False
        if calls and self._preempts:  # a preemption cancels the calls through this scope
            with anyio.CancelScope() as scope:
                run.tool_scopes.append(scope)
                await every()
            run.tool_scopes.clear()
            preempted = scope.cancelled_caught
        else:
            await every()
        run.early_tools.clear()
        return [] if preempted else [results[c.id] for c in calls]

    async def _tools_and_step(self, run: TrajectoryRun) -> bool:
        """Run the decoded turn's tools, then the environment's step. Returns False if preempted."""
        parsed, turn = run.pending, run.traj.turns[-1]
        assert parsed is not None
        await self._wait_until(run, self.policy.may_run_tools)
        if run.preempt_requested:
            return False
        try:
            calls = self.env.calls_for_turn(run.spec.task, run.turn, parsed, **self._context(run, self._calls_ctx))
        except Exception as exc:
            return self._fail_env(run, exc, "calls_for_turn")
        turn.tool_calls = list(calls)
        results = await self._run_tools(run, calls)
        if run.preempt_requested:
            return False  # the turn's tokens stay; its tools run again when it resumes
        turn.tool_results = results
        try:
            outcome = self.env.step(run.spec.task, run.turn, parsed, results, **self._context(run, self._step_ctx))
        except Exception as exc:  # the environment broke its contract: this episode fails, its tokens stay
            return self._fail_env(run, exc, "step")
        run.pending, run.turn_start = None, None
        if outcome.done:
            run.traj.reward = outcome.reward
            run.traj.reward_components = dict(outcome.reward_components)
            self._end(run, Status.COMPLETED)
            return True
        last = int(run.traj.token_ids[-1])
        obs = self.renderer.observation(outcome.observation, last)
        turn.obs_start, turn.obs_end = run.traj.append(TokenSpan.observation(obs))
        node = self._graph.add("observe", run.id, after=run.last_node, start=self._now(), tokens=len(obs))
        self._graph.finish(node, self._now())
        run.last_node = node
        if run.spec.fork_after_turn == run.turn and run.spec.fork_branches > 1:
            self._fork(run)
        run.turn += 1
        if run.turn >= self.env.max_turns:
            self._end(run, Status.TRUNCATED)
            return True
        run.stage = Stage.GATE  # the driver loop enters the gate (and notifies) next
        return True

    def _fork(self, run: TrajectoryRun) -> None:
        """Branch after this turn: the trajectory continues as branch 0; clones 1..m-1 share its tokens."""
        run.traj.metadata["fork_point"] = (run.id, run.turn)
        self._view = self._sharers = None  # the snapshot and the prefix counts gain the children
        children = []
        for j in range(1, run.spec.fork_branches):
            traj = copy.deepcopy(run.traj)
            traj.id = f"{run.id}.b{j}"
            traj.metadata["cloned_at"] = len(traj)  # tokens before this offset were sampled by the parent
            seed = None if run.spec.sampling.seed is None else run.spec.sampling.seed + seeds.BRANCH * j
            spec = replace(run.spec, trajectory_id=traj.id, sampling=replace(run.spec.sampling, seed=seed),
                           fork_after_turn=None)
            children.append(TrajectoryRun(spec=spec, traj=traj, turn=run.turn + 1))
        for child, node in zip(children, self._graph.fork(run.last_node, [c.id for c in children], self._now())):
            child.last_node = node
            self._runs.append(child)
            self._started.append(child.id)
            self._tg.start_soon(self._drive, child)


def _check_ids(carried: Sequence[TrajectoryRun], specs: Sequence[EpisodeSpec]) -> None:
    """Trajectory ids are the executor's keys (and a group id is a GRPO group): reject a collision before
    any work starts, instead of merging two trajectories or groups."""
    ids = [r.id for r in carried] + [s.trajectory_id for s in specs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"duplicate trajectory ids {dup[:5]} (a carried-over one, or two specs): give every "
                          "episode its own id (episode_specs derives them from unique task ids)")
    carried_groups = {r.traj.group_id for r in carried}
    if clash := sorted(carried_groups & {s.group_id for s in specs}):
        raise ConfigError(f"group ids {clash[:5]} are still in the carry-over: new specs need new group ids")


async def run_rollout(env: Environment, engine: Engine, renderer: ChatRenderer, specs: Sequence[EpisodeSpec],
                      scheduler: Policy | str = "overlap") -> list[Trajectory]:
    """Run ``specs`` to completion under ``scheduler``; trajectories come back in ``specs`` order (plus forks)."""
    result = await RolloutExecutor(env, engine, renderer, scheduler).run(specs)
    order = {s.trajectory_id: i for i, s in enumerate(specs)}
    return sorted(result.trajectories, key=lambda t: (order.get(t.id.split(".b")[0], len(order)), t.id))

