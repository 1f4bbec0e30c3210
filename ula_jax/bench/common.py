"""Shared by the benchmarks: argument parsing helpers, timing, output."""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import time
from typing import Any, Callable, Sequence

import jax


def parse_sizes(text: str, *, flag: str | None = None, minimum: int = 0,
                unit: str = "") -> list[int]:
  """'64,1K,1M' -> [64, 1024, 1048576] (K = 1024, M = 1024 * 1024).

  flag: the option named in errors; minimum: the smallest value allowed; unit: its name.
  """
  where = f"{flag}: " if flag else ""
  out = []
  for part in text.split(","):
    part = part.strip().upper()
    if not part:
      continue
    scale = {"K": 1 << 10, "M": 1 << 20}.get(part[-1], 1)
    try:
      value = int(part[:-1] if scale > 1 else part) * scale
    except ValueError:
      raise ValueError(f"{where}size {part!r}: expected an integer, optionally with a K or M "
                       "suffix (e.g. 64,1K,1M)") from None
    if value < minimum:
      raise ValueError(f"{where}size {part!r}: expected >= {minimum}{unit}")
    out.append(value)
  return out


def parse_list(text: str, allowed: Sequence[str], *, flag: str) -> list[str]:
  items = [p.strip() for p in text.split(",") if p.strip()]
  bad = [p for p in items if p not in allowed]
  if bad:
    raise ValueError(f"{flag}={text!r}: unknown {bad}; expected a comma list of {list(allowed)}")
  return items


def add_timing_args(p: Any, *, max_iters: int, target_ms: float) -> None:
  """The arguments of ``time_calls``' adaptive timing, on an ``argparse`` parser:
  ``--reps``, ``--min-iters``, ``--max-iters``, ``--target-ms`` (defaults per benchmark)."""
  p.add_argument("--reps", type=int, default=3, help="repetitions of every measurement")
  p.add_argument("--min-iters", type=int, default=3)
  p.add_argument("--max-iters", type=int, default=max_iters)
  p.add_argument("--target-ms", type=float, default=target_ms,
                 help="time each repetition for about this long")


def time_calls(step: Callable[[Any], Any], state: Any, *, min_iters: int, max_iters: int,
               target_s: float, warmup: int,
               wait: Callable[[Any], Any] = jax.block_until_ready) -> tuple[float, Any]:
  """Seconds per call of ``state = step(state)``.

  The calls are issued back to back and waited for once (``wait(state)``), so the figure
  is the throughput of a stream of calls (dispatch overlapped), as in a decode loop. Each
  call must depend on the previous one or run after it on one stream (a jitted function
  that donates and returns its state, work on one CUDA stream): waiting for the last
  result then waits for all of them. The count grows until the batch lasts
  ``target_s`` (between ``min_iters`` and ``max_iters``).
  returns (seconds per call, the final state)
  """
  for _ in range(warmup):
    state = step(state)
  wait(state)
  t0 = time.perf_counter()
  state = step(state)
  wait(state)
  one = max(time.perf_counter() - t0, 1e-7)
  iters = int(min(max_iters, max(min_iters, math.ceil(target_s / one))))
  t0 = time.perf_counter()
  for _ in range(iters):
    state = step(state)
  wait(state)
  return (time.perf_counter() - t0) / iters, state


def device_copy_rate(nbytes: int) -> float:
  """Bytes of memory traffic per second (read and written) of an elementwise copy of
  ``nbytes`` in the default device's memory: the rate at which a kernel that only reads
  could read, the ceiling the probes set weight reads against."""
  import jax.numpy as jnp
  src = jnp.zeros((max(nbytes // 4, 1),), jnp.float32)
  s, _ = time_calls(jax.jit(lambda a: a + 1.0), src, min_iters=3, max_iters=50,
                    target_s=0.3, warmup=2)
  return 2 * src.nbytes / s


def same_length_requests(n: int, prompt: int, output: int, vocab: int, seed: int) -> list:
  """``n`` engine requests of ``prompt`` random tokens and ``output`` new tokens each."""
  import numpy as np
  from ula_jax.engine import Request
  rng = np.random.default_rng(seed)
  return [Request(id=f"r{i}", prompt=rng.integers(0, vocab, prompt).astype(np.int32),
                  max_new_tokens=output) for i in range(n)]


def overrides_for(system: str | None, overrides: Sequence[str]) -> list[str]:
  """``overrides`` less those of memory fields ``memory.system=system`` does not read
  (``config.schema.MEMORY_FIELD_USERS``; the config refuses them): ``memory.hisparse.*``
  but for ``hisparse``, ``memory.host_pool`` for ``resident``, ``memory.host_layout``
  but for ``ula``, ... One override list then serves a comparison of several systems.
  ``system`` None drops every such field (a config read for its model and mesh alone)."""
  from ula_jax.config.schema import MEMORY_FIELD_USERS

  def read(o: str) -> bool:
    if not o.startswith("memory.") or "=" not in o:
      return True
    users = MEMORY_FIELD_USERS.get(o[len("memory."):].split("=", 1)[0].split(".")[0])
    return users is None or (system is not None and system in users)

  return [o for o in overrides if read(o)]


def best_and_median(times: Sequence[float]) -> tuple[float | None, float | None]:
  """(fastest, median) of repeated measurements of one thing; (None, None) for none."""
  if not times:
    return None, None
  ordered = sorted(times)
  mid = len(ordered) // 2
  median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
  return ordered[0], median


def environment() -> dict:
  """Where and when a benchmark ran: backend, device, jax and Python versions, UTC date,
  and ``XLA_FLAGS`` where set (they can change what is measured)."""
  dev = jax.devices()[0]
  env = {"backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
         "jax": jax.__version__, "python": platform.python_version(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  flags = os.environ.get("XLA_FLAGS", "").strip()
  if flags:
    env["xla_flags"] = flags
  return env


def write_json(path: str | pathlib.Path, payload: dict) -> pathlib.Path:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=2, default=str))
  return path


def fmt(x: float | None, digits: int = 2) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
                left: Sequence[str] = ()) -> None:
  """A table with rich, or plain aligned text where rich is not installed."""
  try:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
  except ImportError:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(
        x.ljust(w) if c in left else x.rjust(w) for x, w, c in zip(cells, widths, columns))
    print(title)
    print(line(columns))
    for r in rows:
      print(line(r))
    return
  table = Table(title=escape(title))
  for c in columns:
    table.add_column(c, justify="left" if c in left else "right")
  for r in rows:
    # Labels such as "pallas[h64,k64]" would otherwise be read as rich markup and vanish.
    table.add_row(*(escape(c) for c in r))
  Console(width=200).print(table)
