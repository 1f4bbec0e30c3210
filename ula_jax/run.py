"""Runs one experiment end to end and writes its run directory."""

from __future__ import annotations

from pathlib import Path

from jax.sharding import Mesh
from rich.console import Console

from ula_jax.config import ConfigError, ExperimentConfig, config_to_yaml
from ula_jax.engine.types import RunResult
from ula_jax.mesh import build_mesh, configure_platform
from ula_jax.report import (CONFIG_FILE, METRICS_FILE, MetricsWriter, RunProgress,
                            new_run_dir, summary_table, write_outputs)
from ula_jax.workloads import build_requests


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path | None = None,
                   progress: bool = True, *, mesh: Mesh | None = None, show: bool = True,
                   console: Console | None = None) -> tuple[RunResult, Path]:
  """Serves the workload of ``cfg`` and records the run.

  out_dir: the run directory (created); None = ``{experiment.out_dir}/{name}-{timestamp}``
  progress: a progress bar (also needs ``engine.progress``)
  mesh: the device mesh; None = ``build_mesh(cfg)`` (after ``configure_platform``)
  show: print the summary table at the end

  The run directory gets ``config.yaml`` (resolved), ``metrics.jsonl`` (one line per
  engine step, written as the run goes), ``summary.json``, ``requests.jsonl`` and
  ``run.png`` (when ``experiment.plots``). Returns the engine's result and the directory.
  """
  from ula_jax.engine import Engine  # the engine pulls in the model and kernels

  # Everything that can fail on the config fails before the directory exists.
  requests = build_requests(cfg)
  if mesh is None:
    configure_platform(cfg)
    mesh = build_mesh(cfg)
  try:
    engine = Engine(cfg, mesh)
  except ValueError as e:  # sizes a memory system or the model can never serve
    raise ConfigError([str(e)]) from e

  if out_dir is None:
    run_dir = new_run_dir(cfg.experiment.out_dir, cfg.experiment.name)
  else:
    run_dir = Path(out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
  (run_dir / CONFIG_FILE).write_text(config_to_yaml(cfg))

  console = console or Console()
  with MetricsWriter(run_dir / METRICS_FILE) as metrics, \
      RunProgress(len(requests), enabled=progress and cfg.engine.progress,
                  description=cfg.experiment.name) as bar:

    def on_step(m) -> None:
      metrics.write(m)
      bar.update(m)

    result = engine.run(requests, on_step=on_step)

  if result.traces is not None:
    _record_traces(cfg, result, run_dir)
  stats = write_outputs(run_dir, result, name=cfg.experiment.name, plots=cfg.experiment.plots)
  if show:
    console.print(summary_table(stats, title=f"{cfg.experiment.name} ({cfg.memory.system})"))
    console.print(f"run directory: {run_dir}")
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
