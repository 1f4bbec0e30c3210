"""Selection traces: recording, the .npz format, replay against the reference, and the
side-by-side policy comparison."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from ula_jax.config.schema import MemoryConfig
from ula_jax.core.addressing import PageAllocator
from ula_jax.core.types import INVALID, KVGeometry
from ula_jax.memory.ula.oracle import RefGroup, make_ref_policy
from ula_jax.memory.ula.trace import (DECODE, PREFILL, RELEASE, SelectionTrace, TraceRecorder,
                                  compare_policies, replay, system_for_trace)

GEO = KVGeometry(num_layers=2, group_size=1, entry_width=4, index_dim=2, top_k=4,
                 kv_dtype="float32")
B, PAGE, N = 2, 4, 48


def mem_cfg(**kw) -> MemoryConfig:
  """The ``memory`` section the replays are sized by: a tight device pool."""
  base = dict(system="ula", device_pool=12, host_pool=36, policy="pb_lru", pb_lru_buckets=2)
  return MemoryConfig(**{**base, **kw})


def make_trace(seed: int, steps: int = 30) -> SelectionTrace:
  """Requests that come and go on one rank; each step selects the new token, the one
  before it and a slowly drifting set of older positions (sparse attention's locality)."""
  rng = np.random.default_rng(seed)
  rec = TraceRecorder(GEO, max_batch=B, num_logical=N, page_size=PAGE)
  alloc = PageAllocator(N // PAGE)
  rows: list[dict | None] = [None] * B
  done = 0
  while done < steps:
    for b in range(B):
      total = int(rng.integers(8, 20))
      if rows[b] is None and -(-total // PAGE) <= alloc.free_pages:
        pages = alloc.allocate(-(-total // PAGE))
        addr = (pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
        prompt = total - int(rng.integers(2, 6))
        for c in range(0, prompt, 5):
          rec.prefill(addr[c:min(c + 5, prompt)])
        rows[b] = dict(pages=pages, addr=addr, written=prompt, total=total,
                       hot=list(rng.choice(prompt, size=2, replace=False)))
    sel = np.full((GEO.num_groups, B, GEO.top_k), INVALID, np.int32)
    valid = np.zeros(sel.shape, bool)
    new = np.full((B,), INVALID, np.int32)
    active = np.zeros((B,), bool)
    for b, r in enumerate(rows):
      if r is None:
        continue
      pos = r["written"]
      if rng.random() < 0.3:
        r["hot"][int(rng.integers(2))] = int(rng.integers(pos))
      picks = [pos, pos - 1] + r["hot"]
      new[b], active[b] = r["addr"][pos], True
      for g in range(GEO.num_groups):
        sel[g, b] = r["addr"][np.asarray(picks)]
        valid[g, b] = [True, True, True, g == 0 or rng.random() < 0.5]
    rec.decode(sel, valid, new, active)
    done += 1
    for b, r in enumerate(rows):
      if r is None:
        continue
      r["written"] += 1
      if r["written"] == r["total"]:
        rec.release(r["addr"], np.arange(r["addr"].shape[0]) < r["written"])
        alloc.free(r["pages"])
        rows[b] = None
  return rec.build()


@functools.lru_cache(maxsize=None)
def trace_and_systems():
  trace = make_trace(7)
  systems = {p: system_for_trace(trace, mem_cfg(), policy=p) for p in ("pb_lru", "lru")}
  return trace, systems


def ref_replay(trace: SelectionTrace, system) -> np.ndarray:
  """[T, G, 3] hits, misses, evictions from the NumPy reference."""
  groups = [RefGroup(system.device_slots, system.host_slots, system.num_logical,
                     make_ref_policy(system.policy_name, system.device_slots, system.buckets))
            for _ in range(trace.num_groups)]
  out = np.zeros((trace.num_steps, trace.num_groups, 3), np.int64)
  for kind, ref, count in zip(trace.kind, trace.ref, trace.count):
    if kind == DECODE:
      for g, grp in enumerate(groups):
        st = grp.resolve(trace.sel_addr[ref, g], trace.sel_valid[ref, g],
                         trace.new_addr[ref], trace.active[ref])
        out[ref, g] = [st.stats["hits"], st.stats["misses"], st.stats["evictions"]]
      continue
    a = trace.addrs[ref:ref + count]
    for grp in groups:
      if kind == PREFILL:
        grp.prefill(a, np.ones(a.shape, bool))
      else:
        grp.release(a, np.ones(a.shape, bool))
  return out


# ----------------------------------------------------------------------------------
# format
# ----------------------------------------------------------------------------------


def test_recorder_layout():
  trace = make_trace(1, steps=12)
  assert trace.sel_addr.shape == (12, 2, B, 4) and trace.new_addr.shape == (12, B)
  assert (trace.num_steps, trace.num_groups, trace.max_batch, trace.top_k) == (12, 2, B, 4)
  assert set(np.unique(trace.kind)) <= {PREFILL, DECODE, RELEASE}
  np.testing.assert_array_equal(trace.ref[trace.kind == DECODE], np.arange(12))
  assert (trace.sel_addr[~trace.sel_valid] == INVALID).all()
  # Every address a decode step uses was placed by an earlier prefill or decode.
  stored: set[int] = set()
  for kind, ref, count in zip(trace.kind, trace.ref, trace.count):
    if kind == PREFILL:
      stored |= set(trace.addrs[ref:ref + count].tolist())
    elif kind == RELEASE:
      stored -= set(trace.addrs[ref:ref + count].tolist())
    else:
      new = set(trace.new_addr[ref][trace.active[ref]].tolist())
      assert set(trace.sel_addr[ref][trace.sel_valid[ref]].tolist()) <= stored | new
      stored |= new
  assert trace.geometry() == GEO


def test_save_load_roundtrip(tmp_path):
  trace = make_trace(2, steps=5)
  trace.save(tmp_path / "t.npz")
  back = SelectionTrace.load(tmp_path / "t.npz")
  for f in dataclasses.fields(SelectionTrace):
    a, b = getattr(trace, f.name), getattr(back, f.name)
    if isinstance(a, np.ndarray):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(a, b)
    else:
      assert a == b and type(a) is type(b), f.name


def _broken(trace, **kw):
  return dataclasses.replace(trace, **kw)


def test_trace_validation_errors():
  t = make_trace(3, steps=4)
  with pytest.raises(ValueError, match=r"trace\.sel_valid has shape \(4, 2, 2, 3\): "
                     r"expected \(4, 2, 2, 4\)"):
    _broken(t, sel_valid=t.sel_valid[..., :3]).validate()
  with pytest.raises(ValueError, match=r"trace\.sel_addr has shape \(4, 2, 2\): expected"):
    _broken(t, sel_addr=t.sel_addr[..., 0]).validate()
  with pytest.raises(ValueError, match=r"trace\.sel_addr has 2 layer groups; num_layers=4"):
    _broken(t, num_layers=4).validate()
  kind = t.kind.copy()
  kind[0] = 7
  with pytest.raises(ValueError, match=r"trace\.kind=7: expected one of \[0, 1, 2\]"):
    _broken(t, kind=kind).validate()
  ref = t.ref.copy()
  ref[np.flatnonzero(t.kind == DECODE)[0]] = 3
  with pytest.raises(ValueError, match=r"trace\.ref: the decode events name steps"):
    _broken(t, ref=ref).validate()
  count = t.count.copy()
  count[np.flatnonzero(t.kind == PREFILL)[0]] = 10**6
  with pytest.raises(ValueError, match=r"trace\.ref/count: a prefill or release range"):
    _broken(t, count=count).validate()
  with pytest.raises(ValueError, match=r"trace\.num_logical=8: the trace uses address"):
    _broken(t, num_logical=8).validate()


def test_trace_must_fit_the_system():
  trace, systems = trace_and_systems()
  with pytest.raises(ValueError, match=r"hold 12 logical addresses; the trace needs "
                     r"trace\.num_logical=48"):
    system_for_trace(trace, mem_cfg(device_pool=12, host_pool=0))
  other = KVGeometry(num_layers=3, group_size=1, entry_width=4, index_dim=2, top_k=4)
  rec = TraceRecorder(other, max_batch=B, num_logical=N, page_size=PAGE)
  with pytest.raises(ValueError, match=r"trace has 3 layer groups; the system has 2"):
    replay(rec.build(), systems["lru"])
  rec = TraceRecorder(dataclasses.replace(GEO, top_k=2), max_batch=B, num_logical=N,
                      page_size=PAGE)
  with pytest.raises(ValueError, match=r"trace selections are \[batch=2, k=2\]; the system "
                     r"resolves \[engine\.max_batch=2, top_k=4\]"):
    replay(rec.build(), systems["lru"])


# ----------------------------------------------------------------------------------
# replay
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["pb_lru", "lru"])
def test_replay_matches_reference(policy):
  trace, systems = trace_and_systems()
  system = systems[policy]
  got = replay(trace, system, chunk=3)  # chunks smaller than the prefill events
  want = ref_replay(trace, system)
  np.testing.assert_array_equal(got.hits, want[..., 0])
  np.testing.assert_array_equal(got.misses, want[..., 1])
  np.testing.assert_array_equal(got.evictions, want[..., 2])
  assert got.misses.sum() > 0 and got.evictions.sum() > 0  # the device pool is tight
  lookups = int(got.hits.sum() + got.misses.sum())
  assert got.hit_rate == pytest.approx(int(got.hits.sum()) / lookups)
  assert got.resolve_seconds > 0


def test_compare_policies_side_by_side():
  trace, systems = trace_and_systems()
  out = compare_policies(trace, mem_cfg())
  for p in ("pb_lru", "lru"):
    want = ref_replay(trace, systems[p]).sum(axis=(0, 1))
    assert [out[p]["hits"], out[p]["misses"], out[p]["evictions"]] == want.tolist()
    assert out[p]["policy"] == p and out[p]["steps"] == trace.num_steps
  assert out["hit_rate_gap_pp"] == pytest.approx(
      100 * (out["pb_lru"]["hit_rate"] - out["lru"]["hit_rate"]))


def test_device_pool_holding_everything_never_misses():
  trace, _ = trace_and_systems()
  cfg = MemoryConfig(system="ula", device_pool=N, host_pool=0, policy="lru", pb_lru_buckets=1)
  out = compare_policies(trace, cfg, policies=("lru",))
  assert out["lru"]["misses"] == 0 and out["lru"]["evictions"] == 0
  assert out["lru"]["hit_rate"] == 1.0 and "hit_rate_gap_pp" not in out
