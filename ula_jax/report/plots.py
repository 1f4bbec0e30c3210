"""PNG plots of a run and of a sweep (matplotlib's Agg canvas; no global pyplot state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ula_jax.engine.types import StepMetrics


def _save(fig: Figure, path: Path) -> Path:
  FigureCanvasAgg(fig)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def plot_run(steps: Sequence[StepMetrics], path: str | Path, title: str = "",
             device_capacity: int | None = None, host_capacity: int | None = None) -> Path:
  """Two panels over engine steps: running batch and decode tokens/s; device and host
  slots in use (with the capacities as dashed lines)."""
  path = Path(path)
  x = [m.step for m in steps]
  fig = Figure(figsize=(8, 6))
  ax1, ax2 = fig.subplots(2, 1, sharex=True)
  ax1.plot(x, [m.running for m in steps], color="tab:blue", label="running batch")
  ax1.set_ylabel("running batch", color="tab:blue")
  tps = ax1.twinx()
  tps.plot(x, [m.tokens_per_s for m in steps], color="tab:orange", lw=0.8, label="tokens/s")
  tps.set_ylabel("decode tokens/s", color="tab:orange")
  ax1.set_title(title or "batch and throughput")
  ax2.plot(x, [m.device_used for m in steps], label="device slots used")
  ax2.plot(x, [m.host_used for m in steps], label="host slots used")
  ax2.plot(x, [m.distinct for m in steps], ls=":", label="distinct entries")
  for cap, name, color in ((device_capacity, "device", "tab:blue"),
                           (host_capacity, "host", "tab:orange")):
    if cap:
      ax2.axhline(cap, ls="--", lw=0.8, color=color, label=f"{name} slots")
  ax2.set_xlabel("engine step")
  ax2.set_ylabel("slots (group-entries)")
  ax2.legend(loc="upper left", fontsize="small")
  return _save(fig, path)


def plot_sweep(rows: Sequence[dict[str, Any]], key: str, path: str | Path) -> Path:
  """Tokens/s and peak running batch against one swept numeric field."""
  path = Path(path)
  rows = sorted(rows, key=lambda r: r[key])
  x = [r[key] for r in rows]
  fig = Figure(figsize=(7, 4))
  ax = fig.subplots()
  ax.plot(x, [r["tokens_per_s"] for r in rows], marker="o", color="tab:blue")
  ax.set_xlabel(key)
  ax.set_ylabel("tokens/s", color="tab:blue")
  batch = ax.twinx()
  batch.plot(x, [r["peak_batch"] for r in rows], marker="s", ls="--", color="tab:green")
  batch.set_ylabel("peak running batch", color="tab:green")
  ax.set_title(f"sweep over {key}")
  return _save(fig, path)
