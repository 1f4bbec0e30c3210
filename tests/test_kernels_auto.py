"""kernels.*=auto: the references off a GPU, the shipped table's choices on a GPU it lists,
the fallback on one it does not, the rules that keep a choice runnable, the table itself."""

from __future__ import annotations

import copy
import json
import logging
import sys
import types
from pathlib import Path

import jax
import pytest

from ula_jax.config import validate
from ula_jax.kernels import auto
from ula_jax.kernels.auto import Device, LaunchShape
from ula_jax.mesh import auto_kernels, launch_shape

REPO = Path(__file__).resolve().parent.parent
H200 = Device("gpu", "NVIDIA H200", "9.0")
REFERENCES = {"attention": "xla", "indexer": "xla", "fetch": "xla", "resolve": "jnp"}
# The runs the shipped table is built from (ula_jax.bench.kernels_table's docstring).
TABLE_INPUTS = [f"results/h200/{f}" for f in (
    "bench_attention.json", "bench_attention_auto.json", "bench_attention_mosaic_issuers.json",
    "bench_fetch.json", "bench_resolve.json", "bench_resolve_fused.json",
    "prefill/prefill.json", "decode_ratios/fifth_run/resolve_r4.json",
    "decode_ratios/fifth_run/resolve_r32.json", "decode_ratios/sixth_run/fetch.json")] + [
    f"results/h100/auto_table/{f}" for f in (
        "attention.json", "attention_large.json", "fetch.json", "resolve_r32.json",
        "resolve_r4.json")]


def cfg_of(**sections):
  data = {"experiment": {"name": "t"}, "model": {"preset": "tiny"},
          "workload": {"length_scale": 0.002, "output_len": [16, 32]}}
  for k, v in sections.items():
    data[k] = {**data.get(k, {}), **v}
  return validate(data)


def fake_gpu(kind: str = "NVIDIA H200", cc: str | None = "9.0"):
  """A stand-in for a jax GPU device (what ``Device.of`` reads)."""
  return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)


GLM5 = {"preset": "glm5", "max_position": 1 << 20}  # 64 heads of 512 + 64, top-k 2048


def h200_rows() -> list[dict]:
  return auto.shipped_table()["devices"]["NVIDIA H200"]["attention"][0]["rows"]


def test_auto_is_the_default_and_the_references_off_a_gpu():
  cfg = cfg_of()
  assert [getattr(cfg.kernels, op) for op in auto.OPS] == ["auto"] * 4
  assert auto.choose(Device("cpu", "cpu"), LaunchShape()) == REFERENCES
  resolved = auto_kernels(cfg, jax.devices()[0])
  assert auto.concrete(resolved) == REFERENCES
  # The other fields stay; an explicit value is never changed.
  assert resolved.model_dump(exclude=set(auto.OPS)) == cfg.kernels.model_dump(
      exclude=set(auto.OPS))
  explicit = cfg_of(kernels={"attention": "pallas", "fetch": "pallas"})
  assert auto.concrete(auto_kernels(explicit, jax.devices()[0])) == {
      **REFERENCES, "attention": "pallas", "fetch": "pallas"}
  every = cfg_of(kernels={"attention": "xla", "indexer": "xla", "fetch": "xla",
                          "resolve": "jnp"})
  assert auto_kernels(every, jax.devices()[0]) is every.kernels
  # Pallas interpreted on a GPU (a debugging aid) keeps to the references too.
  assert auto.choose(H200, LaunchShape(), interpret=True) == REFERENCES


def test_an_explicit_value_keeps_its_error():
  from ula_jax.config import ConfigError
  from ula_jax.mesh import check_kernels

  with pytest.raises(ConfigError, match=r"kernels.attention=mosaic on cpu"):
    check_kernels(cfg_of(model=GLM5, kernels={"attention": "mosaic"}), "cpu")
  with pytest.raises(ConfigError, match=r"kernels.attention='mosaic' reads "
                     r"model.kv_layout='bf16' rows only"):
    cfg_of(model={"kv_layout": "fp8", "preset": "glm5", "max_position": 1 << 20},
           kernels={"attention": "mosaic"})
  # 'auto' with fp8 rows is valid: what the table measured on fp8 rows (the shipped one
  # has none: the reference), never mosaic.
  cfg = cfg_of(model={**GLM5, "kv_layout": "fp8"})
  assert auto_kernels(cfg, fake_gpu()).attention == "xla"


def test_h200_attention_by_query_rows_per_the_table():
  rows = h200_rows()
  # The shipped H200 rows: Triton below 64 query rows, Mosaic from 64 (measured at 64,
  # 128 and 256; never at fewer rows).
  assert [r["ranking"][0] for r in rows if r["max"] is not None and r["max"] < 64] == \
      ["pallas"] * 4
  assert all(r["ranking"][0] == "mosaic" for r in rows if r["min"] >= 64)
  for r in rows:
    for n in {r["min"], r["max"] or 4096}:
      assert auto.choose(H200, LaunchShape(rows=n), ffi=False)["attention"] == \
          r["ranking"][0], n


def test_query_rows_are_decode_rows_times_one_plus_drafts():
  gpu = fake_gpu()
  small = cfg_of(model=GLM5, engine={"max_batch": 8})
  assert launch_shape(small).rows == 8 and auto_kernels(small, gpu).attention == "pallas"
  big = cfg_of(model=GLM5, engine={"max_batch": 64})
  assert auto_kernels(big, gpu).attention == "mosaic"
  spec = cfg_of(model=GLM5, engine={"max_batch": 16}, speculative={"num_draft": 3})
  assert launch_shape(spec).rows == 64 and auto_kernels(spec, gpu).attention == "mosaic"


def test_mosaic_only_where_its_constraints_hold():
  gpu = fake_gpu()
  # 32 heads per device at tp 2: the table's next best.
  tp2 = cfg_of(model=GLM5, engine={"max_batch": 64}, mesh={"tp": 2})
  assert launch_shape(tp2).heads == 32 and auto_kernels(tp2, gpu).attention == "pallas"
  # dsv32 at tp 2: 64 heads per device in decode, but a computed prefill runs all 128 on
  # every rank; with synthetic prefill only decode attends.
  dsv32 = {"preset": "dsv32", "max_position": 1 << 20}
  computed = cfg_of(model=dsv32, engine={"max_batch": 64}, mesh={"tp": 2})
  assert auto_kernels(computed, gpu).attention == "pallas"
  synthetic = cfg_of(model=dsv32, engine={"max_batch": 64}, mesh={"tp": 2},
                     workload={"prefill": "synthetic"})
  assert auto_kernels(synthetic, gpu).attention == "mosaic"
  shape = LaunchShape(rows=128)
  assert auto.choose(H200, shape, ffi=False)["attention"] == "mosaic"
  for other in (LaunchShape(rows=128, kv_dtype="float32"), LaunchShape(rows=128, latent=256)):
    assert auto.choose(H200, other, ffi=False)["attention"] == "pallas"
  assert auto.choose(H200, LaunchShape(rows=128, kv_layout="fp8"))["attention"] == "xla"
  # Not Hopper (the compute capability decides where the device reports it).
  assert auto.choose(Device("gpu", "NVIDIA H200", "8.0"), shape, ffi=False)["attention"] == \
      "pallas"
  assert Device("gpu", "NVIDIA H100 80GB HBM3").hopper and not Device("gpu", "A100").hopper


def test_an_unknown_gpu_takes_the_fallback_and_says_so(caplog, monkeypatch):
  monkeypatch.setattr(auto, "_logged", set())
  gpu = Device("gpu", "NVIDIA Future GPU", "10.0")
  with caplog.at_level(logging.WARNING, logger="ula_jax.kernels.auto"):
    assert auto.choose(gpu, LaunchShape(rows=256), ffi=True) == {
        "attention": "pallas", "indexer": "pallas", "fetch": "pallas",
        "resolve": "pallas"}
    assert auto.choose(gpu, LaunchShape(policy="lru"))["resolve"] == "pallas"
  lines = [r.getMessage() for r in caplog.records]
  assert len(lines) == 1 and "'NVIDIA Future GPU' has no measurements" in lines[0]
  # Widths the Triton kernels cannot take: the references.
  odd = LaunchShape(latent=96, index_dim=48)
  assert auto.choose(gpu, odd)["attention"] == "xla"
  assert auto.choose(gpu, odd)["indexer"] == "xla"


def test_a_known_gpu_logs_nothing(caplog):
  with caplog.at_level(logging.DEBUG, logger="ula_jax.kernels.auto"):
    auto.choose(H200, LaunchShape(), ffi=False)
    auto_kernels(cfg_of(), jax.devices()[0])
  assert caplog.records == []


def test_resolve_by_policy():
  pb_lru = auto.shipped_table()["devices"]["NVIDIA H200"]["resolve"]["pb_lru"]["ranking"]
  assert set(pb_lru) == {"pallas", "pallas_fused", "jnp"}
  assert auto.choose(H200, LaunchShape(policy="pb_lru"))["resolve"] == pb_lru[0]
  assert auto.choose(H200, LaunchShape(policy="lru"))["resolve"] == "pallas"
  lru = cfg_of(memory={"system": "ula", "policy": "lru"})
  assert auto_kernels(lru, fake_gpu()).resolve == "pallas"
  assert auto_kernels(cfg_of(memory={"system": "ula"}), fake_gpu()).resolve == pb_lru[0]
  # Each ranking is followed: the fused launch where PB-LRU's ranking puts it first (a
  # table without per-shape rankings: the policy's one ranking).
  table = copy.deepcopy(auto.shipped_table())
  entry = table["devices"]["NVIDIA H200"]["resolve"]["pb_lru"]
  entry["ranking"] = ["pallas_fused", "pallas", "jnp"]
  del entry["by_shape"]
  assert auto.choose(H200, LaunchShape(policy="pb_lru"), table=table)["resolve"] == \
      "pallas_fused"
  # A table that ranks the fused resolve first for exact LRU still gets the four launches.
  table = copy.deepcopy(auto.shipped_table())
  entry = table["devices"]["NVIDIA H200"]["resolve"]["lru"]
  entry["ranking"] = ["pallas_fused", "jnp"]
  for e in entry["by_shape"]:
    e["ranking"] = ["pallas_fused", "jnp"]
  assert auto.choose(H200, LaunchShape(policy="lru"), table=table)["resolve"] == "pallas"


def test_fetch_and_resolve_follow_the_launch_shape():
  """Fetch takes the ranking measured nearest the stored row's size and a decode step's
  rows per call; resolve the one nearest its batch (the shipped H200 table: the FFI copy
  leads below 4K rows a call, the Pallas copy from 4K; PB-LRU's one launch leads at
  batch 128, the four launches at 32 and 64)."""
  h200 = auto.shipped_table()["devices"]["NVIDIA H200"]
  at = {(e["row_bytes"], e["entries"]): e["ranking"][0] for e in h200["fetch"]["by_shape"]}
  assert at[(656, 256)] == "ffi" and at[(656, 65536)] == "pallas"
  fp8 = dict(kv_layout="fp8", row_bytes=656)
  assert LaunchShape(rows=64, **fp8).fetch_rows == 64 * 2049
  assert auto.choose(H200, LaunchShape(rows=64, **fp8), ffi=True)["fetch"] == "pallas"
  assert auto.choose(H200, LaunchShape(rows=1, top_k=255, **fp8), ffi=True)["fetch"] == "ffi"
  # Without the FFI package the next of the same ranking; without the row size the
  # ranking over every size.
  assert auto.choose(H200, LaunchShape(rows=1, top_k=255, **fp8), ffi=False)["fetch"] == \
      "pallas"
  assert auto.choose(H200, LaunchShape(rows=64), ffi=True)["fetch"] == h200["fetch"][
      "ranking"][0]
  # The config's shape: GLM-5 FP8 rows at batch 64 (a 131K-row launch).
  glm5 = cfg_of(model={**GLM5, "kv_layout": "fp8"}, engine={"max_batch": 64})
  assert launch_shape(glm5).row_bytes == 656
  assert auto.choose(H200, launch_shape(glm5), ffi=True)["fetch"] == "pallas"
  first = {(e["buckets"], e["batch"]): e["ranking"][0]
           for e in h200["resolve"]["pb_lru"]["by_shape"]}
  assert first == {(4, 32): "pallas", (4, 64): "pallas", (4, 128): "pallas_fused",
                   (32, 32): "pallas", (32, 64): "pallas"}
  # The ring nearest the run's first, then the batch: at the default ring of 32 the four
  # launches at any batch (the one launch led only at batch 128 with a ring of 4).
  assert auto.choose(H200, LaunchShape(rows=58))["resolve"] == "pallas"
  assert auto.choose(H200, LaunchShape(rows=160))["resolve"] == "pallas"
  assert auto.choose(H200, LaunchShape(rows=160, buckets=4))["resolve"] == "pallas_fused"
  assert auto.choose(H200, LaunchShape(rows=160, buckets=4, policy="lru"))["resolve"] == \
      "pallas"
  ring4 = cfg_of(memory={"system": "ula", "pb_lru_buckets": 4}, engine={"max_batch": 128})
  assert launch_shape(ring4).buckets == 4
  assert auto_kernels(ring4, fake_gpu()).resolve == "pallas_fused"


def test_a_malformed_per_shape_ranking_is_rejected():
  table = copy.deepcopy(auto.shipped_table())
  h200 = table["devices"]["NVIDIA H200"]
  h200["fetch"]["by_shape"][0]["entries"] = 0
  h200["resolve"]["pb_lru"]["by_shape"][1]["ranking"] = ["triton"]
  h200["resolve"]["pb_lru"]["by_shape"][2]["buckets"] = "many"
  problems = auto.check_table(table)
  assert "NVIDIA H200.resolve.pb_lru.by_shape[2]: expected buckets >= 1" in problems
  assert "NVIDIA H200.fetch.by_shape[0]: expected row_bytes, entries >= 1" in problems
  assert any(p.startswith("NVIDIA H200.resolve.pb_lru.by_shape[1]: ranking ['triton']")
             for p in problems), problems


def test_ffi_only_when_it_imports(monkeypatch):
  assert auto.shipped_table()["devices"]["NVIDIA H200"]["fetch"]["ranking"][0] == "ffi"
  monkeypatch.setitem(sys.modules, "ula_jax_ffi", None)  # import fails
  assert not auto.ffi_available()
  assert auto.choose(H200, LaunchShape())["fetch"] == "pallas"
  fake = types.SimpleNamespace(has_cuda=lambda: False)
  monkeypatch.setitem(sys.modules, "ula_jax_ffi", fake)
  assert auto.choose(H200, LaunchShape())["fetch"] == "pallas"  # no CUDA handlers
  fake.has_cuda = lambda: True
  assert auto.ffi_available() and auto.choose(H200, LaunchShape())["fetch"] == "ffi"


def test_the_shipped_table_names_only_implementations_that_exist():
  from ula_jax.config import KernelsConfig
  from ula_jax.kernels import fetch, sparse_attention
  from ula_jax.kernels.indexer import prefill as indexer
  from ula_jax.memory.ula import resolve

  registries = {"attention": sparse_attention.IMPLS, "indexer": indexer.IMPLS,
                "fetch": fetch.IMPLS, "resolve": resolve.IMPLS}
  for op in auto.OPS:
    assert set(auto.IMPLS[op]) == set(registries[op]), op
    literal = set(KernelsConfig.model_fields[op].annotation.__args__)
    assert literal == {"auto", *auto.IMPLS[op]}, op
    assert auto.REFERENCES[op] in auto.IMPLS[op] and auto.FALLBACK[op][-1] == \
        auto.REFERENCES[op]
  table = auto.shipped_table()
  assert auto.check_table(table) == []
  assert set(table["devices"]["NVIDIA H200"]) == {"attention", "indexer", "fetch", "resolve"}
  bad = copy.deepcopy(table)
  bad["devices"]["NVIDIA H200"]["fetch"]["ranking"] = ["cuda"]
  bad["devices"]["NVIDIA H200"]["attention"][0]["rows"][1]["min"] = 3
  problems = auto.check_table(bad)
  assert any("NVIDIA H200.fetch: ranking ['cuda']" in p for p in problems)
  assert any("attention[0].rows[1]: expected min=8" in p for p in problems)
  assert auto.check_table({"format": 0}) == [f"format: expected {auto.TABLE_FORMAT}"]


def test_a_bad_table_file_is_refused(tmp_path):
  path = tmp_path / "table.json"
  path.write_text('{"format": 1, "devices": {"X": {"fetch": {"ranking": ["cuda"]}}}}')
  with pytest.raises(ValueError, match=r"table.json: X.fetch: ranking \['cuda'\]"):
    auto.read_table(path)
  path.write_text("{")
  with pytest.raises(ValueError, match="unreadable kernels table"):
    auto.read_table(path)


def test_the_table_is_what_its_command_builds(monkeypatch, tmp_path, capsys):
  from ula_jax.bench import kernels_table

  monkeypatch.chdir(REPO)
  out = tmp_path / "table.json"
  assert kernels_table.main(["--out", str(out), *TABLE_INPUTS]) == 0
  assert auto.read_table(out) == auto.read_table(auto.TABLE_PATH)
  printed = capsys.readouterr().out
  assert "NVIDIA H200" in printed and "NVIDIA H100 80GB HBM3" in printed
  # --merge keeps the devices the inputs do not measure.
  other = {"format": auto.TABLE_FORMAT,
           "devices": {"Other GPU": {"fetch": {"ranking": ["pallas", "xla"]}}}}
  (tmp_path / "old.json").write_text(json.dumps(other))
  assert kernels_table.main(["--out", str(out), "--merge", str(tmp_path / "old.json"),
                             TABLE_INPUTS[3]]) == 0
  assert set(auto.read_table(out)["devices"]) == {"Other GPU", "NVIDIA H200"}


def test_the_builder_counts_production_launches_only():
  from ula_jax.bench.kernels_table import latest, measurements, ranked

  env = {"backend": "gpu", "device": "G", "date": "2026-01-01T00:00:00+00:00"}
  geo = {"heads": 64, "k": 2048, "latent": 512, "rope": 64, "dtype": "bfloat16"}
  att = {"benchmark": "attention", "environment": env, "geometry": geo, "rows": [
      {"batch": 8, "impl": "pallas[auto]", "seconds": 2.0},
      {"batch": 8, "impl": "pallas[h64k64w8]", "seconds": 1.0},  # a sweep point
      {"batch": 8, "impl": "mosaic[compute]", "seconds": 0.5},  # an ablation
      {"batch": 8, "impl": "xla", "seconds": None, "error": "failed"}]}
  assert [(m.impl, m.seconds) for m in measurements(att, "a.json")] == [("pallas", 2.0)]
  assert measurements({**att, "environment": {**env, "backend": "cpu"}}, "a.json") == []
  stream = {"k": 2048, "loop": "while", "steps": 32}
  row = {"pool": 1 << 20, "batch": 64, "k": 2048}
  res = {"benchmark": "resolve", "environment": env, "stream": stream, "rows": [
      {**row, "policy": "pb_lru", "impl": "pallas", "fused": True, "us": 40.0},
      {**row, "policy": "pb_lru", "impl": "pallas", "fused": False, "us": 50.0},
      {**row, "policy": "pb_lru", "impl": "jnp", "us": 1000.0},
      {**row, "policy": "lru", "impl": "pallas[fused]", "fused": False, "us": 90.0},
      {**row, "policy": "lru", "impl": "pallas", "us": 80.0,
       "config": {"block_elems": 1}}]}  # not the production launch
  found = latest(measurements(res, "r.json"))
  assert ranked(found, "G", "resolve", lambda g: g[0] == "pb_lru")["ranking"] == [
      "pallas_fused", "pallas", "jnp"]
  assert ranked(found, "G", "resolve", lambda g: g[0] == "lru")["ranking"] == ["pallas"]
  # Of two runs at the same settings the later one counts.
  later = {**res, "environment": {**env, "date": "2026-02-01T00:00:00+00:00"},
           "rows": [{**row, "policy": "pb_lru", "impl": "pallas", "fused": False,
                     "us": 30.0}]}
  found = latest(measurements(res, "r.json") + measurements(later, "s.json"))
  entry = ranked(found, "G", "resolve", lambda g: g[0] == "pb_lru")
  assert entry["ranking"][0] == "pallas" and "s.json (2026-02-01)" in entry["sources"]


def test_the_run_summary_records_the_kernels_it_ran():
  from tests.engine_util import BASE, mesh_for
  from ula_jax.config import load_config
  from ula_jax.engine import Engine, resolve_max_context

  cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false", "memory.system=ula",
                           "memory.host_pool=1024", "kernels.fetch=pallas"])
  engine = Engine(cfg, mesh_for(1), max_context=resolve_max_context(cfg))
  assert engine.cfg.kernels.attention == "auto"  # the config as given (checkpoints)
  summary = engine.run([]).summary
  assert summary["kernels"] == {**REFERENCES, "fetch": "pallas"}


def test_auto_fetch_skips_pallas_where_a_byte_pool_is_2_to_4_gib(monkeypatch):
  """The Pallas row copy cannot index one-byte pools of 2-4 GiB: where ``auto`` chose it,
  the engine decides again once its pools exist, without it."""
  import dataclasses

  from jax.sharding import NamedSharding, PartitionSpec as P

  from tests.engine_util import BASE, mesh_for
  from ula_jax import mesh as mesh_module
  from ula_jax.config import load_config
  from ula_jax.engine import Engine, engine as engine_module, resolve_max_context

  shape = LaunchShape(rows=64, kv_layout="fp8", row_bytes=656)
  assert auto.choose(H200, shape, ffi=True)["fetch"] == "pallas"
  wide = dataclasses.replace(shape, wide_byte_pool=True)
  assert auto.problem("fetch", "pallas", H200, wide) == (
      "pallas cannot index one-byte pools of 2-4 GiB (32-bit element offsets)")
  assert auto.choose(H200, wide, ffi=True)["fetch"] == "ffi"
  assert auto.choose(H200, wide, ffi=False)["fetch"] == "xla"

  cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false", "memory.system=ula",
                           "memory.host_pool=1024"])
  engine = Engine(cfg, mesh_for(1), max_context=resolve_max_context(cfg))
  # As on a GPU where auto took the Pallas copy (this CPU takes the references).
  engine.kernels = engine.kernels.model_copy(update={"fetch": "pallas"})
  engine.mem.set_fetch_impl("pallas")
  monkeypatch.setattr(engine_module, "auto_kernels", lambda cfg, device, **kw:
                      mesh_module.auto_kernels(cfg, fake_gpu(), **kw))
  monkeypatch.setattr(auto, "ffi_available", lambda: False)
  sharding = NamedSharding(engine.mesh, P("dp"))
  pools = lambda n: [jax.ShapeDtypeStruct((1, n), "uint8", sharding=sharding),
                     jax.ShapeDtypeStruct((1, 3 * 2**30), "int32", sharding=sharding)]
  engine._check_fetch_fits(pools(2**31 - 1))  # under 2 GiB: kept
  assert engine.kernels.fetch == engine.mem.fetch_impl == "pallas"
  engine._check_fetch_fits(pools(3 * 2**30))
  assert engine.kernels.fetch == engine.mem.fetch_impl == "xla"
  # A system that holds another hands the choice on (ula TP's host tier is a ula).
  from ula_jax.memory import sized_system

  tp = sized_system(load_config(BASE, ["model.preset=tiny", "memory.system=ula", "mesh.dp=1",
                                       "mesh.tp=2", "memory.host_pool=1024"]))
  tp.set_fetch_impl("ffi")
  assert tp.fetch_impl == tp.store.ula.fetch_impl == "ffi"


def test_attention_rankings_by_row_layout(monkeypatch, capsys):
  """A table's fp8 entries (from ``bench attention --kv-layout fp8``) rank fp8 rows'
  launches; bf16 entries rank bf16 rows' only. The builder keeps the layouts apart and
  names the layout in a geometry only for fp8 rows."""
  from ula_jax.bench.kernels_table import (attention_entries, latest, measurements,
                                           print_rankings)

  env = {"backend": "gpu", "device": "G", "date": "2026-01-01T00:00:00+00:00"}
  geo = {"heads": 64, "k": 2048, "latent": 512, "rope": 64, "dtype": "bfloat16"}
  runs = [{"benchmark": "attention", "environment": env, "geometry": g, "rows": [
      {"batch": 8, "impl": "xla", "seconds": x}, {"batch": 8, "impl": "pallas", "seconds": p}]}
      for g, x, p in ((geo, 3.0, 1.0), ({**geo, "kv_layout": "fp8"}, 1.0, 2.0))]
  found = latest([m for i, r in enumerate(runs) for m in measurements(r, f"{i}.json")])
  entries = attention_entries(found, "G")
  assert [(e["geometry"].get("kv_layout"), e["rows"][0]["ranking"]) for e in entries] == [
      (None, ["pallas", "xla"]), ("fp8", ["xla", "pallas"])]
  table = {"format": auto.TABLE_FORMAT, "devices": {"G": {"attention": entries}}}
  print_rankings(table)
  printed = capsys.readouterr().out
  assert "k 2048, fp8 rows, rows 1-" in printed and "k 2048, rows 1-" in printed
  gpu = Device("gpu", "G", "9.0")
  assert auto.choose(gpu, LaunchShape(rows=8), table=table, ffi=False)["attention"] == "pallas"
  fp8 = LaunchShape(rows=8, kv_layout="fp8")
  assert auto.choose(gpu, fp8, table=table, ffi=False)["attention"] == "xla"
  # Measured faster on fp8 rows, the Pallas kernel is taken for them.
  entries[1]["rows"][0]["ranking"] = ["pallas", "xla"]
  assert auto.choose(gpu, fp8, table=table, ffi=False)["attention"] == "pallas"
  # With no fp8 entry, fp8 rows take the reference, even where bf16 rows rank pallas.
  bf16_only = {"format": auto.TABLE_FORMAT, "devices": {"G": {"attention": entries[:1]}}}
  assert auto.choose(gpu, fp8, table=bf16_only, ffi=False)["attention"] == "xla"
  monkeypatch.setattr(auto, "_logged", set())  # the unknown GPU's line, logged here
  assert auto.choose(Device("gpu", "Unknown GPU", "9.0"), fp8, table=bf16_only,
                     ffi=False)["attention"] == "xla"
