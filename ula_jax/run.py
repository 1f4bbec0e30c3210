"""Runs one experiment end to end and writes its run directory."""

from __future__ import annotations

from pathlib import Path

from jax.sharding import Mesh
from rich.console import Console

from ula_jax.config import ConfigError, ExperimentConfig, config_to_yaml
from ula_jax.engine.types import RunResult
from ula_jax.mesh import build_mesh, configure_platform
from ula_jax.report import (CONFIG_FILE, METRICS_FILE, MetricsWriter, RunProgress,
                            summary_table, write_outputs)
from ula_jax.report.output import (RunDirTarget, RunInterrupted, StopRequest, handle_signals,
                                   run_status)
from ula_jax.workloads import build_requests


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path | None = None,
                   progress: bool = True, *, mesh: Mesh | None = None, show: bool = True,
                   console: Console | None = None,
                   overwrite: bool = False) -> tuple[RunResult, Path]:
  """Serves the workload of ``cfg`` and records the run.

  out_dir: the run directory; None = ``{experiment.out_dir}/{name}-{timestamp}``. An
    existing non-empty one is refused (RunDirError) unless ``overwrite``, which
    replaces its contents when the run ends; so is one another run is writing.
  progress: a progress bar (also needs ``engine.progress``)
  mesh: the device mesh; None = ``build_mesh(cfg)`` (after ``configure_platform``)
  show: print the summary table at the end
  overwrite: replace the contents of an existing ``out_dir``

  The run directory gets ``config.yaml`` (resolved), ``metrics.jsonl`` (one line per
  engine step, written as the run goes), ``summary.json``, ``requests.jsonl`` and
  ``run.png`` (when ``experiment.plots``). They are written into a hidden sibling
  folder renamed into place at the end (``RunDirTarget``), so the directory appears
  complete or not at all. Returns the engine's result and the directory.

  SIGINT or SIGTERM (main thread) stops the engine after its current step (a second
  one at once); the run directory is still written, ``summary.json`` with
  ``"status": "interrupted"``, and then RunInterrupted is raised, its ``run_dir`` set.
  A failure leaves no directory behind (nor does a second signal before the engine's
  loop starts).
  """
  from ula_jax.engine import Engine  # the engine pulls in the model and kernels

  # Everything that can fail on the config or --out fails before any compute, and
  # before the run directory exists.
  requests = build_requests(cfg)
  target = RunDirTarget.claim(out_dir, parent=cfg.experiment.out_dir,
                              name=cfg.experiment.name, overwrite=overwrite)
  stop = StopRequest()
  try:
    with handle_signals(stop):
      if mesh is None:
        configure_platform(cfg)
        mesh = build_mesh(cfg)
      try:
        engine = Engine(cfg, mesh)
      except ValueError as e:  # sizes a memory system or the model can never serve
        raise ConfigError([str(e)]) from e

      (target.partial / CONFIG_FILE).write_text(config_to_yaml(cfg))
      console = console or Console()
      with MetricsWriter(target.partial / METRICS_FILE) as metrics, \
          RunProgress(len(requests), enabled=progress and cfg.engine.progress,
                      description=cfg.experiment.name) as bar:

        def on_step(m) -> None:
          metrics.write(m)
          bar.update(m)
          stop.check()  # a signal noted during the step ends the run here

        result = engine.run(requests, on_step=on_step)

      # Signals while the results are written are noted, not raised: a run directory is
      # never lost half written. The first is raised once it is in place.
      stop.finishing = True
      if result.traces is not None:
        _record_traces(cfg, result, target.partial)
      stats = write_outputs(target.partial, result, name=cfg.experiment.name,
                            plots=cfg.experiment.plots,
                            prompts={r.id: r.prompt for r in requests})
      run_dir = target.commit()
  except BaseException:
    target.abandon()
    raise

  status = run_status(result)
  if show:
    console.print(summary_table(stats, title=f"{cfg.experiment.name} ({cfg.memory.system})"))
    if status != "finished":
      console.print(f"run {status} by {result.summary['interrupted_by']}: "
                    f"{stats['finished']} of {stats['requests']} requests finished")
    console.print(f"run directory: {run_dir}")
  if stop.signum is not None:
    raise RunInterrupted(stop.signum, run_dir=run_dir)
  return result, run_dir


def _record_traces(cfg: ExperimentConfig, result: RunResult, run_dir: Path) -> None:
  """Writes each rank's selection trace; for ``ula`` (one tp rank) replays the traces
  under both policies with the run's pool sizes and puts the hit rates side by side in
  the summary (``policy_comparison``)."""
  from ula_jax.memory.ula.trace import compare_policies_per_rank

  for d, trace in enumerate(result.traces):
    trace.save(run_dir / f"trace_rank{d}.npz")
  if cfg.memory.system != "ula" or cfg.mesh.tp != 1:
    return
  per_rank = compare_policies_per_rank([t for t in result.traces if t.num_steps], cfg.memory)
  if not per_rank:
    return
  out: dict = {}
  for policy in ("pb_lru", "lru"):
    hits = sum(r[policy]["hits"] for r in per_rank)
    misses = sum(r[policy]["misses"] for r in per_rank)
    out[policy] = {"hits": hits, "misses": misses,
                   "evictions": sum(r[policy]["evictions"] for r in per_rank),
                   "resolve_seconds": sum(r[policy]["resolve_seconds"] for r in per_rank),
                   "hit_rate": hits / (hits + misses) if hits + misses else 1.0}
  out["hit_rate_gap_pp"] = 100.0 * (out["pb_lru"]["hit_rate"] - out["lru"]["hit_rate"])
  result.summary["policy_comparison"] = out
