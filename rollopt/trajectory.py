"""Token-level trajectory records: what a rollout produces and the trainer consumes.

Invariants (DESIGN 1–3), checked whenever tokens are added:

* a trajectory is token ids end to end; text is derived for display and parsing;
* every token carries ``token_id``, ``logprob`` (the engine's sampling logprob), ``version`` (the weight
  version that sampled it) and ``kind`` (prompt / generated / observation); the four arrays always share one
  length;
* generated tokens have a finite logprob ``<= 0`` and a version ``>= 0``; every other token has version ``-1``
  and logprob ``NaN``, so a placeholder can never leak into an importance ratio;
* tokens are only ever appended, so turn k's prompt+response is a bit-exact prefix of turn k+1's prompt;
* a failure is data: a failed trajectory keeps all its tokens and carries an :class:`ErrorRecord`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from rollopt.errors import ErrorRecord

NO_VERSION = -1
"""The version of a token the policy did not sample (prompt and observation tokens)."""


class TokenKind(enum.IntEnum):
    """Who produced a token. Only ``GENERATED`` tokens enter the loss."""

    PROMPT = 0
    GENERATED = 1
    OBSERVATION = 2


class Status(str, enum.Enum):
    """Where an episode stands. ``RUNNING`` only while a rollout is in progress."""

    RUNNING = "running"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True)
class TokenSpan:
    """A validated run of tokens of one kind, the unit that is appended to a trajectory."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    kind: TokenKind

    def __post_init__(self) -> None:
        ids, lps, vers = np.asarray(self.token_ids), np.asarray(self.logprobs), np.asarray(self.versions)
        if not (ids.ndim == lps.ndim == vers.ndim == 1):
            raise ValueError("token_ids, logprobs and versions must be 1-D")
        if not (len(ids) == len(lps) == len(vers)):
            raise ValueError(
                f"token arrays differ in length: token_ids={len(ids)} logprobs={len(lps)} versions={len(vers)}"
            )
        kind = TokenKind(self.kind)
        if len(ids):  # (ndarray methods: spans are short, so the per-call cost of the np.* wrappers counts)
            if ids.min() < 0:
                raise ValueError("token ids must be non-negative")
            if kind is TokenKind.GENERATED:
                # a NaN makes min NaN, a -inf makes it -inf, a +inf fails the bound on max
                if not (np.isfinite(lps.min()) and lps.max() <= 1e-6):
                    raise ValueError("generated tokens need finite sampling logprobs <= 0")
                if vers.min() < 0:
                    raise ValueError("generated tokens need a weight version >= 0")
            else:
                if not np.isnan(lps).all():
                    raise ValueError(f"{kind.name.lower()} tokens must have logprob NaN")
                if not (vers == NO_VERSION).all():
                    raise ValueError(f"{kind.name.lower()} tokens must have version {NO_VERSION}")
        object.__setattr__(self, "token_ids", ids.astype(np.int64, copy=False))
        object.__setattr__(self, "logprobs", lps.astype(np.float64, copy=False))
        object.__setattr__(self, "versions", vers.astype(np.int64, copy=False))
        object.__setattr__(self, "kind", kind)

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def _unsampled(cls, token_ids: Sequence[int], kind: TokenKind) -> "TokenSpan":
        n = len(token_ids)
        return cls(np.asarray(token_ids, dtype=np.int64), np.full(n, np.nan), np.full(n, NO_VERSION), kind)

    @classmethod
    def prompt(cls, token_ids: Sequence[int]) -> "TokenSpan":
        return cls._unsampled(token_ids, TokenKind.PROMPT)

    @classmethod
    def observation(cls, token_ids: Sequence[int]) -> "TokenSpan":
        return cls._unsampled(token_ids, TokenKind.OBSERVATION)

    @classmethod
    def generated(cls, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> "TokenSpan":
        return cls(np.asarray(token_ids), np.asarray(logprobs, dtype=np.float64), np.asarray(versions), TokenKind.GENERATED)


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call. ``id`` is unique within its trajectory."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call: ``content`` for the model, ``error`` when it failed."""

    call_id: str
    name: str
    content: str
    error: ErrorRecord | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Turn:
    """One assistant turn: its generated tokens ``[gen_start, gen_end)``, what was parsed from them, the tool
    results, and the observation tokens ``[obs_start, obs_end)`` appended after it (empty for the last turn)."""

    index: int
    gen_start: int
    gen_end: int
    finish_reason: str
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)
    parse_errors: list[ErrorRecord] = field(default_factory=list)
    obs_start: int = -1
    obs_end: int = -1


_VALID_KINDS = frozenset(int(k) for k in TokenKind)


@dataclass
class Trajectory:
    """One episode, token by token.

    Build it with :meth:`start` and grow it with :meth:`append`; the four token arrays are validated on every
    append and at construction.
    """

    id: str
    task_id: str
    group_id: str
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    kinds: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    status: Status = Status.RUNNING
    error: ErrorRecord | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    _generated: int = field(default=0, init=False, repr=False, compare=False)  # generated tokens, kept by append
    _buffers: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (owner id, 4 arrays)

    def __post_init__(self) -> None:
        self.status = Status(self.status)
        kinds = np.asarray(self.kinds, dtype=np.int8)
        if len(kinds) and not set(np.unique(kinds).tolist()) <= _VALID_KINDS:
            raise ValueError(f"unknown token kinds in {sorted(set(kinds.tolist()) - _VALID_KINDS)}")
        arrays = {"token_ids": self.token_ids, "logprobs": self.logprobs, "versions": self.versions, "kinds": kinds}
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"token arrays differ in length: {lengths}")
        self.token_ids = np.zeros(0, np.int64)
        self.logprobs = np.zeros(0, np.float64)
        self.versions = np.zeros(0, np.int64)
        self.kinds = np.zeros(0, np.int8)
        self._generated = 0
        # Re-append run by run so that the per-kind rules are checked exactly as for a growing trajectory.
        if len(kinds):
            boundaries = np.flatnonzero(np.diff(kinds)) + 1
            for lo, hi in zip(np.r_[0, boundaries], np.r_[boundaries, len(kinds)]):
                span = TokenSpan(arrays["token_ids"][lo:hi], arrays["logprobs"][lo:hi], arrays["versions"][lo:hi],
                                 TokenKind(int(kinds[lo])))
                self.append(span)

    @classmethod
    def start(cls, id: str, task_id: str, group_id: str, prompt_ids: Sequence[int] | TokenSpan,
              **metadata: Any) -> "Trajectory":
        """A new trajectory holding only its prompt: token ids, or a prompt span (built and checked once and
        shared, e.g. by the members of a GRPO group)."""
        if isinstance(prompt_ids, TokenSpan) and prompt_ids.kind is not TokenKind.PROMPT:
            raise ValueError(f"a trajectory starts with a prompt span, not a {prompt_ids.kind.name.lower()} span")
        traj = cls(id=id, task_id=task_id, group_id=group_id, metadata=dict(metadata))
        traj.append(prompt_ids if isinstance(prompt_ids, TokenSpan) else TokenSpan.prompt(prompt_ids))
        return traj

    def append(self, span: TokenSpan) -> tuple[int, int]:
        """Append a validated span; return its ``[start, end)`` offsets in the trajectory.

        The four arrays are views of buffers that grow geometrically, so an append copies the span, not the
        whole trajectory (O(total length) over an episode, not O(turns × length)). Only positions past the
        arrays' end are ever written, so arrays read earlier keep their values. A copy of the trajectory
        (shallow or deep) writes to buffers of its own: buffers belong to the object that made them.
        """
        start, end = len(self.token_ids), len(self.token_ids) + len(span)
        owner, ids, lps, vers, kinds = self._buffers or (None, None, None, None, None)
        if not (owner == id(self) and len(ids) >= end and self.token_ids.base is ids and self.logprobs.base is lps
                and self.versions.base is vers and self.kinds.base is kinds):
            arrays = self.token_ids, self.logprobs, self.versions, self.kinds
            ids, lps, vers, kinds = (np.empty(max(2 * end, 256), a.dtype) for a in arrays)
            for array, buffer in zip(arrays, (ids, lps, vers, kinds)):
                buffer[:start] = array
            self._buffers = (id(self), ids, lps, vers, kinds)
        ids[start:end] = span.token_ids
        lps[start:end] = span.logprobs
        vers[start:end] = span.versions
        kinds[start:end] = span.kind
        self.token_ids, self.logprobs, self.versions, self.kinds = ids[:end], lps[:end], vers[:end], kinds[:end]
        if span.kind is TokenKind.GENERATED:
            self._generated += len(span)
        return start, end

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def loss_mask(self) -> np.ndarray:
        """True exactly at generated tokens."""
        return self.kinds == TokenKind.GENERATED

    @property
    def num_generated(self) -> int:
        """How many tokens are generated (O(1): counted as spans are appended)."""
        return self._generated

    @property
    def prompt_length(self) -> int:
        """Length of the initial prompt (the tokens before the first non-prompt token)."""
        non_prompt = np.flatnonzero(self.kinds != TokenKind.PROMPT)
        return int(non_prompt[0]) if len(non_prompt) else len(self)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [call for turn in self.turns for call in turn.tool_calls]

    @property
    def tool_results(self) -> list[ToolResult]:
        return [res for turn in self.turns for res in turn.tool_results]

    def finish(self, status: Status, error: ErrorRecord | None = None) -> None:
        """Close the episode. A failed episode must say why."""
        status = Status(status)
        if status is Status.RUNNING:
            raise ValueError("finish() needs a final status")
        if status is Status.FAILED and error is None:
            raise ValueError("a failed trajectory needs an ErrorRecord")
        self.status = status
        self.error = error
        # nothing is appended to a finished episode: give back the buffers' spare room (half of it, on average)
        self.token_ids, self.logprobs, self.versions, self.kinds = (
            a.copy() for a in (self.token_ids, self.logprobs, self.versions, self.kinds))
        self._buffers = None
