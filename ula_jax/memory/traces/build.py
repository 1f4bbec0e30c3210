"""Building traces from per-request selections: a batch schedule, addresses, the files.

The generator (``generate.py``) and the SGLang importer (``sglang.py``) know each
request's prompt length, its decode steps and, per decode step, the positions selected in
each layer group. ``plan_schedule`` serves the requests the way the engine does on one dp
rank: ``max_batch`` rows, first come first served, a request admitted when a row is free
(its pages allocated for its whole length), its prompt written in chunks of
``prefill_chunk`` before its first decode step, one decode step per engine step for every
admitted request, and its addresses released after its last step. ``write_trace`` turns
positions into the rank's logical addresses and writes the trace (``.npz`` in memory, or
a directory of memory-mapped ``.npy`` files, step by step).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np

from ula_jax.core.addressing import PageAllocator
from ula_jax.core.types import INVALID, KVGeometry
from ula_jax.memory.traces.format import (DECODE, FORMAT_VERSION, META_FILE, PREFILL,
                                          RELEASE, SelectionTrace)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Requests served on one rank, as events.

  events:    (kind, request, a, b): PREFILL positions [a, b) of the request; DECODE step
             a; RELEASE positions [0, b)
  step_req:  [T, B] int32 the request decoding in each row (-1: none)
  step_pos:  [T, B] int32 the position of its new token (its context is step_pos + 1)
  row:       [R] int32 each request's row
  pages:     per request, [ceil(total / page_size)] int32 its logical pages
  num_logical: addresses the rank needs (the most pages in use at once x page_size)
  """

  events: list[tuple[int, int, int, int]]
  step_req: np.ndarray
  step_pos: np.ndarray
  row: np.ndarray
  pages: list[np.ndarray]
  num_logical: int
  page_size: int

  @property
  def num_steps(self) -> int:
    return int(self.step_req.shape[0])

  def addrs(self, r: int, pos: np.ndarray) -> np.ndarray:
    """Logical addresses of request ``r``'s positions ``pos`` (any shape, >= 0)."""
    p = self.page_size
    return (self.pages[r][pos // p] * p + pos % p).astype(np.int32)


def plan_schedule(prompt_lens, decode_steps, *, max_batch: int, page_size: int,
                  prefill_chunk: int) -> Schedule:
  """Serves requests with ``prompt_lens[i]`` prompt tokens and ``decode_steps[i]``
  decode steps (``i`` in arrival order, all waiting at the start) on one rank."""
  prompt = np.asarray(prompt_lens, np.int64)
  steps = np.asarray(decode_steps, np.int64)
  R, B = prompt.shape[0], max_batch
  if (prompt < 1).any() or (steps < 0).any():
    raise ValueError("plan_schedule: prompt lengths must be >= 1 and decode steps >= 0")
  total = prompt + steps
  need = -(-total // page_size)
  # First pass: the schedule; the pages in use at once size the rank's address space.
  events: list[tuple[int, int, int, int]] = []
  rows: list[int | None] = [None] * B
  left = steps.copy()
  row_of = np.full((R,), -1, np.int32)
  step_req, step_pos = [], []
  nxt, in_use, peak, t = 0, 0, 0, 0
  while nxt < R or any(r is not None for r in rows):
    for b in range(B):
      if rows[b] is None and nxt < R:
        r, nxt = nxt, nxt + 1
        rows[b], row_of[r] = r, b
        in_use += int(need[r])
        peak = max(peak, in_use)
        for a in range(0, int(prompt[r]), prefill_chunk):
          events.append((PREFILL, r, a, min(a + prefill_chunk, int(prompt[r]))))
    live = [(b, r) for b, r in enumerate(rows) if r is not None and left[r] > 0]
    if live:
      req = np.full((B,), -1, np.int32)
      pos = np.zeros((B,), np.int32)
      for b, r in live:
        req[b] = r
        pos[b] = int(total[r] - left[r])
        left[r] -= 1
      events.append((DECODE, -1, t, 0))
      step_req.append(req)
      step_pos.append(pos)
      t += 1
    for b, r in enumerate(rows):
      if r is not None and left[r] == 0:
        events.append((RELEASE, r, 0, int(total[r])))
        rows[b] = None
        in_use -= int(need[r])
  alloc = PageAllocator(max(peak, 1))
  pages: list[np.ndarray] = [np.zeros((0,), np.int32)] * R
  for kind, r, _, _ in events:  # allocation order = admission order, frees in between
    if kind == PREFILL and pages[r].shape[0] == 0:
      pages[r] = alloc.allocate(int(need[r]))
    elif kind == RELEASE:
      alloc.free(pages[r])
  empty = np.zeros((0, B), np.int32)
  return Schedule(events=events,
                  step_req=np.stack(step_req) if step_req else empty,
                  step_pos=np.stack(step_pos) if step_pos else empty,
                  row=row_of, pages=pages, num_logical=max(peak, 1) * page_size,
                  page_size=page_size)


# Positions selected at one decode step: [G, B, k] int32 (-1 where none), given the step
# index, the request in each row ([B], -1: none) and its new token's position ([B]).
SelectFn = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


def write_trace(schedule: Schedule, select: SelectFn, geometry: KVGeometry, out, *,
                source: dict | None = None,
                on_step: Callable[[int], None] | None = None) -> Path:
  """Writes the trace of ``schedule`` with ``select``'s positions to ``out`` (``.npz``:
  built in memory; otherwise a trace directory, the selections written step by step to
  memory-mapped files). ``source`` (how the trace was made) goes into the trace's
  metadata. Returns the path."""
  out = Path(out)
  T, B = schedule.step_req.shape if schedule.num_steps else (0, schedule.step_req.shape[1])
  G, k = geometry.num_groups, geometry.top_k
  shape = (T, G, B, k)
  if out.suffix == ".npz":
    sel_addr = np.full(shape, INVALID, np.int32)
    sel_valid = np.zeros(shape, bool)
  else:
    out.mkdir(parents=True, exist_ok=True)
    mm = lambda name, dtype: np.lib.format.open_memmap(out / f"{name}.npy", mode="w+",
                                                       dtype=dtype, shape=shape)
    sel_addr, sel_valid = mm("sel_addr", np.int32), mm("sel_valid", np.bool_)
  new_addr = np.full((T, B), INVALID, np.int32)
  active = schedule.step_req >= 0
  kind, ref, count, row, parts = [], [], [], [], []
  n_addrs = 0
  for ev, r, a, b in schedule.events:
    kind.append(ev)
    if ev == DECODE:
      t = a
      req, pos = schedule.step_req[t], schedule.step_pos[t]
      sel = np.asarray(select(t, req, pos), np.int64)
      if sel.shape != (G, B, k):
        raise ValueError(f"selections of step {t} have shape {sel.shape}; expected "
                         f"{(G, B, k)} (groups, rows, top-k)")
      addr = np.full((G, B, k), INVALID, np.int32)
      for bi in np.flatnonzero(req >= 0):
        p = sel[:, bi]
        ok = p >= 0
        addr[:, bi][ok] = schedule.addrs(int(req[bi]), p[ok])
        new_addr[t, bi] = schedule.addrs(int(req[bi]), np.asarray(pos[bi]))
      sel_addr[t] = addr
      sel_valid[t] = addr >= 0
      ref.append(t)
      count.append(0)
      row.append(-1)
      if on_step is not None:
        on_step(t + 1)
      continue
    addrs = schedule.addrs(r, np.arange(a, b))
    parts.append(addrs)
    ref.append(n_addrs)
    count.append(addrs.shape[0])
    row.append(int(schedule.row[r]))
    n_addrs += addrs.shape[0]
  fields = dict(
      kind=np.asarray(kind, np.int8), ref=np.asarray(ref, np.int32),
      count=np.asarray(count, np.int32),
      addrs=np.concatenate(parts).astype(np.int32) if parts else np.zeros((0,), np.int32),
      new_addr=new_addr, active=active, row=np.asarray(row, np.int32))
  scalars = dict(num_logical=schedule.num_logical, page_size=schedule.page_size,
                 num_layers=geometry.num_layers, group_size=geometry.group_size,
                 entry_width=geometry.entry_width, index_dim=geometry.index_dim,
                 kv_dtype=str(geometry.kv_dtype))
  if out.suffix == ".npz":
    trace = SelectionTrace(sel_addr=sel_addr, sel_valid=sel_valid, **fields, **scalars)
    trace.validate()
    np.savez(out, **{f.name: np.asarray(getattr(trace, f.name))
                     for f in dataclasses.fields(trace)},
             format_version=np.asarray(FORMAT_VERSION),
             source_json=np.asarray(json.dumps(source or {})))
    return out
  sel_addr.flush()
  sel_valid.flush()
  del sel_addr, sel_valid
  for name, arr in fields.items():
    np.save(out / f"{name}.npy", arr)
  meta = {"format_version": FORMAT_VERSION, **scalars, "source": source or {}}
  (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
  SelectionTrace.load(out).validate()
  return out


def trace_source(path) -> dict:
  """How the trace at ``path`` was made (the generator's or importer's arguments), ``{}``
  when it does not say (a recorded trace)."""
  path = Path(path)
  try:
    if path.is_dir():
      return json.loads((path / META_FILE).read_text()).get("source") or {}
    with np.load(path) as z:
      return json.loads(str(z["source_json"])) if "source_json" in z.files else {}
  except (OSError, ValueError, KeyError):
    return {}
