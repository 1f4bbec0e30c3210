"""Trace replay without the model (``workload.kind: trace``), the NumPy models against the
memory systems' jax transitions, locality statistics, the synthetic generator and the
SGLang importer (format and errors)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ula_jax.config import load_config
from ula_jax.config.schema import MemoryConfig
from ula_jax.core.types import KVGeometry
from ula_jax.memory.traces.format import (DECODE, PREFILL, RELEASE, SelectionTrace,
                                          load_traces, trace_requests)
from ula_jax.memory.traces.generate import Locality, generate
from ula_jax.memory.traces.replay import build_rank_system, replay
from ula_jax.memory.traces.sglang import SglangImportError, import_sglang
from ula_jax.memory.traces.stats import locality_stats
from ula_jax.workloads.trace import TraceWorkloadError, replay_workload
from tests.engine_util import DENSE, make_requests, run_engine

GEO = KVGeometry(num_layers=6, group_size=2, entry_width=8, index_dim=4, top_k=16)
TINY = KVGeometry(num_layers=4, group_size=2, entry_width=48, index_dim=16, top_k=8,
                  kv_dtype="float32")  # the tiny preset's, as the quickstart config has it


def small_trace(tmp_path, name="t.npz", *, overlap=0.7, requests=7, batch=3, seed=1,
                geo=GEO, steps=(5, 30), context=(8, 60)) -> SelectionTrace:
  """Requests that come and go on 3 rows (continuous batching), chunked prefill."""
  out = generate(tmp_path / name, geo, requests=requests, steps=steps, context=context,
                 locality=Locality(overlap, 0.3, 1.0), max_batch=batch, page_size=8,
                 prefill_chunk=16, seed=seed)
  return SelectionTrace.load(out)


# ----------------------------------------------------------------------------------
# The NumPy models make the memory systems' own choices
# ----------------------------------------------------------------------------------

SYSTEMS = {
    "ula_pb_lru": MemoryConfig(system="ula", device_pool=3 * 17 + 5, host_pool=400,
                               policy="pb_lru", pb_lru_buckets=2),
    "ula_lru": MemoryConfig(system="ula", device_pool=3 * 17 + 5, host_pool=400, policy="lru"),
    "hisparse": MemoryConfig(system="hisparse", host_pool=400,
                             hisparse=dict(device_buffer_size=20)),
    "resident": MemoryConfig(system="resident", device_pool=400),
}


def with_repeats(trace: SelectionTrace, seed: int) -> SelectionTrace:
  """The trace with some selections repeated within their row (systems count each
  address of a step once)."""
  rng = np.random.default_rng(seed)
  sel = np.array(trace.sel_addr)
  T, G, B, k = sel.shape
  for _ in range(T):
    t, g, b = rng.integers(T), rng.integers(G), rng.integers(B)
    valid = np.flatnonzero(sel[t, g, b] >= 0)
    if valid.size >= 2:
      i, j = rng.choice(valid, 2, replace=False)
      sel[t, g, b, j] = sel[t, g, b, i]
  return dataclasses.replace(trace, sel_addr=sel)


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_fast_models_make_the_systems_choices(tmp_path, name, seed):
  trace = small_trace(tmp_path, seed=seed % 1000)
  if name == "hisparse":
    trace = with_repeats(trace, seed)
  system = build_rank_system(SYSTEMS[name], trace.geometry(), max_batch=3, page_size=8,
                             max_context=100)
  fast = replay(trace, system, engine="fast", report_every=4)
  ref = replay(trace, system, engine="system", report_every=4)
  assert fast.engine == "fast" and ref.engine == "system"
  assert fast.stat_keys == ref.stat_keys
  np.testing.assert_array_equal(fast.counts, ref.counts)
  a, b = fast.reports[-1][1], ref.reports[-1][1]
  for f in ("device_used", "host_used", "distinct"):
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
  if name != "resident":  # a tight pool: the comparison covers evictions
    assert fast.totals()["evictions"] > 0 and fast.totals()["misses"] > 0


# ----------------------------------------------------------------------------------
# A live run's own trace reproduces its counts
# ----------------------------------------------------------------------------------

LIVE = {
    "ula_lru": ["memory.system=ula", "memory.policy=lru", "memory.device_pool=24",
                "memory.host_pool=2048"],
    "hisparse": ["memory.system=hisparse", "memory.hisparse.device_buffer_size=8",
                 "memory.host_pool=4096"],
}
BASE = ["model.preset=tiny", "mesh.dp=1", "engine.max_batch=2", "engine.prefill_chunk=32",
        "engine.progress=false", "experiment.plots=false"]


@pytest.mark.parametrize("name", list(LIVE))
def test_replaying_a_live_run_reproduces_its_counts(tmp_path, name):
  # (ula pb_lru on two ranks: tests/test_trace_run.py). The live run's layers are dense:
  # the replay needs its selections, whatever model made them.
  reqs = make_requests(3, 0, (40, 70), (6, 12))
  live = run_engine(BASE[1:] + DENSE + ["engine.record_trace=true"] + LIVE[name], reqs)
  for d, trace in enumerate(live.traces):
    trace.save(tmp_path / f"trace_rank{d}.npz")
  want = {k: live.summary[f"total_{k}"] for k in ("hits", "misses", "evictions")}
  assert want["misses"] > 0 and want["evictions"] > 0
  for engine in ("fast", "system"):
    cfg = load_config("experiments/quickstart/config.yaml", BASE + LIVE[name] + [
        "workload.kind=trace", f"workload.trace={tmp_path}",
        f"workload.trace_replay={engine}"])
    got = replay_workload(cfg)
    assert {k: got.summary[f"total_{k}"] for k in want} == want, engine
    assert got.summary["hit_rate"] == pytest.approx(live.summary["hit_rate"])
    assert got.summary["trace"]["replay"] == engine
    assert [r.status for r in got.requests] == ["finished"] * 3
    assert sorted(r.prompt_len + r.max_new_tokens for r in got.requests) == sorted(
        r.prompt_len + len(r.output_tokens) - 1 for r in live.requests)


def test_trace_workload_refuses_a_mismatched_config(tmp_path):
  trace = small_trace(tmp_path)
  base = ["model.preset=tiny", "workload.kind=trace", f"workload.trace={tmp_path / 't.npz'}",
          "engine.max_batch=3", "engine.page_size=8", "memory.system=hisparse",
          "memory.host_pool=400", "memory.hisparse.device_buffer_size=16"]
  load = lambda *kw: load_config("experiments/quickstart/config.yaml", base + list(kw))
  with pytest.raises(TraceWorkloadError, match=r"set engine\.page_size=8"):
    replay_workload(load("engine.page_size=64"))
  with pytest.raises(TraceWorkloadError, match=r"3 batch rows; set engine\.max_batch=3"):
    replay_workload(load("engine.max_batch=2"))
  with pytest.raises(TraceWorkloadError, match=r"3 layer groups.*memory system has 2"):
    replay_workload(load())
  with pytest.raises(TraceWorkloadError, match=r"top-k=16.*model\.index_topk=8"):
    replay_workload(load("model.num_layers=6", "model.num_dense_layers=1"))
  with pytest.raises(TraceWorkloadError, match=r"holds \d+ logical addresses.*uses "
                     rf"{trace.num_logical}.*memory\.host_pool"):
    replay_workload(load("model.num_layers=6", "model.num_dense_layers=1",
                         "model.index_topk=16", "memory.host_pool=64"))
  with pytest.raises(TraceWorkloadError, match=r"no such trace file"):
    replay_workload(load_config("experiments/quickstart/config.yaml", base + [
        f"workload.trace={tmp_path / 'nope.npz'}"]))
  with pytest.raises(ValueError, match=r"workload\.kind='trace' needs workload\.trace"):
    load_config("experiments/quickstart/config.yaml", ["workload.kind=trace"])


# ----------------------------------------------------------------------------------
# Statistics and the generator's stated locality
# ----------------------------------------------------------------------------------


def test_stats_follow_the_generators_overlap(tmp_path):
  geo = dataclasses.replace(GEO, top_k=32)
  stats = {}
  for ov in (1.0, 0.5, 0.0):
    trace = small_trace(tmp_path, f"o{ov}.npz", overlap=ov, requests=4, batch=4,
                        steps=(60, 60), context=(200, 400), geo=geo)
    stats[ov] = locality_stats([trace])
  k = 32
  # 1.0 keeps all but one entry (room for the new token); 0 keeps none.
  assert stats[1.0]["overlap"]["mean"] == pytest.approx((k - 1) / k)
  assert stats[0.5]["overlap"]["mean"] == pytest.approx(0.5, abs=0.05)
  assert stats[0.0]["overlap"]["mean"] == 0.0
  lru = lambda ov, key: stats[ov]["lru_buffer"][key]["miss_rate"]
  assert lru(1.0, "k") < 0.03  # only the first step after the prefill misses
  assert lru(0.0, "k") > 0.9
  assert lru(0.5, "4k") < lru(0.5, "2k") < lru(0.5, "k")
  s = stats[0.5]
  assert len(s["overlap"]["per_group"]) == 3
  assert set(s["overlap"]["per_context"]) <= {"128-256", "256-512"}  # contexts 200-460
  reuse = s["reuse_distance"]
  assert reuse["bins"][0] == "1" and sum(reuse["counts"]) > 0 and reuse["first_use"] > 0
  assert s["trace"]["sampled_rows"] == "all"


def test_stats_lru_is_exact_lru(tmp_path):
  """The per-request buffer statistic against a plain model: one OrderedDict per request
  and group."""
  from collections import OrderedDict

  trace = small_trace(tmp_path, overlap=0.6, requests=5, batch=2, steps=(10, 25),
                      context=(20, 80))
  got = locality_stats([trace], capacities=(1, 2))["lru_buffer"]
  k, G = trace.top_k, trace.num_groups
  reqs = trace_requests(trace)
  for f, key in ((1, "k"), (2, "2k")):
    Q = f * k + 1
    bufs: dict = {}
    miss = look = 0
    for e in range(trace.kind.shape[0]):
      if trace.kind[e] == PREFILL:
        for g in range(G):
          buf = bufs.setdefault((g, int(trace.row[e])), OrderedDict())
          for a in trace.event_addrs(e).tolist():
            buf[a] = None
            while len(buf) > Q:
              buf.popitem(last=False)
      elif trace.kind[e] == RELEASE:
        for g in range(G):
          bufs.pop((g, int(trace.row[e])), None)
      else:
        t = int(trace.ref[e])
        for b in np.flatnonzero(trace.active[t]):
          new = int(trace.new_addr[t, b])
          for g in range(G):
            buf = bufs.setdefault((g, int(b)), OrderedDict())
            for a in trace.sel_addr[t, g, b].tolist():
              if a < 0 or a == new:
                continue
              look += 1
              if a in buf:
                buf.move_to_end(a)
              else:
                miss += 1
                buf[a] = None
            buf[new] = None
            while len(buf) > Q:
              buf.popitem(last=False)
    assert got[key]["lookups"] == look and got[key]["miss_rate"] == pytest.approx(miss / look)
  assert reqs.num_requests == 5


def test_stats_sample_rows_of_large_traces(tmp_path):
  trace = small_trace(tmp_path, requests=6, batch=6, steps=(20, 20), context=(40, 60))
  per_row = trace.num_steps * trace.num_groups * trace.top_k
  s = locality_stats([trace], max_selections=2 * per_row, seed=3)
  rows = s["trace"]["sampled_rows"]
  assert len(rows) == 2
  alone = locality_stats([trace.take_rows(rows)])
  for key in ("k", "2k", "4k"):
    assert s["lru_buffer"][key]["miss_rate"] == alone["lru_buffer"][key]["miss_rate"]
  assert s["overlap"]["mean"] == pytest.approx(alone["overlap"]["mean"])


def test_shared_pool_rates_and_plots(tmp_path):
  from ula_jax.report.locality import PLOT_FILES, locality_tables, plot_locality

  trace = small_trace(tmp_path)
  s = locality_stats([trace], shared_pool=True)
  pool = s["shared_pool"]
  assert set(pool) == {"k", "2k", "4k"} and pool["k"]["device_pool"] == 3 * 17
  for key in pool:
    for policy in ("pb_lru", "lru"):
      assert 0 < pool[key][policy]["hit_rate"] <= 1
      assert pool[key][policy]["miss_rate"] == pytest.approx(1 - pool[key][policy]["hit_rate"])
  assert pool["k"]["pb_lru"]["hit_rate"] < pool["4k"]["pb_lru"]["hit_rate"]
  assert len(locality_tables(s)) == 4
  paths = plot_locality(s, tmp_path / "plots")
  assert [p.name for p in paths] == list(PLOT_FILES) and all(p.stat().st_size for p in paths)
  json.dumps(s)  # JSON-able as it is


# ----------------------------------------------------------------------------------
# Formats: the directory form, rows inferred for traces recorded without them
# ----------------------------------------------------------------------------------


def test_directory_trace_is_memory_mapped_and_equal(tmp_path):
  a = small_trace(tmp_path, "a.npz")
  b = small_trace(tmp_path, "b_dir")
  assert isinstance(b.sel_addr, np.memmap)
  for f in dataclasses.fields(SelectionTrace):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if isinstance(x, np.ndarray):
      np.testing.assert_array_equal(x, y)
    else:
      assert x == y, f.name
  assert load_traces(tmp_path / "b_dir")[0].num_steps == a.num_steps


def test_rows_are_inferred_when_not_recorded(tmp_path):
  trace = small_trace(tmp_path, requests=9, batch=3, seed=5)
  blind = SelectionTrace(**{f.name: getattr(trace, f.name) for f in
                            dataclasses.fields(SelectionTrace) if f.name != "row"})
  np.testing.assert_array_equal(blind.row, trace.row)
  # A trace cut before the last requests' release (a run stopped early).
  last = int(np.flatnonzero(trace.kind == DECODE)[-8])
  cut = dataclasses.replace(
      trace, kind=trace.kind[:last + 1], ref=trace.ref[:last + 1],
      count=trace.count[:last + 1], row=trace.row[:last + 1],
      sel_addr=trace.sel_addr[:trace.ref[last] + 1],
      sel_valid=trace.sel_valid[:trace.ref[last] + 1],
      new_addr=trace.new_addr[:trace.ref[last] + 1], active=trace.active[:trace.ref[last] + 1])
  blind = SelectionTrace(**{f.name: getattr(cut, f.name) for f in
                            dataclasses.fields(SelectionTrace) if f.name != "row"})
  np.testing.assert_array_equal(blind.row, cut.row)


# ----------------------------------------------------------------------------------
# SGLang's indexer_topk
# ----------------------------------------------------------------------------------


def sglang_arrays(rng, prompt: int, out: int, layers: int, k: int) -> np.ndarray:
  """int32 [prompt + out - 1, layers, k], as SGLang returns: row i selects positions
  <= i (-1 padded while fewer than k exist)."""
  rows = prompt + out - 1
  arr = np.full((rows, layers, k), -1, np.int32)
  for i in range(rows):
    for l in range(layers):
      n = min(i + 1, k)
      arr[i, l, :n] = rng.choice(i + 1, size=n, replace=False)
  return arr


def write_sglang_dir(tmp_path, rng, *, layers=4, k=8):
  d = tmp_path / "sglang"
  d.mkdir()
  reqs = []
  a = sglang_arrays(rng, 30, 12, layers, k)
  np.save(d / "r0.npy", a)
  reqs.append({"id": "r0", "file": "r0.npy", "prompt_len": 30})
  b = sglang_arrays(rng, 20, 9, layers, k)
  np.savez(d / "r1.npz", indexer_topk=b, other=np.zeros(3))
  reqs.append({"id": "r1", "file": "r1.npz", "prompt_len": 20, "key": "indexer_topk"})
  c = sglang_arrays(rng, 25, 15, layers, k)
  (d / "r2.json").write_text(json.dumps(c[25:].tolist()))  # decode rows only
  reqs.append({"id": "r2", "file": "r2.json", "prompt_len": 25, "first_position": 25})
  (d / "manifest.json").write_text(json.dumps({"requests": reqs}))
  return d, {"r0": (30, a), "r1": (20, b), "r2": (25, c)}


def test_sglang_arrays_import_and_replay(tmp_path, seed):
  rng = np.random.default_rng(seed)
  src, arrays = write_sglang_dir(tmp_path, rng)  # 4 indexer layers: one per model layer
  out = import_sglang(src, tmp_path / "imported.npz", TINY, max_batch=2, page_size=16,
                      prefill_chunk=16)
  trace = SelectionTrace.load(out)
  reqs = trace_requests(trace)
  # r0 and r1 start together; r2 takes the first row to free up.
  assert reqs.prompt_len.tolist() == [30, 20, 25]
  assert reqs.steps.tolist() == [12 - 1, 9 - 1, 15 - 1]
  assert reqs.released.all()
  # Step by step, each group holds its first layer's selection, in the row's addresses.
  pos_of = {}
  for t in range(trace.num_steps):
    for b in np.flatnonzero(trace.active[t]):
      r = int(reqs.step_req[t, b])
      rid = ["r0", "r1", "r2"][r]
      prompt, arr = arrays[rid]
      p = int(reqs.step_pos[t, b])
      want = arr[p]  # [layers, k] positions
      got = trace.sel_addr[t, :, b]  # [G, k] addresses
      for g in range(trace.num_groups):
        sel = want[g * TINY.group_size]
        assert (got[g] >= 0).sum() == (sel >= 0).sum()
        for q, addr in zip(sel[sel >= 0].tolist(), got[g][got[g] >= 0].tolist()):
          pos_of.setdefault((r, q), addr)
          assert pos_of[(r, q)] == addr  # one address per (request, position)
  src_doc = json.loads(str(np.load(out)["source_json"]))
  assert src_doc["group_layers"] == [0, 2]
  for name in ("hisparse", "ula"):
    mem = (["memory.system=hisparse", "memory.hisparse.device_buffer_size=8",
            "memory.host_pool=1024"] if name == "hisparse" else
           ["memory.system=ula", "memory.device_pool=20", "memory.host_pool=1024"])
    totals = []
    for engine in ("fast", "system"):
      cfg = load_config("experiments/quickstart/config.yaml", [
          "model.preset=tiny", "engine.max_batch=2", "engine.page_size=16",
          "workload.kind=trace", f"workload.trace={out}", f"workload.trace_replay={engine}",
          *mem])
      res = replay_workload(cfg)
      totals.append({k: res.summary[f"total_{k}"] for k in ("hits", "misses", "evictions")})
      assert [r.id for r in res.requests] == ["r0", "r1", "r2"]
      assert res.summary["bytes_moved"]["fetch"] == (
          res.summary["total_misses"] * TINY.group_size * TINY.row_bytes)
    assert totals[0] == totals[1] and totals[0]["misses"] > 0, name
  # workload.trace may name the SGLang directory itself: imported with engine's rows.
  cfg = load_config("experiments/quickstart/config.yaml", [
      "model.preset=tiny", "engine.max_batch=2", "engine.page_size=16",
      "engine.prefill_chunk=16", "workload.kind=trace", f"workload.trace={src}", *mem])
  res = replay_workload(cfg)
  assert {k: res.summary[f"total_{k}"] for k in ("hits", "misses", "evictions")} == totals[0]
  assert res.summary["trace"]["source"]["requests"][2] == {"id": "r2", "prompt_len": 25,
                                                           "steps": 14}


def test_sglang_layer_choices(tmp_path):
  rng = np.random.default_rng(0)
  src, _ = write_sglang_dir(tmp_path, rng, layers=2)  # one indexer layer per group
  trace = SelectionTrace.load(import_sglang(src, tmp_path / "a.npz", TINY))
  assert trace.max_batch == 3 and trace.num_groups == 2
  out = import_sglang(src, tmp_path / "b.npz", TINY, layers=[1, 1])
  assert json.loads(str(np.load(out)["source_json"]))["group_layers"] == [1, 1]


def _manifest(tmp_path, requests, **top) -> str:
  (tmp_path / "manifest.json").write_text(json.dumps({"requests": requests, **top}))
  return str(tmp_path)


MALFORMED = [
    # (what the request entry or file is, the error)
    (lambda d: _manifest(d, [{"id": "a", "file": "a.npy"}]),
     r"request 'a': field 'prompt_len' missing"),
    (lambda d: _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": "30"}]),
     r"request 'a': field 'prompt_len'='30': expected an integer"),
    (lambda d: _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 0}]),
     r"request 'a': field 'prompt_len'=0: must be >= 1"),
    (lambda d: _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3},
                             {"id": "a", "file": "b.npy", "prompt_len": 3}]),
     r"request 'a': field 'id' repeats"),
    (lambda d: _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3, "len": 3}]),
     r"request 'a': unknown field\(s\) \['len'\]"),
    (lambda d: _manifest(d, [{"id": "a", "file": "gone.npy", "prompt_len": 3}]),
     r"request 'a' \(gone\.npy\): file .*gone\.npy' not found"),
    (lambda d: (np.save(d / "a.npy", np.zeros((4, 8), np.int32)),
                _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3}]))[1],
     r"request 'a' \(a\.npy\): field indexer_topk has shape \(4, 8\): expected \[rows, "
     r"num_indexer_layers, index_topk\]"),
    (lambda d: (np.save(d / "a.npy", np.zeros((4, 2, 8), np.float32)),
                _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3}]))[1],
     r"request 'a' \(a\.npy\): field indexer_topk has dtype float32: expected integers"),
    (lambda d: (_arr_with(d, 4, 1, 0, 5),
                _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3}]))[1],
     r"request 'a' \(a\.npy\): field indexer_topk row 4 \(position 4\), indexer layer 1, "
     r"selects position 5: a token selects positions <= its own"),
    (lambda d: (_arr_with(d, 4, 0, 3, -7),
                _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3}]))[1],
     r"request 'a' \(a\.npy\): field indexer_topk holds -7"),
    (lambda d: (np.savez(d / "a.npz", x=np.zeros((4, 2, 8), np.int32),
                         y=np.zeros((4, 2, 8), np.int32)),
                _manifest(d, [{"id": "a", "file": "a.npz", "prompt_len": 3}]))[1],
     r"request 'a' \(a\.npz\): a\.npz has arrays \['x', 'y'\]; name the indexer top-k one "
     r"with the manifest's field 'key'"),
    (lambda d: ((d / "a.json").write_text("[[[0, 1]], [[0]]]"),
                _manifest(d, [{"id": "a", "file": "a.json", "prompt_len": 1}]))[1],
     r"request 'a' \(a\.json\): field indexer_topk in a\.json is not a rectangular"),
    (lambda d: (_arr_with(d, 4, 0, 0, 0),
                _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3,
                               "first_position": 5}]))[1],
     r"request 'a' \(a\.npy\): field 'first_position'=5 is past prompt_len=3"),
    (lambda d: (_arr_with(d, 4, 0, 0, 0, layers=3),
                _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3}]))[1],
     r"field indexer_topk has 3 indexer layers; the model has 4 layers in 2 groups of 2"),
    (lambda d: (_arr_with(d, 4, 0, 0, 0, k=4),
                _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3}]))[1],
     r"field indexer_topk has index_topk=4; the model's index_topk is 8"),
    (lambda d: (_arr_with(d, 4, 0, 0, 0),
                _manifest(d, [{"id": "a", "file": "a.npy", "prompt_len": 3}], layers=[0]))[1],
     r"field 'layers' has 1 entries up to 0: expected 2 \(one per layer group\)"),
    (lambda d: str(d), r"manifest\.json: no such manifest"),
    (lambda d: ((d / "manifest.json").write_text("{\"requests\": []}"), str(d))[1],
     r"field 'requests' must be a non-empty list"),
]


def _arr_with(d, row, layer, col, value, *, layers=2, k=8):
  arr = np.full((6, layers, k), -1, np.int32)
  arr[row, layer, col] = value
  np.save(d / "a.npy", arr)


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_sglang_malformed_input_names_file_request_and_field(tmp_path, case):
  make, message = MALFORMED[case]
  src = make(tmp_path)
  with pytest.raises(SglangImportError, match=message):
    import_sglang(src, tmp_path / "out.npz", TINY)


def test_trace_cli_generate_stats_and_replay(tmp_path, capsys):
  from ula_jax.cli.main import main

  out = tmp_path / "gen"
  assert main(["trace", "generate", "--model", "tiny", "--requests", "4", "--steps", "8-12",
               "--context", "20-40", "--batch", "2", "--page-size", "16", "--overlap", "0.5",
               "--out", str(out)]) == 0
  assert main(["trace", "stats", str(out), "--json", str(tmp_path / "s.json"), "--plots",
               str(tmp_path / "plots")]) == 0
  stats = json.loads((tmp_path / "s.json").read_text())
  assert stats["overlap"]["mean"] == pytest.approx(0.5, abs=0.15)
  assert set(stats["shared_pool"]) == {"k", "2k", "4k"}
  assert main(["trace", "stats", str(tmp_path / "nope")]) == 2
  assert "no such trace file" in capsys.readouterr().err
  assert main(["trace", "generate", "--steps", "9-3", "--out", str(tmp_path / "x")]) == 2
  run = tmp_path / "run"
  assert main(["run", "experiments/quickstart/config.yaml", "model.preset=tiny",
               "workload.kind=trace", f"workload.trace={out}", "engine.max_batch=2",
               "engine.page_size=16", "memory.system=hisparse", "memory.host_pool=512",
               "memory.hisparse.device_buffer_size=8", "--out", str(run), "--no-progress"]) == 0
  summary = json.loads((run / "summary.json").read_text())
  assert summary["summary"]["total_misses"] > 0
  assert summary["summary"]["trace"]["source"]["overlap"] == 0.5
  assert (run / "metrics.jsonl").read_text().count("\n") == summary["summary"]["steps"]
