"""The selection-trace format: what one dp rank's decoding selected, event by event.

A trace is one dp rank's stream of events, in the order the engine ran them:

* ``PREFILL``: a chunk of one request's prompt addresses was written (``row``: the batch
  row the request decodes in);
* ``DECODE``: one decode step: per layer group the selection ``sel_addr[t, g]``,
  ``sel_valid[t, g]``, and the step's new tokens ``new_addr[t]`` / ``active[t]``;
* ``RELEASE``: a finished request's addresses were freed (``row``: the row it vacates).

Addresses are the rank's logical addresses (``[0, num_logical)``, handed out in pages of
``page_size``), never device slots: a trace replays under any memory system and any pool
sizes (``traces.replay``).

Files. ``SelectionTrace.save(path)`` writes

* ``PATH.npz`` (``np.savez``, one array per field, scalars as 0-d arrays), or
* a directory ``PATH/`` holding ``trace.json`` (the scalar fields and the format
  version) and one ``FIELD.npy`` per array field. ``load`` maps the arrays from disk
  (``mmap_mode='r'``), so a GLM-5-sized trace (64 rows x 500 steps x 20 groups x 2048)
  is never read into memory whole: use this form for large traces.

``load_traces(path)`` also accepts a run directory (its ``trace_rank{d}.npz``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterator

import numpy as np

from ula_jax.core.types import INVALID, KVGeometry

PREFILL, DECODE, RELEASE = 0, 1, 2
EVENT_NAMES = {PREFILL: "prefill", DECODE: "decode", RELEASE: "release"}
FORMAT_VERSION = 2  # 1: no ``row`` field (rows are inferred on load)
META_FILE = "trace.json"
# Decode steps checked (or read) at a time, so a memory-mapped trace stays on disk.
STEP_CHUNK = 8


class TraceError(ValueError):
  """A trace file or directory that cannot be read (names the file and the field)."""


@dataclasses.dataclass(frozen=True)
class SelectionTrace:
  """One dp rank's recorded selections (numpy, possibly memory-mapped; ``E`` events,
  ``T`` decode steps, ``A`` prefill/release addresses, ``G`` groups, ``B`` rows, ``k``
  selected per row).

  kind:      [E] int8 PREFILL / DECODE / RELEASE, in the order they ran
  ref:       [E] int32 DECODE: the step ``t``; PREFILL/RELEASE: offset into ``addrs``
  count:     [E] int32 PREFILL/RELEASE: how many addresses (DECODE: 0)
  addrs:     [A] int32 the prefill and release addresses, event after event
  sel_addr:  [T, G, B, k] int32 logical addresses selected (INVALID where not valid)
  sel_valid: [T, G, B, k] bool
  new_addr:  [T, B] int32 each row's new token (INVALID for inactive rows)
  active:    [T, B] bool
  num_logical: logical addresses of the rank the trace was recorded on
  page_size, num_layers, group_size, entry_width, index_dim, kv_dtype: the run's
    engine page and KV geometry (so byte-sized pools convert to the same tokens)
  row:       [E] int32 PREFILL/RELEASE: the batch row of the event's request (-1 for
             DECODE). None when constructed: inferred from the events
             (``infer_rows``; exact for every request the trace releases)
  """

  kind: np.ndarray
  ref: np.ndarray
  count: np.ndarray
  addrs: np.ndarray
  sel_addr: np.ndarray
  sel_valid: np.ndarray
  new_addr: np.ndarray
  active: np.ndarray
  num_logical: int
  page_size: int
  num_layers: int
  group_size: int
  entry_width: int
  index_dim: int
  kv_dtype: str = "bfloat16"
  row: np.ndarray | None = None

  def __post_init__(self):
    if self.row is None:
      object.__setattr__(self, "row", infer_rows(self))

  @property
  def num_steps(self) -> int:
    return int(self.sel_addr.shape[0])

  @property
  def num_groups(self) -> int:
    return int(self.sel_addr.shape[1])

  @property
  def max_batch(self) -> int:
    return int(self.sel_addr.shape[2])

  @property
  def top_k(self) -> int:
    return int(self.sel_addr.shape[3])

  @property
  def num_selections(self) -> int:
    """Selection slots (steps x groups x rows x k), valid or not."""
    return int(np.prod(self.sel_addr.shape, dtype=np.int64))

  def geometry(self) -> KVGeometry:
    return KVGeometry(num_layers=self.num_layers, group_size=self.group_size,
                      entry_width=self.entry_width, index_dim=self.index_dim,
                      top_k=self.top_k, kv_dtype=self.kv_dtype)

  def event_addrs(self, e: int) -> np.ndarray:
    """[count] int32 the addresses of prefill / release event ``e``."""
    r, c = int(self.ref[e]), int(self.count[e])
    return np.asarray(self.addrs[r:r + c])

  def step_chunks(self, chunk: int = STEP_CHUNK) -> Iterator[tuple[int, int]]:
    """``(t0, t1)`` ranges of at most ``chunk`` decode steps covering the trace."""
    for t0 in range(0, self.num_steps, chunk):
      yield t0, min(t0 + chunk, self.num_steps)

  def validate(self) -> None:
    """Raises ValueError naming the inconsistent field. Decode steps are read
    ``STEP_CHUNK`` at a time (a memory-mapped trace stays on disk)."""
    T, G, B, k = self.sel_addr.shape if self.sel_addr.ndim == 4 else (None,) * 4
    if T is None:
      raise ValueError(f"trace.sel_addr has shape {self.sel_addr.shape}: expected "
                       f"[steps, groups, batch, k]")
    shapes = {"sel_valid": (self.sel_valid, (T, G, B, k)), "new_addr": (self.new_addr, (T, B)),
              "active": (self.active, (T, B)), "ref": (self.ref, self.kind.shape),
              "count": (self.count, self.kind.shape), "row": (self.row, self.kind.shape)}
    for name, (arr, want) in shapes.items():
      if arr.shape != want:
        raise ValueError(f"trace.{name} has shape {arr.shape}: expected {want}")
    if G != -(-self.num_layers // self.group_size):
      raise ValueError(f"trace.sel_addr has {G} layer groups; num_layers={self.num_layers} "
                       f"and group_size={self.group_size} make "
                       f"{-(-self.num_layers // self.group_size)}")
    bad = ~np.isin(self.kind, list(EVENT_NAMES))
    if bad.any():
      raise ValueError(f"trace.kind={int(self.kind[bad][0])}: expected one of "
                       f"{sorted(EVENT_NAMES)} (prefill, decode, release)")
    dec = self.kind == DECODE
    if not np.array_equal(np.sort(self.ref[dec]), np.arange(T)):
      raise ValueError(f"trace.ref: the decode events name steps {self.ref[dec].tolist()}; "
                       f"expected each of 0..{T - 1} once")
    io = ~dec
    if (self.ref[io] < 0).any() or (self.ref[io] + self.count[io] > self.addrs.shape[0]).any():
      raise ValueError(f"trace.ref/count: a prefill or release range falls outside "
                       f"trace.addrs (length {self.addrs.shape[0]})")
    if ((self.row[io] < -1) | (self.row[io] >= B)).any():
      raise ValueError(f"trace.row: a prefill or release event names a row outside "
                       f"[0, {B}) (max_batch)")
    top = int(self.addrs.max()) if self.addrs.size else -1
    for t0, t1 in self.step_chunks():
      sa, sv = np.asarray(self.sel_addr[t0:t1]), np.asarray(self.sel_valid[t0:t1])
      na, ac = np.asarray(self.new_addr[t0:t1]), np.asarray(self.active[t0:t1])
      if (sa[sv] < 0).any():
        raise ValueError(f"trace.sel_addr: a valid selection of steps {t0}..{t1 - 1} is "
                         f"negative; valid selections are addresses >= 0")
      if (na[ac] < 0).any():
        raise ValueError(f"trace.new_addr: an active row of steps {t0}..{t1 - 1} has no "
                         f"address (INVALID)")
      used = [sa[sv], na[ac]]
      top = max([top] + [int(a.max()) for a in used if a.size])
    if top >= self.num_logical:
      raise ValueError(f"trace.num_logical={self.num_logical}: the trace uses address {top}")

  # -- files ------------------------------------------------------------------------

  def save(self, path) -> Path:
    """``PATH.npz`` (a path ending in ``.npz``) or a directory ``PATH/`` of ``.npy``
    files (any other path); returns the path written."""
    path = Path(path)
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    if path.suffix == ".npz":
      np.savez(path, **{k: np.asarray(v) for k, v in fields.items()},
               format_version=np.asarray(FORMAT_VERSION))
      return path
    path.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": FORMAT_VERSION}
    for name, value in fields.items():
      if isinstance(value, np.ndarray):
        np.save(path / f"{name}.npy", value)
      else:
        meta[name] = value
    (path / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return path

  @classmethod
  def load(cls, path, *, mmap: bool = True) -> SelectionTrace:
    """Reads ``save``'s ``.npz`` or directory (arrays memory-mapped when ``mmap``).
    TraceError naming the file and the field when it is not a trace."""
    path = Path(path)
    names = [f.name for f in dataclasses.fields(cls)]
    required = [n for n in names if n != "row"]
    kw: dict = {}
    if path.is_dir():
      meta_path = path / META_FILE
      try:
        meta = json.loads(meta_path.read_text())
      except FileNotFoundError:
        raise TraceError(f"{path}: not a trace directory (no {META_FILE})") from None
      except ValueError as e:
        raise TraceError(f"{meta_path}: not valid JSON ({e})") from None
      for name in names:
        npy = path / f"{name}.npy"
        if name in meta:
          kw[name] = meta[name]
        elif npy.is_file():
          kw[name] = np.load(npy, mmap_mode="r" if mmap else None)
        elif name in required:
          raise TraceError(f"{path}: field {name!r} missing (neither in {META_FILE} nor "
                           f"{name}.npy)")
    else:
      try:
        z = np.load(path)
      except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
      except (OSError, ValueError) as e:
        raise TraceError(f"{path}: not a trace .npz ({e})") from None
      with z:
        missing = [n for n in required if n not in z.files]
        if missing:
          raise TraceError(f"{path}: not a selection trace: field(s) {missing} missing")
        for name in names:
          if name in z.files:
            v = z[name]
            kw[name] = v.item() if v.ndim == 0 else v
    kw["kv_dtype"] = str(kw.get("kv_dtype", "bfloat16"))
    for name in ("num_logical", "page_size", "num_layers", "group_size", "entry_width",
                 "index_dim"):
      kw[name] = int(kw[name])
    return cls(**kw)

  def take_rows(self, rows) -> SelectionTrace:
    """The trace of a subset of batch rows (their requests' events and selections,
    renumbered ``0..len(rows)-1``). Per-request systems (hisparse) and per-request
    statistics are exact on it; a shared pool (ula) sees less pressure."""
    rows = np.asarray(rows, np.int64)
    new_of = np.full((self.max_batch,), -1, np.int32)
    new_of[rows] = np.arange(rows.shape[0], dtype=np.int32)
    keep = (self.kind == DECODE) | np.isin(self.row, rows)
    parts, ref, count = [], [], []
    n = 0
    for e in np.flatnonzero(keep):
      if self.kind[e] == DECODE:
        ref.append(int(self.ref[e]))
        count.append(0)
        continue
      a = self.event_addrs(e)
      parts.append(a)
      ref.append(n)
      count.append(a.shape[0])
      n += a.shape[0]
    return dataclasses.replace(
        self, kind=np.asarray(self.kind[keep]), ref=np.asarray(ref, np.int32),
        count=np.asarray(count, np.int32),
        addrs=np.concatenate(parts).astype(np.int32) if parts else np.zeros((0,), np.int32),
        sel_addr=np.asarray(self.sel_addr[:, :, rows]),
        sel_valid=np.asarray(self.sel_valid[:, :, rows]),
        new_addr=np.asarray(self.new_addr[:, rows]), active=np.asarray(self.active[:, rows]),
        row=np.where(self.kind[keep] == DECODE, -1, new_of[np.maximum(self.row[keep], 0)]))


def load_traces(path) -> list[SelectionTrace]:
  """The traces at ``path``: a trace (``.npz`` or directory) or a run directory written
  with ``engine.record_trace`` (its ``trace_rank{d}.npz``, rank order). TraceError
  naming the path when there is none."""
  path = Path(path)
  if path.is_dir() and not (path / META_FILE).is_file():
    ranks = sorted(path.glob("trace_rank*.npz"), key=lambda p: int(p.stem[10:] or 0))
    if not ranks:
      raise TraceError(f"{path}: neither a trace directory (no {META_FILE}) nor a run "
                       f"directory with trace_rank*.npz (engine.record_trace=true)")
    return [SelectionTrace.load(p) for p in ranks]
  return [SelectionTrace.load(path)]


# ----------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceRequests:
  """The requests of a trace, from its events (``R`` requests).

  step_req:   [T, B] int32 the request decoding in each row at each step (-1: none)
  step_pos:   [T, B] int32 the position of its new token (its context is step_pos + 1)
  row:        [R] int32 the row each request held
  prompt_len: [R] int64 entries its prefill events wrote
  steps:      [R] int64 its decode steps
  released:   [R] bool the trace frees its addresses
  """

  step_req: np.ndarray
  step_pos: np.ndarray
  row: np.ndarray
  prompt_len: np.ndarray
  steps: np.ndarray
  released: np.ndarray

  @property
  def num_requests(self) -> int:
    return int(self.row.shape[0])


def trace_requests(trace: SelectionTrace) -> TraceRequests:
  """A request holds its row from its first prefill event to its release; its decode
  steps are the steps its row is active in between; its position at a step is the
  entries it has written (prefill, then one per decode step)."""
  kind, ref, row = np.asarray(trace.kind), np.asarray(trace.ref), np.asarray(trace.row)
  count, active = np.asarray(trace.count), np.asarray(trace.active)
  T, B = active.shape
  step_req = np.full((T, B), -1, np.int32)
  step_pos = np.zeros((T, B), np.int32)
  open_ = np.full((B,), -1, np.int64)
  rows, prompt, steps, written, released = [], [], [], [], []

  def new(b: int) -> int:
    rows.append(b)
    prompt.append(0)
    steps.append(0)
    written.append(0)
    released.append(False)
    open_[b] = len(rows) - 1
    return len(rows) - 1

  for e in range(kind.shape[0]):
    if kind[e] == DECODE:
      t = int(ref[e])
      for b in np.flatnonzero(active[t]):
        r = int(open_[b]) if open_[b] >= 0 else new(int(b))
        step_req[t, b], step_pos[t, b] = r, written[r]
        written[r] += 1
        steps[r] += 1
      continue
    b = int(row[e])
    if b < 0:
      continue
    if kind[e] == PREFILL:
      r = int(open_[b]) if open_[b] >= 0 else new(b)
      prompt[r] += int(count[e])
      written[r] += int(count[e])
    elif open_[b] >= 0:
      released[int(open_[b])] = True
      open_[b] = -1
  return TraceRequests(step_req=step_req, step_pos=step_pos, row=np.asarray(rows, np.int32),
                       prompt_len=np.asarray(prompt, np.int64),
                       steps=np.asarray(steps, np.int64),
                       released=np.asarray(released, bool))


# ----------------------------------------------------------------------------------
# Rows of prefill and release events
# ----------------------------------------------------------------------------------


def infer_rows(trace: SelectionTrace) -> np.ndarray:
  """[E] int32 the batch row of each prefill and release event (-1 for decode events),
  for traces recorded without rows.

  A request holds one row from admission to release, and its decode steps name the row
  (``new_addr[t, b]``). Going backward over the events, each address belongs to the next
  release that frees it: a prefill or release belongs to the request of that release,
  whose row its decode steps give. A request the trace never releases (the run stopped)
  owns its row to the end: its prefill events belong to the first such request to start
  decoding after them (a rank prefills one request at a time). What remains (a request
  that never decoded) gets a row that no known request holds at the time; that choice
  moves no count, only which free row a buffer-per-row system warms.
  """
  kind, ref, count = np.asarray(trace.kind), np.asarray(trace.ref), np.asarray(trace.count)
  E, B = kind.shape[0], trace.sel_addr.shape[2] if trace.sel_addr.ndim == 4 else 0
  rows = np.full((E,), -1, np.int32)
  if B == 0 or E == 0:
    return rows
  new_addr, active = np.asarray(trace.new_addr), np.asarray(trace.active)
  addrs = np.asarray(trace.addrs)
  N = max(int(trace.num_logical), int(addrs.max(initial=-1)) + 1,
          int(new_addr.max(initial=-1)) + 1)
  owner = np.full((N,), -1, np.int64)  # the release event that next frees an address
  req_of = np.full((E,), -1, np.int64)  # prefill/release -> its request's release event
  row_of_req: dict[int, int] = {}
  # Requests the trace never releases, keyed ('open', row): their first decode event.
  open_start: dict[int, int] = {}
  for e in range(E - 1, -1, -1):
    if kind[e] == RELEASE:
      a = addrs[ref[e]:ref[e] + count[e]]
      owner[a[a >= 0]] = e
      req_of[e] = e
    elif kind[e] == PREFILL:
      a = addrs[ref[e]:ref[e] + count[e]]
      a = a[a >= 0]
      req_of[e] = owner[a[0]] if a.size else -1
    elif kind[e] == DECODE:
      t = int(ref[e])
      b = np.flatnonzero(active[t])
      for bi, r in zip(b.tolist(), owner[np.clip(new_addr[t, b], 0, N - 1)].tolist()):
        if r >= 0:
          row_of_req[r] = bi
        else:
          open_start[bi] = e  # backward: ends at the first decode of the open request
  starts = sorted((e, b) for b, e in open_start.items())
  occupied: list[tuple[int, int, int]] = []  # (first event, last event, row)
  unknown: dict[int, list[int]] = {}
  for e in range(E):
    if kind[e] == DECODE:
      continue
    r = int(req_of[e])
    if r >= 0 and r in row_of_req:
      rows[e] = row_of_req[r]
    elif r < 0 and kind[e] == PREFILL:
      nxt = next((b for s, b in starts if s > e), None)
      if nxt is not None:
        rows[e] = nxt
      else:
        unknown.setdefault(-1 - e, []).append(e)
    else:
      unknown.setdefault(r, []).append(e)
  # Rows held by known requests, from their first event to their release (or the end).
  first_of: dict[int, int] = {}
  for e in range(E):
    if kind[e] != DECODE and rows[e] >= 0:
      key = int(req_of[e]) if req_of[e] >= 0 else -2 - int(rows[e])
      first_of.setdefault(key, e)
  for key, first in first_of.items():
    last = key if key >= 0 else E
    occupied.append((first, last, int(rows[first])))
  for events in unknown.values():
    lo, hi = min(events), max(events)
    busy = {b for f, l, b in occupied if f <= hi and l >= lo}
    free = next((b for b in range(B) if b not in busy), 0)
    rows[events] = free
    occupied.append((lo, hi, free))
  return rows


# ----------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------


class TraceRecorder:
  """Builds a ``SelectionTrace`` from the events of one dp rank, in order."""

  def __init__(self, geometry: KVGeometry, *, max_batch: int, num_logical: int,
               page_size: int):
    self.geo, self.B = geometry, max_batch
    self.num_logical, self.page_size = num_logical, page_size
    self._kind: list[int] = []
    self._ref: list[int] = []
    self._count: list[int] = []
    self._row: list[int] = []
    self._addrs: list[np.ndarray] = []
    self._n_addrs = 0
    self._steps: list[tuple[np.ndarray, ...]] = []

  def _io(self, kind: int, addrs, valid, row) -> None:
    a = np.asarray(addrs, np.int32).reshape(-1)
    if valid is not None:
      a = a[np.asarray(valid, bool).reshape(-1)]
    a = a[a >= 0]
    self._kind.append(kind)
    self._ref.append(self._n_addrs)
    self._count.append(a.shape[0])
    self._row.append(-1 if row is None else int(row))
    self._addrs.append(a)
    self._n_addrs += a.shape[0]

  def prefill(self, addrs, valid=None, row=None) -> None:
    """addrs: [C] int32 written by one prefill chunk (valid: [C] bool, optional); row:
    the batch row of the request (None: inferred when the trace is built)."""
    self._io(PREFILL, addrs, valid, row)

  def release(self, addrs, valid=None, row=None) -> None:
    """addrs: [N] int32 freed (valid: [N] bool, optional); row: the row vacated."""
    self._io(RELEASE, addrs, valid, row)

  def decode(self, sel_addr, sel_valid, new_addr, active) -> None:
    """sel_addr/sel_valid: [G, B, k]; new_addr/active: [B] (one decode step)."""
    sel_valid = np.asarray(sel_valid, bool)
    sel_addr = np.where(sel_valid, np.asarray(sel_addr, np.int32), INVALID)
    active = np.asarray(active, bool)
    new_addr = np.where(active, np.asarray(new_addr, np.int32), INVALID)
    self._kind.append(DECODE)
    self._ref.append(len(self._steps))
    self._count.append(0)
    self._row.append(-1)
    self._steps.append((sel_addr, sel_valid, new_addr, active))

  def build(self) -> SelectionTrace:
    G, B, k = self.geo.num_groups, self.B, self.geo.top_k
    cols = list(zip(*self._steps)) if self._steps else [[]] * 4
    stack = lambda xs, shape, dtype: (np.stack(xs).astype(dtype) if xs
                                      else np.zeros((0, *shape), dtype))
    kind = np.asarray(self._kind, np.int8)
    row = np.asarray(self._row, np.int32)
    trace = SelectionTrace(
        kind=kind, ref=np.asarray(self._ref, np.int32),
        count=np.asarray(self._count, np.int32),
        addrs=(np.concatenate(self._addrs).astype(np.int32) if self._addrs
               else np.zeros((0,), np.int32)),
        sel_addr=stack(cols[0], (G, B, k), np.int32),
        sel_valid=stack(cols[1], (G, B, k), bool),
        new_addr=stack(cols[2], (B,), np.int32), active=stack(cols[3], (B,), bool),
        num_logical=self.num_logical, page_size=self.page_size,
        num_layers=self.geo.num_layers, group_size=self.geo.group_size,
        entry_width=self.geo.entry_width, index_dim=self.geo.index_dim,
        kv_dtype=self.geo.kv_dtype, row=None)
    given = (kind != DECODE) & (row >= 0)
    if given.any():  # rows the engine named win over the inferred ones
      trace = dataclasses.replace(trace, row=np.where(given, row, trace.row).astype(np.int32))
    trace.validate()
    return trace
