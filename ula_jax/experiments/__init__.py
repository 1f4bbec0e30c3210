"""The papers' questions as experiments: one command each, a figure each.

``ula-jax experiment NAME [--scale cpu|gpu] [a.b=v ...]`` runs one of ``EXPERIMENTS``
(``ula-jax experiment list`` lists them) into a run directory with ``figure.png``
(ours beside the anchor's number), ``table.md``, ``results.json`` and ``params.yaml``.
Each experiment is a typed module here; its parameters per scale are in
``experiments/NAME/experiment.yaml`` and its README (the question, the anchor's claim,
the command, the result) beside them:

* ``capacity``: admitted requests against context length, every system, equal budgets;
* ``throughput``: decode tokens/s against running batch up to each system's capacity;
* ``latency``: time per output token at batch 1 and a small batch;
* ``policies``: PB-LRU against exact LRU, hit rate and resolve time against batch;
* ``buffer_sizing``: misses against HiSparse's per-request buffer and ula's shared pool;
* ``layouts``: ula TP layouts, cross-device bytes, capacity and balance over ranks;
* ``far_tier``: on-demand top-k over CXL against full prefetch over RDMA (modeled).

The package sits above the engine, the benchmarks and the report (it runs them) and
below the command line.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Callable, Sequence

from ula_jax.experiments.base import (SCALES, Check, Context, Experiment, Outcome, Params,
                                      configure_backend, load_params, machine, machine_line,
                                      rich_table, write_outcome)

NAMES = ("capacity", "throughput", "latency", "policies", "buffer_sizing", "layouts",
         "far_tier")


def get(name: str) -> Experiment:
  """The experiment called ``name`` (ValueError listing the names otherwise)."""
  if name not in NAMES:
    from ula_jax.config.errors import suggest
    raise ValueError(f"experiment {name!r}{suggest(name, NAMES)}: expected one of "
                     f"{', '.join(NAMES)} (ula-jax experiment list)")
  return importlib.import_module(f"ula_jax.experiments.{name}").EXPERIMENT


def all_experiments() -> list[Experiment]:
  return [get(n) for n in NAMES]


def run(name: str, scale: str = "cpu", overrides: Sequence[str] = (), *,
        out: str | Path | None = None, out_root: str | Path = "runs/experiments",
        progress: bool = True, console=None, log: Callable[[str], None] | None = None
        ) -> tuple[Outcome, Path]:
  """Runs experiment ``name`` at ``scale`` with ``a.b=v`` overrides into a new run
  directory (``out``, or ``{out_root}/{name}-{scale}-{timestamp}``); returns its
  outcome and the directory. Nothing is left behind when it fails."""
  from ula_jax.report.output import RunDirTarget

  exp = get(name)
  params = load_params(exp, scale, overrides)
  platform, devices = exp.devices(params)
  configure_backend(platform, devices)
  target = RunDirTarget.claim(out, parent=out_root, name=f"{name}-{scale}")
  say = log or (console.print if console is not None else print)
  try:
    ctx = Context(name=name, scale=scale, work_dir=target.partial, log=say,
                  progress=progress)
    env = machine()
    t0 = time.perf_counter()
    outcome = exp.run(params, ctx)
    seconds = time.perf_counter() - t0
    write_outcome(target.partial, exp, scale, params, outcome, env, seconds)
  except BaseException:
    target.abandon()
    raise
  run_dir = target.commit()
  if console is not None:
    console.print(rich_table(f"{outcome.title} ({machine_line(env)})", outcome.columns,
                             outcome.rows))
    for p in outcome.anchor:
      anchor = f", {p.source} {_num(p.anchor)}" if p.source else ""
      console.print(f"{p.what}: ours {_num(p.ours)}{anchor}", highlight=False)
    for c in outcome.checks:
      console.print(f"check {c.name}: {'holds' if c.holds else 'FAILS'} ({c.detail})",
                    highlight=False, markup=False)
    for n in outcome.notes:
      console.print(f"note: {n}", highlight=False, markup=False)
    console.print(f"experiment directory: {run_dir} ({seconds:.0f} s)")
  return outcome, Path(run_dir)


def _num(x) -> str:
  from ula_jax.experiments.base import fmt
  return fmt(x)


__all__ = ["NAMES", "SCALES", "Check", "Context", "Experiment", "Outcome", "Params",
           "all_experiments", "get", "load_params", "run"]
