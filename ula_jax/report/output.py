"""The run directory: config.yaml, metrics.jsonl, summary.json, requests.jsonl, run.png."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import IO, Any

import numpy as np

from ula_jax.engine.types import RunResult, StepMetrics
from ula_jax.report.stats import request_record, run_stats

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
REQUESTS_FILE = "requests.jsonl"
RUN_PLOT = "run.png"


def to_json(value: Any) -> Any:
  """``json.dumps`` default: numpy scalars and arrays, dataclasses, paths."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return dataclasses.asdict(value)
  if isinstance(value, Path):
    return str(value)
  raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def dumps(value: Any, **kw: Any) -> str:
  return json.dumps(value, default=to_json, **kw)


def timestamp() -> str:
  return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def new_run_dir(parent: str | Path, name: str) -> Path:
  """A fresh ``parent/name-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... when it exists)."""
  base = Path(parent) / f"{name}-{timestamp()}"
  path, i = base, 1
  while path.exists():
    i += 1
    path = base.with_name(f"{base.name}-{i}")
  path.mkdir(parents=True)
  return path


class MetricsWriter:
  """Streams one JSON line per StepMetrics to ``metrics.jsonl`` (flushed per step, so
  a run can be watched with ``tail -f``)."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    self._f: IO[str] | None = None

  def __enter__(self) -> MetricsWriter:
    self._f = self.path.open("w")
    return self

  def write(self, m: StepMetrics) -> None:
    self._f.write(dumps(m.as_dict()) + "\n")
    self._f.flush()

  def __exit__(self, *exc) -> None:
    self._f.close()


def read_metrics(path: str | Path) -> list[dict]:
  return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_summary(run_dir: str | Path, result: RunResult, name: str = "",
                  stats: dict | None = None) -> Path:
  """``summary.json``: derived stats, the engine's summary, capacity at the peak of device
  use, and every request's id, prompt length, status, reason and generated tokens."""
  path = Path(run_dir) / SUMMARY_FILE
  doc = {
      "experiment": name,
      "stats": stats if stats is not None else run_stats(result),
      "summary": result.summary,
      "capacity": result.capacity,
      "requests": [request_record(r) for r in result.requests],
  }
  path.write_text(dumps(doc, indent=1) + "\n")
  return path


def write_requests(run_dir: str | Path, result: RunResult) -> Path:
  """``requests.jsonl``: every RequestResult (timings included), one per line."""
  path = Path(run_dir) / REQUESTS_FILE
  with path.open("w") as f:
    for r in result.requests:
      f.write(dumps(r.as_dict()) + "\n")
  return path


class RunDirError(ValueError):
  """A run directory without a readable summary."""


def read_summary(run_dir: str | Path) -> dict:
  """The ``summary.json`` of a run directory (RunDirError naming the file if unreadable)."""
  path = Path(run_dir) / SUMMARY_FILE
  if not path.is_file():
    raise RunDirError(f"{run_dir}: not a run directory (no {SUMMARY_FILE})")
  try:
    doc = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise RunDirError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
  if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
    raise RunDirError(f"{path}: expected an object with a 'requests' list")
  return doc


def write_outputs(run_dir: str | Path, result: RunResult, *, name: str = "",
                  plots: bool = True) -> dict:
  """summary.json, requests.jsonl and (``plots``) run.png; returns the run's stats."""
  from ula_jax.report.plots import plot_run  # matplotlib only when plotting

  run_dir = Path(run_dir)
  stats = run_stats(result)
  write_summary(run_dir, result, name=name, stats=stats)
  write_requests(run_dir, result)
  if plots and result.steps:
    plot_run(result.steps, run_dir / RUN_PLOT, title=name,
             device_capacity=stats["device_capacity"], host_capacity=stats["host_capacity"])
  return stats
