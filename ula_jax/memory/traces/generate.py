"""Synthetic selection traces with stated locality (``ula-jax trace generate``).

Each request gets a prompt of ``context`` tokens (uniform over the range) and
``steps`` decode steps; at every step each layer group selects ``top_k`` positions of
the request's history plus its new token:

* the new token's own position (attention always sees itself);
* each entry of the group's previous selection stays with probability ``overlap``
  (so ``|S_t & S_{t-1}| / k`` is ``overlap`` on average; 1.0 keeps all but one, which
  makes room for the new token);
* each entry of the group below's selection at this step that the group did not select
  last step joins with probability ``group_share`` (groups ``1..G-1``);
* the rest are fresh positions, none from the previous selection, drawn by distance
  ``d`` back from the new token with probability proportional to ``d ** -recency``
  (``recency`` 1: log-uniform distances, most picks recent; 0: uniform over the history).

While the history is at most ``top_k`` positions, every position is selected. The trace
is written by ``build.write_trace`` (a directory of memory-mapped files for large ones);
its metadata records these parameters (``source``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np

from ula_jax.core.types import KVGeometry
from ula_jax.memory.traces.build import plan_schedule, write_trace


@dataclasses.dataclass(frozen=True)
class Locality:
  """What the generator's selections keep from step to step and group to group."""

  overlap: float = 0.7
  group_share: float = 0.3
  recency: float = 1.0

  def __post_init__(self):
    for name in ("overlap", "group_share"):
      v = getattr(self, name)
      if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name}={v}: must be in [0, 1]")
    if self.recency < 0:
      raise ValueError(f"recency={self.recency}: must be >= 0")


def _distances(rng: np.random.Generator, n: np.ndarray, m: int, alpha: float) -> np.ndarray:
  """[B, m] int64 distances in [1, n_b] with P(d) ~ d^-alpha (continuous, floored)."""
  u = rng.random((n.shape[0], m))
  top = (n + 1).astype(np.float64)[:, None]
  if alpha == 0.0:
    d = 1.0 + u * (top - 1.0)
  elif abs(alpha - 1.0) < 1e-9:
    d = np.exp(u * np.log(top))
  else:
    e = 1.0 - alpha
    d = (1.0 + u * (top ** e - 1.0)) ** (1.0 / e)
  return np.clip(np.floor(d).astype(np.int64), 1, np.maximum(n, 1)[:, None])


class _Selector:
  """The selections of one trace, step by step (state: each row's previous selection)."""

  def __init__(self, G: int, B: int, k: int, stride: int, loc: Locality, seed: int):
    self.G, self.B, self.k, self.loc = G, B, k, loc
    self.rng = np.random.default_rng(seed)
    self.stride = stride  # positions per row in the marker (the longest request)
    self.mark = np.zeros((B * stride,), np.int64)  # tag of the last set a position joined
    self.tag = 0
    self.prev = np.full((G, B, k), -1, np.int64)  # last step's selection per group and row
    self.prev_req = np.full((B,), -1, np.int64)

  def _tags(self, n: int) -> np.ndarray:
    out = np.arange(self.tag + 1, self.tag + 1 + n, dtype=np.int64)
    self.tag += n
    return out

  def __call__(self, t: int, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
    G, B, k, loc = self.G, self.B, self.k, self.loc
    out = np.full((G, B, k), -1, np.int64)
    act = req >= 0
    fresh_req = act & (req != self.prev_req)
    self.prev[:, fresh_req] = -1
    n = np.where(act, pos, 0).astype(np.int64)
    base = (np.arange(B, dtype=np.int64) * self.stride)[:, None]
    short = act & (n + 1 <= k)  # the whole history fits: select all of it
    long_ = act & ~short
    if short.any():
      j = np.arange(k)[None, :]
      allpos = np.where(j <= n[:, None], j, -1)
      out[:, short] = allpos[short][None]
    rows = np.flatnonzero(long_)
    below = None
    for g in range(G):
      if rows.size == 0:
        break
      nb = n[rows]
      prev = self.prev[g, rows]  # [b, k]
      pv = prev >= 0
      flat = lambda p: base[rows] + p
      id_prev = self._tags(1)[0]
      self.mark[flat(prev)[pv]] = id_prev
      keep = pv & (self.rng.random(prev.shape) < loc.overlap)
      id_cur = self._tags(1)[0]
      chosen = [np.where(keep, prev, -1)]
      if below is not None and loc.group_share > 0:
        x = below
        xv = (x >= 0) & (x != nb[:, None])
        xv &= self.mark[flat(np.maximum(x, 0))] != id_prev
        xv &= self.rng.random(x.shape) < loc.group_share
        chosen.append(np.where(xv, x, -1))
      sel = np.concatenate([nb[:, None]] + chosen, axis=1)  # the new token first
      ok = sel >= 0
      # At most k: the new token, then the kept entries, then the shared ones, in order.
      ok &= np.cumsum(ok, axis=1) <= k
      self.mark[flat(np.maximum(sel, 0))[ok]] = id_cur
      have = ok.sum(axis=1)
      sel = _compact(sel, ok, k)
      need = k - have
      self._fill(sel, have, need, nb, rows, base, id_prev, id_cur)
      out[g, rows] = sel
      below = sel
    self.prev = np.where(act[None, :, None], out, -1)
    self.prev_req = np.where(act, req, -1)
    return out

  def _fill(self, sel, have, need, nb, rows, base, id_prev, id_cur) -> None:
    """Fresh positions into ``sel`` [b, k] after ``have`` [b] entries: recency-biased
    draws outside the previous and the current selection, then (rows still short) the
    most recent positions left."""
    k = self.k
    for _ in range(8):
      if not (need > 0).any():
        return
      m = int(need.max() * 1.5) + 32
      cand = nb[:, None] - _distances(self.rng, nb, m, self.loc.recency)  # [b, m]
      f = base[rows] + cand
      ok = (self.mark[f] != id_prev) & (self.mark[f] != id_cur)
      tag = self._tags(cand.size).reshape(cand.shape)
      self.mark[f[ok]] = tag[ok]
      ok &= self.mark[f] == tag  # one of each repeated draw
      ok &= np.cumsum(ok, axis=1) <= need[:, None]
      self._place(sel, have, cand, ok)
      self.mark[f[ok]] = id_cur
      got = ok.sum(axis=1)
      have += got
      need -= got
    for i in np.flatnonzero(need > 0):  # the most recent positions not yet taken
      p = np.arange(nb[i] - 1, -1, -1)
      free = p[(self.mark[base[rows[i], 0] + p] != id_prev)
               & (self.mark[base[rows[i], 0] + p] != id_cur)][:need[i]]
      sel[i, have[i]:have[i] + free.shape[0]] = free
      self.mark[base[rows[i], 0] + free] = id_cur
      have[i] += free.shape[0]
      need[i] -= free.shape[0]

  @staticmethod
  def _place(sel, have, cand, ok) -> None:
    b, j = np.nonzero(ok)
    slot = have[b] + (np.cumsum(ok, axis=1) - 1)[b, j]
    sel[b, slot] = cand[b, j]


def _compact(x: np.ndarray, ok: np.ndarray, k: int) -> np.ndarray:
  """[b, n] -> [b, k]: the ``ok`` entries of each row moved to the front, -1 after."""
  out = np.full((x.shape[0], k), -1, x.dtype)
  b, j = np.nonzero(ok)
  out[b, (np.cumsum(ok, axis=1) - 1)[b, j]] = x[b, j]
  return out


def generate(out, geometry: KVGeometry, *, requests: int, steps: tuple[int, int],
             context: tuple[int, int], locality: Locality, max_batch: int,
             page_size: int = 64, prefill_chunk: int = 8192, seed: int = 0,
             on_step: Callable[[int], None] | None = None) -> Path:
  """Writes a synthetic trace to ``out`` (``.npz`` or a directory).

  geometry: the KV geometry (layer groups, top-k, entry size) of the model it stands for
  requests: how many; context: [min, max] prompt tokens; steps: [min, max] decode steps
    (uniform, ends included); max_batch: rows of the rank (requests beyond wait for a
    free row)
  """
  for name, (lo, hi), least in (("context", context, 1), ("steps", steps, 1)):
    if not least <= lo <= hi:
      raise ValueError(f"{name}={lo}-{hi}: expected {least} <= min <= max")
  if requests < 1 or max_batch < 1:
    raise ValueError(f"requests={requests}, max_batch={max_batch}: must be >= 1")
  rng = np.random.default_rng(seed)
  prompt = rng.integers(context[0], context[1], endpoint=True, size=requests)
  n_steps = rng.integers(steps[0], steps[1], endpoint=True, size=requests)
  schedule = plan_schedule(prompt, n_steps, max_batch=max_batch, page_size=page_size,
                           prefill_chunk=prefill_chunk)
  stride = int((prompt + n_steps).max())
  select = _Selector(geometry.num_groups, max_batch, geometry.top_k, stride, locality,
                     seed + 1)
  source = {"generator": "ula-jax trace generate", "num_requests": requests,
            "steps": list(steps), "context": list(context), "max_batch": max_batch,
            "page_size": page_size, "prefill_chunk": prefill_chunk, "seed": seed,
            **dataclasses.asdict(locality)}
  return write_trace(schedule, select, geometry, out, source=source, on_step=on_step)
