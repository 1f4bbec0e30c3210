"""The sharded indexer: each tp rank stores and scores the keys it owns, an all-gather
and a merge give the global top-k, identical to the unsharded ``select_topk`` on every
rank (same positions, same order, ties to the lower position). With
``index_scoring='local'`` a rank scores only its own positions: the scores are equal up
to their last bit, so the picks' scores are the top-k scores, equal ones possibly in
another order."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.kernels.indexer import index_scores, select_topk
from ula_jax.kernels.indexer.prefill import ascending
from ula_jax.core.addressing import all_addrs
from ula_jax.core.types import KVGeometry
from tests.test_ula_tp import TPDriver, build, make_cfg, mesh_of

GEO = KVGeometry(num_layers=2, group_size=1, entry_width=2, index_dim=8, top_k=5,
                 kv_dtype="float32", index_dtype="float32")
B, PAGE, PAGES = 3, 4, 4  # rows, page size, pages per row
T = PAGE * PAGES  # positions per row
HI = 4  # index heads
STEP = B * (GEO.top_k + 1)


@functools.lru_cache(maxsize=None)
def driver(layout: str, dp: int, tp: int, scoring: str = "aligned",
           decode_scores: str = "auto", decode_topk: str = "sort") -> TPDriver:
  # 64 logical addresses per dp rank: room for every row's pages in every layout.
  cfg = make_cfg(layout=layout, device_pool=STEP + 64 // tp, policy="lru",
                 index_scoring=scoring)
  s = build(cfg, dp=dp, tp=tp, geo=GEO, max_batch=B, page_size=PAGE, max_context=T)
  s.decode_scores, s.decode_topk = decode_scores, decode_topk
  s.validate()
  assert s.num_logical == 64
  d = TPDriver(s, mesh_of(dp, tp))
  group = 1  # the second group: keys of the two groups differ

  def select(st, q, w, page_table, positions, active):
    return st, s.select(st, group, q, w, page_table, positions, active)

  d.select = lambda *args: d.call("select", select, *args)
  d.group = group
  return d


def _inputs(rng, dp, ties: bool):
  """Random page tables, positions, activity, queries and keys (per dp rank)."""
  if ties:  # small integers: many equal scores, and many exact zeros after the ReLU
    draw = lambda shape: rng.integers(-1, 2, shape).astype(np.float32)
    weights = rng.integers(1, 3, (dp, B, HI)).astype(np.float32)
  else:
    draw = lambda shape: rng.standard_normal(shape).astype(np.float32)
    weights = draw((dp, B, HI))
  page_table = np.stack([rng.permutation(64 // PAGE)[:B * PAGES].reshape(B, PAGES)
                         for _ in range(dp)]).astype(np.int32)
  positions = rng.integers(0, T, (dp, B)).astype(np.int32)
  positions[:, 0] = rng.integers(0, GEO.top_k - 1, dp)  # fewer candidates than k
  active = rng.random((dp, B)) < 0.85
  active[np.arange(dp), rng.integers(0, B, dp)] = True  # a row to select for, per rank
  keys = draw((dp, B, T, GEO.index_dim))  # by (row, position)
  q = draw((dp, B, HI, GEO.index_dim))
  return page_table, positions, active, keys, q, weights


def _store_keys(d: TPDriver, page_table, keys):
  """Writes every row's keys (one prefill per row: the request layout owns by row)."""
  dp = page_table.shape[0]
  addrs = np.asarray(all_addrs(jnp.asarray(page_table), PAGE))  # [dp, B, T]
  for b in range(B):
    entries = tuple(np.zeros((dp, T, GEO.entry_width), np.float32)
                    for _ in range(GEO.num_layers))
    per_group = tuple(keys[:, b] * (g + 1) for g in range(GEO.num_groups))
    d.prefill(addrs[:, b], np.ones((dp, T), bool), entries, per_group,
              np.full((dp,), b, np.int32))


def _unsharded(page_table, positions, active, keys, q, w, group):
  cand_addr = all_addrs(jnp.asarray(page_table), PAGE)
  cand = ((cand_addr >= 0) & (jnp.arange(T)[None, :] <= positions[:, None])
          & active[:, None])
  # A decode step's picks: select_topk's, in ascending positions (decode.decode_topk).
  return ascending(*select_topk(index_scores(jnp.asarray(q), jnp.asarray(w),
                                             jnp.asarray(keys * (group + 1))), cand, GEO.top_k))


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("dp, tp", [(1, 8), (2, 4)])
@pytest.mark.parametrize("layout", ["mod", "block", "request"])
def test_selection_equals_the_unsharded_one(rng, layout, dp, tp, ties):
  d = driver(layout, dp, tp)
  for _ in range(2):
    d.state = d.sys.init_state(d.mesh)
    page_table, positions, active, keys, q, w = _inputs(rng, dp, ties)
    _store_keys(d, page_table, keys)
    pos, valid = d.select(q, w, page_table, positions, active)  # [dp, tp, B, k]
    for r in range(dp):
      want_pos, want_valid = _unsharded(page_table[r], positions[r], active[r], keys[r],
                                        q[r], w[r], d.group)
      for t in range(tp):  # every rank holds the same selection
        np.testing.assert_array_equal(pos[r, t], np.asarray(want_pos))
        np.testing.assert_array_equal(valid[r, t], np.asarray(want_valid))
      # Full rows, rows with fewer candidates than k, idle rows.
      n_valid = np.asarray(want_valid).sum(axis=1)
      np.testing.assert_array_equal(n_valid, np.minimum(positions[r] + 1, GEO.top_k) * active[r])
    if ties:  # the tie-breaking rule is exercised: candidates share scores
      s = np.asarray(index_scores(jnp.asarray(q[0]), jnp.asarray(w[0]), jnp.asarray(keys[0])))
      assert max(len(row) - len(np.unique(row)) for row in s) > 0


@pytest.mark.parametrize("topk", ["sort", "radix"])
@pytest.mark.parametrize("layout", ["mod", "request"])
def test_scoring_by_length_equals_the_unsharded_systems(rng, layout, topk, monkeypatch):
  """kernels.decode_scores=lengths with blocks smaller than the window (2 rows x 4
  positions here): ula TP's aligned scoring uses the unsharded system's blocks, so the
  same bits and the same selection as ``MemorySystem.select`` scoring by length, in
  ascending positions under either kernels.decode_topk."""
  from ula_jax.kernels.indexer import decode
  from ula_jax.memory.resident import Resident
  monkeypatch.setattr(decode, "BLOCK_ROWS", 2)
  monkeypatch.setattr(decode, "BLOCK_T", 4)
  d = driver(layout, 1, 4, decode_scores="lengths", decode_topk=topk)
  d.state = d.sys.init_state(d.mesh)
  page_table, positions, active, keys, q, w = _inputs(rng, 1, ties=False)
  _store_keys(d, page_table, keys)
  pos, valid = d.select(q, w, page_table, positions, active)  # [1, tp, B, k]
  # The unsharded system's select over a key table by address.
  addrs = np.asarray(all_addrs(jnp.asarray(page_table[0]), PAGE))
  table = np.zeros((64, GEO.index_dim), np.float32)
  table[addrs] = keys[0] * (d.group + 1)
  ref = object.__new__(Resident)
  ref.geo, ref.page_size, ref.decode_scores, ref.decode_topk = GEO, PAGE, "lengths", topk
  ref.gather_index_keys = lambda state, g, a: jnp.asarray(table)[jnp.clip(a, 0, 63)]
  want_pos, want_valid = ref.select(None, d.group, jnp.asarray(q[0]), jnp.asarray(w[0]),
                                    jnp.asarray(page_table[0]), jnp.asarray(positions[0]),
                                    jnp.asarray(active[0]))
  assert np.asarray(want_valid).any()
  p = np.asarray(want_pos)  # ascending positions, valid ones first
  for row, ok in zip(p, np.asarray(want_valid)):
    n = int(ok.sum())
    assert ok[:n].all() and not ok[n:].any() and np.all(np.diff(row[:n]) > 0)
  for t in range(4):
    np.testing.assert_array_equal(pos[0, t], np.asarray(want_pos))
    np.testing.assert_array_equal(valid[0, t], np.asarray(want_valid))


def test_each_rank_holds_only_its_keys(rng):
  # mod over 8 ranks: rank t stores the key of address a at local a // 8 when a % 8 == t.
  d = driver("mod", 1, 8)
  d.state = d.sys.init_state(d.mesh)
  page_table, _, _, keys, _, _ = _inputs(rng, 1, ties=False)
  _store_keys(d, page_table, keys)
  local = np.asarray(d.state.ranked.index_keys)[0, :, d.group]  # [tp, C, DI]
  addrs = np.asarray(all_addrs(jnp.asarray(page_table[0]), PAGE))  # [B, T]
  for b in range(B):
    for t in range(T):
      a = addrs[b, t]
      np.testing.assert_array_equal(local[a % 8, a // 8], keys[0, b, t] * (d.group + 1))
  stored = (np.abs(local).sum(axis=-1) > 0).sum(axis=1)
  assert stored.sum() == B * T and stored.max() < B * T  # spread, not copied
  # read_index_keys gathers them back by logical address.
  by_addr = d.read_index_keys(d.group)[0, 0]
  np.testing.assert_array_equal(by_addr[addrs.reshape(-1)],
                                keys[0].reshape(B * T, -1) * (d.group + 1))


@pytest.mark.parametrize("dp, tp", [(1, 8), (2, 4)])
@pytest.mark.parametrize("layout", ["mod", "request"])
def test_local_scoring_matches_up_to_the_last_bit(rng, layout, dp, tp):
  d = driver(layout, dp, tp, "local")
  for ties in (True, False):
    d.state = d.sys.init_state(d.mesh)
    page_table, positions, active, keys, q, w = _inputs(rng, dp, ties)
    _store_keys(d, page_table, keys)
    pos, valid = d.select(q, w, page_table, positions, active)
    for r in range(dp):
      want_pos, want_valid = map(np.asarray, _unsharded(
          page_table[r], positions[r], active[r], keys[r], q[r], w[r], d.group))
      for t in range(tp):
        np.testing.assert_array_equal(pos[r, t], pos[r, 0])
      np.testing.assert_array_equal(valid[r, 0], want_valid)
      # The queries are scaled by 1/sqrt(index_dim) before the dot, so even small integer
      # inputs give scores whose last bit depends on the shapes scored: equal or nearly
      # equal scores can come out in another order. The picks' scores (by the unsharded
      # indexer) are the top-k scores.
      full = np.asarray(index_scores(jnp.asarray(q[r]), jnp.asarray(w[r]),
                                     jnp.asarray(keys[r] * (d.group + 1))))
      for b in range(B):
        got = np.sort(full[b, pos[r, 0, b][valid[r, 0, b]]])
        want = np.sort(full[b, want_pos[b][want_valid[b]]])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_local_scoring_width():
  # mod: a page's 4 consecutive addresses sit on 4 different ranks of 4 (one each) or
  # 8 (at most one each); block and request may put a whole row on one rank.
  assert driver("mod", 2, 4, "local").sys.layout.owned_per_row(PAGES) == T // 4
  assert driver("mod", 1, 8, "local").sys.layout.owned_per_row(PAGES) == PAGES
  assert driver("request", 2, 4, "local").sys.layout.owned_per_row(PAGES) == T
