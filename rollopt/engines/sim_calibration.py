"""Fit the simulated engine's :class:`~rollopt.engines.sim_cost.LinearCost` to a real engine (``rollopt calibrate``).

The method is Vidur's (profile the engine once, then simulate), done through the engine interface only, so it
fits the embedded engine and a real SGLang server the same way:

1. **Probes.** A grid of batch size × prompt length × new tokens (:data:`DEFAULT_PROBES`). A probe submits
   ``batch`` requests at once — distinct random prompts, so nothing is a prefix-cache hit, and ``ignore_eos``,
   so each decodes exactly ``new_tokens`` — and times them until the last result. Each probe runs ``repeats``
   times, interleaved with the others; its time is the median.
2. **The simulated plan.** The same probe runs on a :class:`~rollopt.engines.sim.SimEngine` with the measured
   engine's sizes (running limit, prefill chunk, page size) and a cost of 0 s per iteration, recording its
   iterations. With no tools and every request submitted at once, that plan does not depend on the cost.
3. **The fit.** A probe's time is the sum of its iterations' costs (``fixed + a·prefill_tokens + b·decode_seqs
   + …``, :class:`LinearCost`), which is linear in the coefficients: non-negative least squares over the probes
   (:meth:`LinearCost.fit`).

Because the plan is the simulator's own, the fit makes the simulator reproduce the probes whatever its
mechanics simplify; whether it then predicts whole rollouts is what ``bench/sim_validation.py`` measures. Host
work the engine does not do (the executor, tools, streaming to the caller) is not in the probes: on a virtual
clock it costs nothing.

:func:`calibrate` returns a :class:`CostFit`; :meth:`CostFit.save` writes the cost file that
``--engine sim --engine-option cost_file=F`` reads (:func:`load_cost_file`; a file that is missing or does not
parse is a one-line :class:`~rollopt.errors.ConfigError` naming the command that writes one).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import anyio
import numpy as np

from rollopt.engines.base import Engine, GenerateRequest
from rollopt.engines.sim_cost import IterationFeatures, LinearCost
from rollopt.errors import ConfigError

COST_FILE_FORMAT = "rollopt-cost/1"
COEFFICIENTS = ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s", "per_attention_pair_s",
                "per_prefill_seq_s")
WRITE_ONE = "write one with `rollopt calibrate --engine local --out FILE`"


@dataclass(frozen=True)
class Probe:
    """``batch`` requests of ``prompt_tokens`` random prompt tokens, each decoding ``new_tokens``, at once."""

    batch: int
    prompt_tokens: int
    new_tokens: int

    def fits(self, sizes: "EngineSizes") -> bool:
        return self.batch <= sizes.max_running and self.prompt_tokens + self.new_tokens <= sizes.max_context


DEFAULT_PROBES: tuple[Probe, ...] = tuple(
    Probe(b, p, n) for b in (1, 4, 16, 64) for p in (16, 256, 1024) for n in (8, 48))
"""24 probes: decode batches from 1 to 64 (the bench's default running limit), prompts from one page to 1,024
tokens (prefill cost and attention, KV read), short and long decodes (what is per iteration and what is per
request)."""


@dataclass(frozen=True)
class EngineSizes:
    """What the simulated replica of the measured engine copies from it."""

    max_running: int
    prefill_chunk: int
    block_size: int
    max_context: int
    kv_tokens: int
    defer_shared_prefill: bool = True
    """Whether a request waits while another prefills its first uncached page (the embedded engine; SGLang's
    cache-aware schedule policies deprioritize such requests), or prefills it again in the same batch (SGLang's
    default ``fcfs``: a GRPO group arriving at once computes its prompt once per member)."""
    mixed_prefill: bool = True
    """Whether an iteration decodes the running requests beside its prefill chunk (the embedded engine), or runs
    prefill alone first (SGLang's default, without ``--enable-mixed-chunk``)."""

    @classmethod
    def of(cls, config: Any) -> "EngineSizes":
        """The sizes of a :class:`~rollopt.config.LocalEngineConfig` (its slots' KV and its prefix cache count
        toward the simulated pool), or of any configuration that has these fields."""
        if getattr(config, "kind", None) == "local":
            kv = config.prefix_cache_tokens + config.max_running * config.max_context
            return cls(config.max_running, config.prefill_chunk, config.block_size, config.max_context, kv,
                       config.defer_shared_prefill)  # its tick prefills and decodes: mixed
        try:
            return cls(*(getattr(config, f) for f in ("max_running", "prefill_chunk", "block_size", "max_context",
                                                      "kv_tokens")),
                       defer_shared_prefill=getattr(config, "defer_shared_prefill", True),
                       mixed_prefill=getattr(config, "mixed_prefill", True))
        except AttributeError as missing:
            raise ConfigError(f"cannot calibrate engine {getattr(config, 'kind', config)!r}: its configuration "
                              f"does not give its sizes ({missing})") from None


@dataclass(frozen=True)
class ProbeResult:
    probe: Probe
    measured_s: tuple[float, ...]
    iterations: int
    fitted_s: float = 0.0

    @property
    def median_s(self) -> float:
        return statistics.median(self.measured_s)


@dataclass(frozen=True)
class CostFit:
    """A fitted cost model, the sizes of the engine it was fitted to, and the evidence (every probe)."""

    cost: LinearCost
    fitted_to: str
    sizes: EngineSizes
    probes: tuple[ProbeResult, ...]
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def max_rel_error(self) -> float:
        return max(abs(p.fitted_s - p.median_s) / p.median_s for p in self.probes)

    def to_json(self) -> dict[str, Any]:
        c = self.cost
        return {"format": COST_FILE_FORMAT, "cost_model": "linear", "fitted_to": self.fitted_to, "name": c.name,
                "coefficients": dict(zip(COEFFICIENTS, c.coefficients)),
                "engine": asdict(self.sizes), "max_rel_error": self.max_rel_error, "machine": self.machine,
                "probes": [{**asdict(p.probe), "iterations": p.iterations, "measured_s": list(p.measured_s),
                            "median_s": p.median_s, "fitted_s": p.fitted_s} for p in self.probes]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


@dataclass(frozen=True)
class CostFile:
    """What a cost file gives the simulated engine."""

    linear: tuple[float, ...]  # LinearCost's coefficients, in COEFFICIENTS' order
    fitted_to: str
    sizes: EngineSizes


def load_cost_file(path: str | Path) -> CostFile:
    """Read a cost file written by :meth:`CostFit.save`; a one-line ConfigError naming the fix otherwise."""
    where = f"engine.cost_file {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; {WRITE_ONE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{where} is not a rollopt cost file ({error}); {WRITE_ONE}") from None
    if not isinstance(data, dict) or data.get("format") != COST_FILE_FORMAT:
        raise ConfigError(f"{where} is not a {COST_FILE_FORMAT} cost file; {WRITE_ONE}")
    try:
        c, e = data["coefficients"], data["engine"]
        linear = tuple(float(c[k] if i < 4 else c.get(k, 0.0)) for i, k in enumerate(COEFFICIENTS))  # 2 optional
        sizes = EngineSizes(*(int(e[k]) for k in ("max_running", "prefill_chunk", "block_size", "max_context",
                                                  "kv_tokens")),
                            defer_shared_prefill=bool(e.get("defer_shared_prefill", True)),  # older files: True
                            mixed_prefill=bool(e.get("mixed_prefill", True)))
        fitted_to = str(data["fitted_to"])
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"{where} lacks or mangles {error}; {WRITE_ONE}") from None
    if min(linear) < 0 or min(v for k, v in asdict(sizes).items() if not isinstance(v, bool)) < 1:
        raise ConfigError(f"{where} holds a negative coefficient or a size below 1; {WRITE_ONE}")
    return CostFile(linear, fitted_to, sizes)  # type: ignore[arg-type]


def _requests(probe: Probe, vocab_size: int, tag: str, rng: np.random.Generator) -> list[GenerateRequest]:
    from rollopt.engines.base import SamplingParams

    sampling = SamplingParams(max_new_tokens=probe.new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    return [GenerateRequest(f"{tag}.{i}", tuple(int(x) for x in rng.integers(3, vocab_size, probe.prompt_tokens)),
                            sampling) for i in range(probe.batch)]


async def _run_together(engine: Engine, requests: Sequence[GenerateRequest]) -> float:
    """Seconds (of the running clock) from submitting every request at once to the last result."""
    started = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for request in requests:
            tg.start_soon(engine.generate, request)
    return anyio.current_time() - started


def _sim_config(sizes: EngineSizes) -> Any:
    from rollopt.config import SimEngineConfig

    return SimEngineConfig(kv_tokens=sizes.kv_tokens, max_running=sizes.max_running, prefill_chunk=sizes.prefill_chunk,
                           block_size=sizes.block_size, max_context=sizes.max_context,
                           mixed_prefill=sizes.mixed_prefill)


async def simulated_iterations(probe: Probe, sizes: EngineSizes, vocab_size: int) -> list[IterationFeatures]:
    """The iterations the simulated engine with ``sizes`` plans for ``probe`` (see the module docstring)."""
    from rollopt.engines.sim import SimEngine

    async with SimEngine(LinearCost(0.0, 0.0, 0.0, 0.0), sizes.kv_tokens, _sim_config(sizes), vocab_size=vocab_size,
                         record=True) as sim:
        await _run_together(sim, _requests(probe, vocab_size, "plan", np.random.default_rng(0)))
        return [features for _, features, _ in sim.iterations]


def planned_iterations(probes: Sequence[Probe], sizes: EngineSizes,
                       vocab_size: int) -> dict[Probe, list[IterationFeatures]]:
    """:func:`simulated_iterations` of every probe, in an event loop of their own on the virtual clock (call it from
    a worker thread when a loop is running: ``anyio.to_thread.run_sync``). Before each iteration the sim waits
    until every task is blocked, which trio's clock sees at once and asyncio can only poll (anyio sleeps 0.1 s
    per poll): planned on the caller's asyncio loop, the 24 default probes took minutes of wall time."""
    from rollopt.engines import run

    async def plan_all() -> dict[Probe, list[IterationFeatures]]:
        return {p: await simulated_iterations(p, sizes, vocab_size) for p in probes}

    return run(plan_all, _sim_config(sizes))


async def calibrate(engine: Engine, sizes: EngineSizes, fitted_to: str, *, probes: Sequence[Probe] = DEFAULT_PROBES,
                    repeats: int = 3, seed: int = 0, progress: Any = lambda line: None) -> CostFit:
    """Time ``probes`` on ``engine`` (``repeats`` interleaved rounds, after one warm-up request), plan them on
    the simulated engine with ``sizes``, and fit. ``fitted_to`` names the engine (it goes into the cost model's
    name and every output that uses it)."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if too_big := [p for p in probes if not p.fits(sizes)]:
        raise ConfigError(f"probe {too_big[0]} does not fit the engine (max_running {sizes.max_running}, "
                          f"max_context {sizes.max_context}); drop it or raise the engine's sizes")
    vocab = (await engine.info()).vocab_size
    rng = np.random.default_rng(seed)
    await _run_together(engine, _requests(Probe(1, 16, 8), vocab, "cal.warm", rng))
    measured: dict[Probe, list[float]] = {p: [] for p in probes}
    for rep in range(repeats):
        for i, probe in enumerate(probes):
            measured[probe].append(await _run_together(engine, _requests(probe, vocab, f"cal.{rep}.{i}", rng)))
        await engine.flush_cache()
        progress(f"calibration round {rep + 1}/{repeats} done")
    plans = await anyio.to_thread.run_sync(planned_iterations, probes, sizes, vocab)
    cost = LinearCost.fit([(plans[p], statistics.median(measured[p])) for p in probes], fitted_to)
    results = tuple(ProbeResult(p, tuple(measured[p]), len(plans[p]), sum(map(cost.seconds, plans[p])))
                    for p in probes)
    machine = {"cores": os.cpu_count(), "host": platform.node(), "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d")}  # "cores" as in the bench report
    return CostFit(cost, fitted_to, sizes, results, machine)


async def engine_sizes(engine: Engine, config: Any) -> EngineSizes:
    """The sizes of a started engine: what the engine reports (``scheduler_sizes()``, e.g. a SGLang server's
    ``/server_info``), else its configuration's (:meth:`EngineSizes.of`)."""
    report = getattr(engine, "scheduler_sizes", None)
    return EngineSizes(**await report()) if report is not None else EngineSizes.of(config)


async def calibrate_engine(config: Any, model_spec: str = "tiny", *, repeats: int = 3,
                           probes: Sequence[Probe] = DEFAULT_PROBES, seed: int = 0,
                           progress: Any = lambda line: None) -> CostFit:
    """``rollopt calibrate`` as a function: load ``model_spec``, start the engine ``config`` describes (any
    registered engine: ``local``, ``sglang``, a plug-in), and :func:`calibrate` it on the probes that fit it."""
    from rollopt.engines import EngineContext, build_engine
    from rollopt.modeling import load_model

    if getattr(config, "virtual_clock", False):
        raise ConfigError(f"engine {config.kind!r} runs on a virtual clock: calibrate a real engine (local, sglang)")
    model = load_model(model_spec, seed=seed)
    async with build_engine(config, model, EngineContext(progress=progress)) as engine:
        sizes = await engine_sizes(engine, config)
        kept = [p for p in probes if p.fits(sizes)]
        if len(kept) < len(probes):
            progress(f"{len(probes) - len(kept)} probes do not fit the engine ({sizes}) and are left out")
        if len(kept) < 6:
            raise ConfigError(f"only {len(kept)} probes fit the engine ({sizes}); the fit needs 6: raise its "
                              "running limit or context")
        return await calibrate(engine, sizes, f"{config.kind} {model.name}", probes=kept, repeats=repeats, seed=seed,
                               progress=progress)


__all__ = ["COST_FILE_FORMAT", "DEFAULT_PROBES", "CostFile", "CostFit", "EngineSizes", "Probe", "ProbeResult",
           "calibrate", "calibrate_engine", "engine_sizes", "load_cost_file", "planned_iterations",
           "simulated_iterations"]
