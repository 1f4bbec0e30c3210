"""Compilations a run pays for: how many programs each jitted step compiled, the seconds
spent, and the persistent compilation cache that lets a second identical run compile
nothing.

``CompileLog`` listens to jax's monitoring events while it is open: every request for a
program (``/jax/core/compile/backend_compile_duration``, with the jitted function's name
and the seconds it took) and every persistent-cache hit
(``/jax/compilation_cache/cache_hits``, which jax records inside that request, before
its duration): a request preceded by a hit read its program from the cache, any other
compiled one.
"""

from __future__ import annotations

import collections
import os
import pathlib
from typing import Any

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> pathlib.Path:
  """``$XDG_CACHE_HOME/ula_jax/xla`` (``~/.cache/ula_jax/xla`` without it)."""
  root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(root) / "ula_jax" / "xla"


def enable_persistent_cache(path: str | pathlib.Path | None = None) -> pathlib.Path:
  """Turns on jax's persistent compilation cache in ``path`` for every program, however
  quick to compile; returns the folder. Without ``path``: the folder jax is already
  configured with (``JAX_COMPILATION_CACHE_DIR``, or a test session's), else
  ``default_cache_dir()``. Call before the first compilation of the process."""
  path = pathlib.Path(path or jax.config.jax_compilation_cache_dir
                      or default_cache_dir()).expanduser()
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


class CompileLog:
  """Counts compilations by jitted function while open (a context manager, or ``start``
  / ``stop``; reopening keeps counting).

  programs: {function name: programs compiled}; cached: {name: programs read from the
  persistent cache}; seconds: {name: seconds spent on both}.
  """

  def __init__(self):
    self.programs: collections.Counter = collections.Counter()
    self.cached: collections.Counter = collections.Counter()
    self.seconds: collections.defaultdict = collections.defaultdict(float)
    self._hit = False
    self._open = False

  def _on_duration(self, event: str, duration: float, **kw: Any) -> None:
    if event == BACKEND_COMPILE_EVENT:
      name = str(kw.get("fun_name", "?"))
      if name.startswith("jit(") and name.endswith(")"):
        name = name[4:-1]
      (self.cached if self._hit else self.programs)[name] += 1
      self.seconds[name] += float(duration)
      self._hit = False

  def _on_event(self, event: str, **kw: Any) -> None:
    del kw
    if event == CACHE_HIT_EVENT:
      self._hit = True

  def start(self) -> CompileLog:
    if not self._open:
      jax.monitoring.register_event_duration_secs_listener(self._on_duration)
      jax.monitoring.register_event_listener(self._on_event)
      self._open = True
    return self

  def stop(self) -> None:
    if self._open:
      jax.monitoring.unregister_event_duration_listener(self._on_duration)
      jax.monitoring.unregister_event_listener(self._on_event)
      self._open = False

  def __enter__(self) -> CompileLog:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def summary(self, steps: tuple[str, ...]) -> dict:
    """The named steps apart, everything else (array fillers, small helpers) as
    ``other``: {"programs": {step: compiled}, "cached": {step: read from the cache},
    "seconds": {step: s}, "other_programs", "other_cached", "other_seconds",
    "total_programs", "total_seconds"}."""
    pick = lambda table: {s: table.get(s, 0) for s in steps}
    other = [n for n in {*self.programs, *self.cached} if n not in steps]
    return {
        "programs": pick(self.programs),
        "cached": pick(self.cached),
        "seconds": {s: round(v, 3) for s, v in pick(self.seconds).items()},
        "other_programs": sum(self.programs[n] for n in other),
        "other_cached": sum(self.cached[n] for n in other),
        "other_seconds": round(sum(self.seconds[n] for n in other), 3),
        "total_programs": sum(self.programs.values()),
        "total_seconds": round(sum(self.seconds.values()), 3),
    }
