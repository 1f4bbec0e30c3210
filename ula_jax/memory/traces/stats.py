"""Locality statistics of selection traces (``ula-jax trace stats``, run summaries).

Per layer group and per context length (``2^i .. 2^(i+1)`` tokens), from one pass over
the trace's events (NumPy, a decode step at a time):

* **overlap**: ``|S_t & S_(t-1)| / |S_t|`` of a request's consecutive decode steps in one
  group (``S``: the positions it selected, its own new token included; ``/ k`` once
  ``k`` are selected);
* **reuse distance**: for each selected entry, the decode steps since the same group of
  the same request last selected it or wrote it (a new token); an entry of the prompt
  selected for the first time counts as ``first use``. Histogram over ``1, 2, 3-4, ...,
  257-512, >512``;
* **per-request LRU buffer** (HiSparse's sizing question): the miss rate of an exact-LRU
  buffer per request and group of ``c`` entries plus one slot for the new token (as
  HiSparse sizes ``device_buffer_size = c``), for ``c`` = k, 2k and 4k. A selected entry
  not in the buffer is a miss and is brought in; each new token is inserted; the
  prefill leaves the prompt's last ``c + 1`` entries in it; the entries least recently
  used leave first (within a step, those earlier in the selection first). The new
  token's own selection is not looked up;
* **shared pool** (``shared_pool``, optional): the hit rate of one ``ula`` device pool
  with as many slots as the rows' buffers together (``max_batch x (c + 1)``) under
  ``pb_lru`` and ``lru``, by replaying the trace (``traces.replay``, NumPy engine).

Large traces: the per-request statistics are exact on any subset of batch rows, so a
trace with more than ``max_selections`` selection slots is measured on a seeded sample of
its rows (``sampled_rows`` says which); the shared pool always replays every row.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ula_jax.core.types import INVALID
from ula_jax.memory.traces.format import PREFILL, RELEASE, SelectionTrace, trace_requests

REUSE_EDGES = [1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513]  # bin i holds [edge_i, edge_i+1)
REUSE_LABELS = ["1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65-128", "129-256",
                "257-512", ">512"]
CAPACITY_FACTORS = (1, 2, 4)
MAX_SELECTIONS = 1 << 28


def context_label(i: int) -> str:
  """The context bucket ``[2^i, 2^(i+1))`` as text (``64K-128K``)."""
  def short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
      if n >= size and n % size == 0:
        return f"{n // size}{unit}"
    return str(n)
  return f"{short(1 << i)}-{short(1 << (i + 1))}"


class _Lru:
  """Exact-LRU buffers of ``Q`` slots for every (group, row): ``buf[g, b]`` holds
  addresses oldest first, right-aligned (INVALID in front); ``pos[g, a]`` is address
  ``a``'s slot in its row's buffer of group ``g`` (-1: not there)."""

  def __init__(self, G: int, B: int, Q: int, N: int):
    self.Q = Q
    self.buf = np.full((G, B, Q), INVALID, np.int64)
    self.pos = np.full((G, N), -1, np.int16 if Q < (1 << 15) else np.int32)

  def _push(self, g: np.ndarray, b: np.ndarray, cand: np.ndarray) -> None:
    """Appends ``cand`` [n, m] (INVALID: none; newest last) to the buffers of the pairs
    ``(g[i], b[i])``; the oldest past ``Q`` leave."""
    whole = np.concatenate([self.buf[g, b], cand], axis=1)  # [n, Q + m]
    keep = whole >= 0
    from_right = np.cumsum(keep[:, ::-1], axis=1)[:, ::-1]
    stay = keep & (from_right <= self.Q)
    gg = np.broadcast_to(g[:, None], whole.shape)
    out = keep & ~stay
    self.pos[gg[out], whole[out]] = -1
    i, j = np.nonzero(stay)
    slot = self.Q - from_right[i, j]
    new = np.full((g.shape[0], self.Q), INVALID, np.int64)
    new[i, slot] = whole[i, j]
    self.pos[g[i], whole[i, j]] = slot
    self.buf[g, b] = new

  def prefill(self, G: int, b: int, addrs: np.ndarray) -> None:
    a = addrs[-self.Q:]
    self._push(np.arange(G), np.full((G,), b), np.broadcast_to(a, (G, a.shape[0])))

  def step(self, sel: np.ndarray, look: np.ndarray, new: np.ndarray, rows: np.ndarray
           ) -> np.ndarray:
    """One decode step of rows ``rows`` ([n]): sel [G, n, k] addresses, look [G, n, k]
    the entries looked up (valid, first of their address, not the new token), new [n]
    the new tokens. Hits and misses become the newest entries in selection order, the
    new token last. Returns misses [G, n]."""
    G, n = sel.shape[0], rows.shape[0]
    gi = np.broadcast_to(np.arange(G)[:, None, None], sel.shape)
    where = np.where(look, self.pos[gi, np.maximum(sel, 0)], -1)
    hit = look & (where >= 0)
    g3, n3, k3 = np.nonzero(hit)
    self.buf[g3, rows[n3], where[g3, n3, k3]] = INVALID  # they move to the newest end
    cand = np.concatenate([np.where(look, sel, INVALID),
                           np.broadcast_to(new[None, :, None], (G, n, 1))], axis=2)
    self._push(np.repeat(np.arange(G), n), np.tile(rows, G), cand.reshape(G * n, -1))
    return (look & ~hit).sum(axis=2)

  def release(self, b: int) -> None:
    held = self.buf[:, b]
    g, j = np.nonzero(held >= 0)
    self.pos[g, held[g, j]] = -1
    self.buf[:, b] = INVALID


def _first_mask(sel: np.ndarray, valid: np.ndarray, scratch: np.ndarray) -> np.ndarray:
  """[G, n, k] valid and the first occurrence of its address in its group (selections
  rarely repeat one; repeats are found with a scatter and counted once)."""
  first = valid.copy()
  for g in range(sel.shape[0]):
    v = valid[g]
    a = sel[g][v]
    j = np.arange(a.shape[0], dtype=np.int64)
    scratch[a] = j
    won = scratch[a] == j
    if not won.all():
      f = np.zeros(v.shape, bool)
      f[v] = won
      first[g] = f
  return first


def locality_stats(traces: Sequence[SelectionTrace], *, max_selections: int = MAX_SELECTIONS,
                   capacities: Sequence[int] = CAPACITY_FACTORS, seed: int = 0,
                   shared_pool: bool = False, page_size: int | None = None) -> dict[str, Any]:
  """The statistics of one run's traces (one per dp rank; counts are summed).

  max_selections: above this many selection slots (steps x groups x rows x k) a trace's
    per-request statistics use a seeded sample of its rows
  capacities: buffer sizes as multiples of k
  shared_pool: also replay the ula pool at the same memory under pb_lru and lru
  returns a JSON-able dict (``format_table`` / ``report.locality`` show it)
  """
  if not traces:
    raise ValueError("locality_stats: no trace")
  G, k = traces[0].num_groups, traces[0].top_k
  for t in traces[1:]:
    if (t.num_groups, t.top_k) != (G, k):
      raise ValueError(f"traces of one run must share groups and top-k: {(G, k)} vs "
                       f"{(t.num_groups, t.top_k)}")
  acc = _Acc(G, len(REUSE_LABELS), capacities)
  sampled = []
  for i, trace in enumerate(traces):
    rows = _sample_rows(trace, max_selections, seed + i)
    sampled.append(rows.tolist() if rows.shape[0] < trace.max_batch else "all")
    _measure(trace, rows, capacities, acc)
  out = acc.result(k)
  out["trace"] = {
      "ranks": len(traces), "steps": sum(t.num_steps for t in traces), "groups": G,
      "rows": traces[0].max_batch, "top_k": k,
      "selection_slots": sum(t.num_selections for t in traces),
      "sampled_rows": sampled if len(traces) > 1 else sampled[0],
  }
  if shared_pool:
    out["shared_pool"] = shared_pool_rates(traces, capacities)
  return out


def _sample_rows(trace: SelectionTrace, budget: int, seed: int) -> np.ndarray:
  B = trace.max_batch
  per_row = max(trace.num_steps * trace.num_groups * trace.top_k, 1)
  n = min(B, max(1, budget // per_row))
  if n >= B:
    return np.arange(B)
  return np.sort(np.random.default_rng(seed).choice(B, size=n, replace=False))


class _Acc:
  """Sums over traces: per group (G) and per context bucket (up to 40)."""

  def __init__(self, G: int, bins: int, capacities: Sequence[int]):
    self.G, self.C = G, 40
    self.ov = np.zeros((G, self.C))  # overlap sums
    self.ov_n = np.zeros((G, self.C), np.int64)
    self.reuse = np.zeros((G, self.C, bins), np.int64)
    self.first_use = np.zeros((G, self.C), np.int64)
    self.capacities = tuple(capacities)
    self.miss = np.zeros((len(capacities), G, self.C), np.int64)
    self.look = np.zeros((len(capacities), G, self.C), np.int64)

  def result(self, k: int) -> dict[str, Any]:
    used = np.flatnonzero(self.ov_n.sum(0) + self.look[0].sum(0) + self.first_use.sum(0))
    labels = [context_label(int(i)) for i in used]

    def rate(num, den):
      return float(num / den) if den else None

    overlap = {
        "mean": rate(self.ov.sum(), self.ov_n.sum()),
        "per_group": [rate(self.ov[g].sum(), self.ov_n[g].sum()) for g in range(self.G)],
        "per_context": {l: rate(self.ov[:, i].sum(), self.ov_n[:, i].sum())
                        for l, i in zip(labels, used)},
        "pairs": int(self.ov_n.sum()),
    }
    reuse = {
        "bins": list(REUSE_LABELS), "counts": self.reuse.sum(axis=(0, 1)).tolist(),
        "first_use": int(self.first_use.sum()),
        "per_group": self.reuse.sum(axis=1).tolist(),
        "per_context": {l: self.reuse[:, i].sum(axis=0).tolist() for l, i in zip(labels, used)},
    }
    lru = {}
    for c, f in enumerate(self.capacities):
      m, n = self.miss[c], self.look[c]
      lru[f"{f}k" if f != 1 else "k"] = {
          "entries": f * k, "slots": f * k + 1,
          "miss_rate": rate(m.sum(), n.sum()), "lookups": int(n.sum()),
          "per_group": [rate(m[g].sum(), n[g].sum()) for g in range(self.G)],
          "per_context": {l: rate(m[:, i].sum(), n[:, i].sum()) for l, i in zip(labels, used)},
      }
    return {"overlap": overlap, "reuse_distance": reuse, "lru_buffer": lru}


def _measure(trace: SelectionTrace, rows: np.ndarray, capacities: Sequence[int],
             acc: _Acc) -> None:
  G, k, N = trace.num_groups, trace.top_k, trace.num_logical
  reqs = trace_requests(trace)
  last_sel = np.full((G, N), -1, np.int32)
  last_touch = np.full((G, N), -1, np.int32)
  scratch = np.zeros((N,), np.int64)
  lrus = [_Lru(G, trace.max_batch, f * k + 1, N) for f in capacities]
  sampled = np.zeros((trace.max_batch,), bool)
  sampled[rows] = True
  kind, ref, row = np.asarray(trace.kind), np.asarray(trace.ref), np.asarray(trace.row)
  gi = np.arange(G)[:, None, None]
  edges = np.asarray(REUSE_EDGES)
  for e in range(kind.shape[0]):
    if kind[e] == PREFILL:
      if row[e] >= 0 and sampled[row[e]]:
        a = trace.event_addrs(e).astype(np.int64)
        for lru in lrus:
          lru.prefill(G, int(row[e]), a)
      continue
    if kind[e] == RELEASE:
      a = trace.event_addrs(e)
      last_sel[:, a] = -1
      last_touch[:, a] = -1
      if row[e] >= 0 and sampled[row[e]]:
        for lru in lrus:
          lru.release(int(row[e]))
      continue
    t = int(ref[e])
    act = np.asarray(trace.active[t]) & sampled
    b = np.flatnonzero(act)
    if b.size == 0:
      continue
    sel = np.asarray(trace.sel_addr[t][:, b], np.int64)  # [G, n, k]
    new = np.asarray(trace.new_addr[t][b], np.int64)
    valid = np.asarray(trace.sel_valid[t][:, b]) & (sel >= 0) & (sel < N)
    first = _first_mask(sel, valid, scratch)
    ctx = np.minimum(np.log2(np.maximum(reqs.step_pos[t, b] + 1, 1)).astype(np.int64),
                     acc.C - 1)  # [n] context bucket of each row
    cell = np.arange(G)[:, None] * acc.C + ctx[None, :]  # [G, n] (group, bucket)
    cells = G * acc.C
    # Overlap with the same request's previous step.
    prev_same = (reqs.step_req[t - 1, b] == reqs.step_req[t, b] if t > 0
                 else np.zeros(b.shape, bool))
    a = np.maximum(sel, 0)
    n_sel = first.sum(axis=2)  # [G, n]
    was = (first & (last_sel[gi, a] == t - 1)).sum(axis=2)
    pair = prev_same[None, :] & (n_sel > 0)
    acc.ov += np.bincount(cell[pair], weights=was[pair] / n_sel[pair],
                          minlength=cells).reshape(G, acc.C)
    acc.ov_n += np.bincount(cell[pair], minlength=cells).reshape(G, acc.C)
    # Reuse distances (the new token's own entry is being written, not reused).
    look = first & ~(sel == new[None, :, None])
    lt = last_touch[gi, a]
    reused = look & (lt >= 0)
    bins = np.searchsorted(edges, t - lt[reused], side="right") - 1
    nb = len(REUSE_LABELS)
    cell3 = np.broadcast_to(cell[..., None], sel.shape)
    acc.reuse += np.bincount(cell3[reused] * nb + bins, minlength=cells * nb).reshape(
        G, acc.C, nb)
    acc.first_use += np.bincount(cell3[look & (lt < 0)], minlength=cells).reshape(G, acc.C)
    # Per-request LRU buffers.
    n_look = look.sum(axis=2)
    for c, lru in enumerate(lrus):
      miss = lru.step(sel, look, new, b)
      acc.miss[c] += np.bincount(cell.reshape(-1), weights=miss.reshape(-1),
                                 minlength=cells).reshape(G, acc.C).astype(np.int64)
      acc.look[c] += np.bincount(cell.reshape(-1), weights=n_look.reshape(-1),
                                 minlength=cells).reshape(G, acc.C).astype(np.int64)
    g3, n3, k3 = np.nonzero(first)
    last_sel[g3, sel[g3, n3, k3]] = t
    last_touch[g3, sel[g3, n3, k3]] = t
    last_touch[:, new] = t


def shared_pool_rates(traces: Sequence[SelectionTrace],
                      capacities: Sequence[int] = CAPACITY_FACTORS) -> dict[str, Any]:
  """Hit rates of one ula device pool of ``max_batch x (c k + 1)`` slots (the rows'
  buffers together) with the host holding the rest, under pb_lru and lru, per layer group
  and in all, summed over the traces (each replayed whole, NumPy engine)."""
  from ula_jax.config.schema import MemoryConfig
  from ula_jax.memory.traces.replay import build_rank_system, replay

  out: dict[str, Any] = {}
  k, G = traces[0].top_k, traces[0].num_groups
  rate = lambda num, den: float(num / den) if den else None
  for f in capacities:
    key = f"{f}k" if f != 1 else "k"
    row: dict[str, Any] = {}
    slots = 0
    for policy in ("pb_lru", "lru"):
      hits, misses, ev = np.zeros(G, np.int64), np.zeros(G, np.int64), np.zeros(G, np.int64)
      for trace in traces:
        B = trace.max_batch
        slots = B * (f * k + 1)
        cfg = MemoryConfig(system="ula", device_pool=slots,
                           host_pool=max(trace.num_logical, 1), policy=policy)
        system = build_rank_system(cfg, trace.geometry(), max_batch=B,
                                   page_size=trace.page_size,
                                   max_context=max(trace.num_logical // B, 1))
        r = replay(trace, system, engine="fast", report_every=1 << 30, validate=False)
        hits += r.per_group("hits")
        misses += r.per_group("misses")
        ev += r.per_group("evictions")
      h, m = int(hits.sum()), int(misses.sum())
      row[policy] = {"hit_rate": rate(h, h + m), "miss_rate": rate(m, h + m), "hits": h,
                     "misses": m, "evictions": int(ev.sum()),
                     "per_group_miss_rate": [rate(misses[g], hits[g] + misses[g])
                                             for g in range(G)]}
    row["device_pool"] = slots
    out[key] = row
  return out
