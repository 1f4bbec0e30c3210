"""A progress bar over a run: requests finished / total and decode tokens/s so far."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)

from ula_jax.engine.types import StepMetrics


class RunProgress:
  """Context manager; ``update`` is the engine's ``on_step`` (a no-op when disabled)."""

  def __init__(self, total: int, *, enabled: bool = True, description: str = "decoding",
               console: Console | None = None):
    self.total = total
    self.enabled = enabled
    self.description = description
    self._decode_tokens = 0
    self._decode_time = 0.0
    self._progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
        console=console or Console(stderr=True), transient=False, disable=not enabled)
    self._task = None

  def __enter__(self) -> RunProgress:
    self._progress.start()
    self._task = self._progress.add_task(self.description, total=self.total, status="")
    return self

  def update(self, m: StepMetrics) -> None:
    self._decode_tokens += m.decode_tokens
    self._decode_time += m.decode_time_s
    rate = self._decode_tokens / self._decode_time if self._decode_time > 0 else 0.0
    self._progress.update(
        self._task, completed=m.finished,
        status=f"step {m.step}  batch {m.running}  {rate:,.0f} tok/s")

  def __exit__(self, *exc) -> None:
    self._progress.stop()
