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

  stats = write_outputs(run_dir, result, name=cfg.experiment.name, plots=cfg.experiment.plots)
  if show:
    console.print(summary_table(stats, title=f"{cfg.experiment.name} ({cfg.memory.system})"))
    console.print(f"run directory: {run_dir}")
  return result, run_dir
