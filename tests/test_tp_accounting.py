"""TP accounting checked against hand-computed cases: per-rank device use for each
layout, distinct and duplicate entries, the buffers' share, and the rows and bytes that
cross devices per step; resident's replicated baseline holds 12.5% distinct at tp = 8."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ula_jax.engine.types import StepMetrics
from ula_jax.core.types import INVALID, MeshInfo
from ula_jax.memory.resident import Resident
from tests.test_ula_tp import GEO, PAGE, STEP, TPDriver, build, make_cfg, mesh_of

# 4 tp ranks, 8 device-pool tokens each beside a local buffer of 8 (one step's entries):
# 32 logical addresses, 8 pages of 4. Groups: layers (0, 1) and (2,); a row is 4 float32.
TP = 4
ROW_BYTES = 16
TOKEN_BYTES = 48

# Row 0: pages 1, 3, 6, prompt of 6 tokens (addresses 4 5 6 7 12 13); row 1: page 0,
# prompt of 3 tokens (0 1 2). Only row 0 decodes: positions 6, 7, 8 (addresses 14, 15, 24).
PAGES0 = [1, 3, 6]
PROMPT0 = [4, 5, 6, 7, 12, 13]
PROMPT1 = [0, 1, 2]
STEPS = [  # (new address, selected addresses) of row 0
    (14, [4, 5, 13]),  # positions 0 1 5: three misses, the new token enters the buffer
    (15, [4, 14, 15]),  # positions 0 6 7: two hits and the new token itself
    (24, [6, 7, 12]),  # positions 2 3 4: three misses; 5 + 4 > 8 buffer slots: 1 victim
]
# Stats per step, per group (group 0 has 2 layers, group 1 one): every miss is sent by
# its owner to the 3 other ranks, one row per layer.
STATS = [
    {"misses": 3, "hits": 0, "evictions": 0, "xdev_rows": (18, 9)},
    {"misses": 0, "hits": 2, "evictions": 0, "xdev_rows": (0, 0)},
    {"misses": 3, "hits": 0, "evictions": 1, "xdev_rows": (18, 9)},
]
INDEX_BYTES = TP * (TP - 1) * 2 * GEO.top_k * 8  # all-gather of [B, k] scores + positions

# Device entries per rank (both groups), after the prefills and after each step: the
# rank's own pool (the same count in both groups, so x 2) plus 2 x the buffer (0, 4, 5, 8).
USED = {
    # a on rank a % 4. Prefill: 4 12 0 | 5 13 1 | 6 2 | 7 -> 3 3 2 1; then 14 -> rank 2,
    # 15 -> rank 3, 24 -> rank 0.
    "mod": [[6, 6, 4, 2], [14, 14, 14, 10], [16, 16, 16, 14], [24, 22, 22, 20]],
    # a on rank a // 8. Prefill: 0-7 on rank 0 (7 entries), 12 13 on rank 1; 14 15 -> 1,
    # 24 -> 3.
    "block": [[14, 4, 0, 0], [22, 14, 8, 8], [24, 18, 10, 10], [30, 24, 16, 18]],
    # Row 0 first: the roomiest rank is 0 (all equal, lowest), pages 1 and 3 fill its two
    # local pages; row 1 then gets rank 1. Page 6 (address 24) prefers rank 0, which is
    # full, and spills to the lowest rank with room: 1.
    "request": [[12, 6, 0, 0], [22, 14, 8, 8], [26, 16, 10, 10], [32, 24, 16, 16]],
}
DISTINCT = [18, 20, 22, 24]  # 9, 10, 11, 12 entries x 2 groups
BUFFER = [0, 4, 5, 8]  # buffer entries per group after each phase


@functools.lru_cache(maxsize=None)
def driver(layout: str, tp: int = TP) -> TPDriver:
  s = build(make_cfg(layout=layout, device_pool=STEP + 8, policy="pb_lru"), dp=1, tp=tp,
            max_context=12)
  s.validate()
  return TPDriver(s, mesh_of(1, tp))


def _prefill(d: TPDriver, addrs: list[int], row: int, C: int = 8):
  a = np.full((1, C), INVALID, np.int32)
  a[0, :len(addrs)] = addrs
  valid = a >= 0
  entries = tuple(np.ones((1, C, GEO.entry_width), np.float32) for _ in range(3))
  keys = tuple(np.ones((1, C, GEO.index_dim), np.float32) for _ in range(2))
  d.prefill(a, valid, entries, keys, np.asarray([row], np.int32))


def _step(d: TPDriver, new: int, sel: list[int]):
  k = GEO.top_k
  sel_addr = np.full((1, 2, k), INVALID, np.int32)
  sel_addr[0, 0] = sel
  active = np.asarray([[True, False]])
  new_addr = np.asarray([[new, INVALID]], np.int32)
  entries = tuple(np.ones((1, 2, GEO.entry_width), np.float32) for _ in range(3))
  keys = tuple(np.ones((1, 2, GEO.index_dim), np.float32) for _ in range(2))
  _, _, stats = d.step(sel_addr, sel_addr >= 0, new_addr, active, entries, keys)
  return stats


@pytest.mark.parametrize("layout", ["mod", "block", "request"])
def test_hand_computed_accounting(layout):
  d = driver(layout)
  s = d.sys
  d.state = s.init_state(d.mesh)
  assert s.num_logical == 32 and s.capacity_tokens == 32
  _prefill(d, PROMPT0, row=0)
  _prefill(d, PROMPT1, row=1)
  phases = [s.report(d.state)]
  steps = []
  for (new, sel), want in zip(STEPS, STATS):
    stats = _step(d, new, sel)
    for g in range(2):
      for key in ("misses", "hits", "evictions"):
        assert (stats[g][key] == want[key]).all(), (g, key, stats[g][key])
      assert (stats[g]["xdev_rows"] == want["xdev_rows"][g]).all()
      assert (stats[g]["xdev_index_bytes"] == INDEX_BYTES).all()
    phases.append(s.report(d.state))
    steps.append({k: sum(int(stats[g][k][0, 0]) for g in range(2)) for k in stats[0]})

  for i, rep in enumerate(phases):
    used = np.asarray(USED[layout][i])
    np.testing.assert_array_equal(rep.device_used, used[None])
    assert rep.distinct.tolist() == [DISTINCT[i]]
    assert rep.extra["buffer_used"] == [2 * BUFFER[i]]
    # Every entry is stored once; the buffers, one copy per rank, are the duplicates.
    assert rep.physical_used == DISTINCT[i] + TP * 2 * BUFFER[i]
    assert rep.duplicates == TP * 2 * BUFFER[i]
    np.testing.assert_array_equal(rep.device_capacity, [[2 * (8 + 8)] * TP])
    assert rep.host_used.sum() == 0
  assert phases[0].distinct_fraction == 1.0
  assert phases[-1].distinct_fraction == pytest.approx(24 / (24 + 64))
  # Bytes per rank after the last step: group 0 has 2 rows per entry, group 1 one.
  pool = (np.asarray(USED[layout][-1]) - 16) // 2  # the rank's pool, per group
  np.testing.assert_array_equal(phases[-1].extra["device_used_bytes"],
                                [((pool + 8) * 2 + (pool + 8)) * ROW_BYTES])
  assert phases[-1].extra["device_bytes_per_rank"] == (8 + 8) * TOKEN_BYTES
  assert phases[-1].extra["layout"] == layout

  # Bytes crossing devices: 27 rows of 16 bytes per missing step, plus the index gathers.
  metrics = [StepMetrics(step=i, kind="decode", running=1, prefilling=0, waiting=0,
                         finished=0, decode_tokens=1, prefill_tokens=0, step_time_s=0.0,
                         decode_time_s=0.0, tokens_per_s=0.0, device_used=0, host_used=0,
                         distinct=0, extra=e) for i, e in enumerate(steps)]
  summary = s.run_summary(metrics, [])
  assert summary["total_xdev_kv_bytes"] == (27 + 0 + 27) * ROW_BYTES
  assert summary["total_xdev_index_bytes"] == 3 * 2 * INDEX_BYTES
  assert summary["xdev_bytes_per_decode_step"] == pytest.approx(
      ((27 + 27) * ROW_BYTES + 6 * INDEX_BYTES) / 3)

  # Releasing both requests empties every pool and buffer.
  for addrs, row in ((PROMPT0 + [14, 15, 24], 0), (PROMPT1, 1)):
    a = np.asarray([addrs + [INVALID] * (12 - len(addrs))], np.int32)
    d.release(a, a >= 0, np.asarray([row], np.int32))
  rep = s.report(d.state)
  assert rep.physical_used == 0 and rep.distinct_total == 0


def test_buffer_victim_is_the_least_recently_used_entry():
  # After step 2 the buffer holds 4 5 13 14 15; 5 and 13 were last used in step 1, 4 and
  # 14 in step 2. Step 3 needs 4 slots with 3 free: the victim is 5 (the lower slot of
  # the two oldest).
  d = driver("mod")
  d.state = d.sys.init_state(d.mesh)
  _prefill(d, PROMPT0, row=0)
  for new, sel in STEPS:
    _step(d, new, sel)
  owner = np.asarray(d.state.shared.meta.owner)[0]  # [G, L]
  held = [set(owner[g].tolist()) - {INVALID} for g in range(GEO.num_groups)]
  assert held == [{4, 13, 14, 15, 6, 7, 12, 24}] * 2


def test_replicated_baseline_is_one_eighth_distinct_and_mod_is_all_distinct():
  # 10 tokens of one request on 8 tp ranks (1 dp rank).
  addrs = list(range(10))
  res = Resident(make_cfg(system="resident", device_pool=32), GEO, MeshInfo(1, 8),
                 max_batch=2, page_size=PAGE, max_context=16)
  d_res = TPDriver(res, mesh_of(1, 8))
  ula = driver("mod", tp=8)
  ula.state = ula.sys.init_state(ula.mesh)
  for d in (d_res, ula):
    a = np.asarray([addrs + [INVALID] * 2], np.int32)
    entries = tuple(np.ones((1, 12, GEO.entry_width), np.float32) for _ in range(3))
    keys = tuple(np.ones((1, 12, GEO.index_dim), np.float32) for _ in range(2))
    d.prefill(a, a >= 0, entries, keys, np.zeros((1,), np.int32))
  rep = res.report(d_res.state)
  assert rep.extra["layout"] == "replicated"
  np.testing.assert_array_equal(rep.device_used, [[20] * 8])  # 10 entries x 2 groups
  assert rep.distinct_total == 20 and rep.physical_used == 160
  assert rep.distinct_fraction == 0.125
  rep = ula.sys.report(ula.state)
  assert rep.extra["layout"] == "mod"
  np.testing.assert_array_equal(rep.device_used, [[4, 4, 2, 2, 2, 2, 2, 2]])
  assert rep.distinct_total == rep.physical_used == 20
  assert rep.distinct_fraction == 1.0
  # One decode step puts 3 selected entries and the new token in every rank's buffer.
  stats = _step(ula, 10, [0, 1, 9])
  rep = ula.sys.report(ula.state)
  assert rep.distinct_total == 22
  assert rep.physical_used == 22 + 8 * 2 * 4
  assert (stats[0]["xdev_rows"] == 3 * 7 * 2).all()
