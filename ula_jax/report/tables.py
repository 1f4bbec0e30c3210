"""Rich tables: one run's totals, a sweep's rows, a comparison of two runs."""

from __future__ import annotations

from typing import Any, Sequence

from rich.table import Table

from ula_jax.report.stats import STAT_LABELS


def fmt(value: Any) -> str:
  """Numbers for tables: ints as is, fractions to 3 places, large floats to 1."""
  if value is None:
    return "-"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, int):
    return f"{value:,}"
  if isinstance(value, float):
    if value != 0 and abs(value) < 1:
      return f"{value:.3g}" if abs(value) < 1e-3 else f"{value:.3f}"
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
  return str(value)


def summary_table(stats: dict[str, Any], title: str = "run summary") -> Table:
  """Two columns (metric, value): the known totals in order, then system counters."""
  table = Table(title=title)
  table.add_column("metric")
  table.add_column("value", justify="right")
  for key, label in STAT_LABELS.items():
    if key in stats:
      table.add_row(label, fmt(stats[key]))
  for key, value in stats.items():
    if key not in STAT_LABELS:
      table.add_row(key.replace("_", " "), fmt(value))
  return table


SWEEP_COLUMNS: dict[str, str] = {
    "tokens_per_s": "tokens/s",
    "finished": "finished",
    "rejected": "rejected",
    "peak_batch": "peak batch",
    "peak_device_used": "device slots used",
    "distinct_fraction": "distinct",
    "wall_time_s": "wall s",
}


def sweep_table(rows: Sequence[dict[str, Any]], keys: Sequence[str],
                title: str = "sweep") -> Table:
  """One row per combination: the swept values, then ``SWEEP_COLUMNS``."""
  table = Table(title=title)
  for k in keys:
    table.add_column(k)
  for label in SWEEP_COLUMNS.values():
    table.add_column(label, justify="right")
  for row in rows:
    table.add_row(*[str(row[k]) for k in keys], *[fmt(row.get(c)) for c in SWEEP_COLUMNS])
  return table


def compare_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
  """Per-request comparison rows: id, status A/B, tokens A/B, verdict."""
  table = Table(title=title)
  for col in ("request", "status A", "status B", "tokens A", "tokens B", "result"):
    table.add_column(col)
  for r in rows:
    table.add_row(r["id"], str(r["status_a"]), str(r["status_b"]), fmt(r["tokens_a"]),
                  fmt(r["tokens_b"]), r["result"])
  return table
