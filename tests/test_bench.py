"""The kernel benchmarks run end to end at tiny sizes and write what they print."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.probe_util import load_probe
from ula_jax.bench import attention, fetch, summary
from ula_jax.bench.common import (best_and_median, device_copy_rate, environment, parse_list,
                                   parse_sizes)
from ula_jax.kernels.fetch import evict_rows, fetch_rows
from ula_jax.kernels.sparse_attention.pallas import AttentionConfig


MEMCPY = "contiguous[memcpy]"  # measured only on a GPU with CuPy


def test_fetch_benchmark_covers_every_implementation(tmp_path, capsys):
  out = tmp_path / "fetch.json"
  rc = fetch.main(["--quick", "--layouts", "fp8x656", "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  rows = result["rows"]
  impls = {r["impl"] for r in rows}
  assert impls - {MEMCPY} == {"contiguous[jax]", "xla", "pallas", "ffi"}, result["skipped"]
  assert (MEMCPY in impls) != (MEMCPY in result["skipped"])
  # Kernels at every entry count; ceilings only where there are bytes to copy.
  assert {(r["direction"], r["entries"]) for r in rows if r["impl"] == "pallas"} == {
      (d, n) for d in ("fetch", "evict") for n in (0, 1, 300)}
  assert {(r["direction"], r["entries"]) for r in rows if r["impl"] == "contiguous[jax]"} == {
      (d, n) for d in ("fetch", "evict") for n in (1, 300)}
  for r in rows:
    assert r["error"] is None
    # Two repetitions, or one where a call outlasts --target-ms (1 ms with --quick).
    assert r["reps"] == 2 or (r["reps"] == 1 and r["seconds"] > 1e-3)
    assert 0 < r["seconds"] <= r["median_seconds"]
    if not r["impl"].startswith("contiguous"):
      assert r["ok"] is True  # bit-exact rows
    if r["entries"]:
      group = [x for x in rows if (x["direction"], x["entries"]) == (r["direction"], r["entries"])]
      ceiling = max(x["gbps"] for x in group if x["impl"].startswith("contiguous"))
      assert r["gbps"] == pytest.approx(r["entries"] * 656 / r["seconds"] / 1e9)
      assert r["baseline_gbps"] == ceiling
      assert r["fraction"] == pytest.approx(r["gbps"] / ceiling)
      assert r["median_fraction"] > 0
  assert all(r["in_place"] is None for r in rows if r["impl"] == "xla")
  # The jax ceiling writes into the buffer it was given: nothing allocated per call.
  assert all(r["in_place"] for r in rows if r["impl"] == "contiguous[jax]")
  assert "row fetch/evict on" in capsys.readouterr().out


def test_fetch_benchmark_sweeps_pallas_configurations(tmp_path):
  out = tmp_path / "fetch.json"
  rc = fetch.main(["--quick", "--layouts", "bf16x576", "--impls", "pallas", "--directions",
                   "fetch", "--entries", "37", "--pallas-block-units", "64,256",
                   "--ceilings", "jax", "--out", str(out)])
  assert rc == 0
  impls = [r["impl"] for r in json.loads(out.read_text())["rows"]]
  assert impls == ["contiguous[jax]", "pallas[u64,w4]", "pallas[u256,w4]"]


def test_fetch_benchmark_passes_worst_case_lists_with_a_count(tmp_path):
  """--list-factor 5: lists five times the entries, the rest skipped, a count naming
  the entries; every implementation still moves exactly those rows (checked bit for
  bit), and the Pallas sweep over programs per launch labels each launch."""
  out = tmp_path / "fetch.json"
  rc = fetch.main(["--quick", "--layouts", "fp8x656", "--impls", "xla,pallas",
                   "--entries", "37", "--list-factor", "5", "--pallas-block-units", "16",
                   "--pallas-programs", "2,2048", "--ceilings", "jax", "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["list_factor"] == 5
  kernels = [r for r in result["rows"] if not r["impl"].startswith("contiguous")]
  assert [r["impl"] for r in kernels if r["direction"] == "fetch"] == [
      "xla", "pallas[u16,w4][p2]", "pallas[u16,w4][p2048]"]
  assert all(r["ok"] is True and r["error"] is None for r in kernels)
  with pytest.raises(ValueError, match=r"--list-factor=0: expected >= 1"):
    fetch.main(["--quick", "--list-factor", "0"])


def test_fetch_benchmark_reads_host_rows_in_runs(tmp_path, rng):
  """--host-run 4: the host rows come in runs of four adjacent rows (an entry's layers of
  a group with memory.host_layout=entry_major), every run distinct; with
  --copies-per-call 3 each call is one program of three copies. The rows moved are still
  checked bit for bit."""
  idx = fetch.host_indices(rng, 64, 32, 4)
  runs = idx.reshape(8, 4)
  assert len(set(idx.tolist())) == 32 and idx.min() >= 0 and idx.max() < 64
  assert (runs[:, 0] % 4 == 0).all() and (np.diff(runs, axis=1) == 1).all()
  out = tmp_path / "fetch.json"
  rc = fetch.main(["--quick", "--layouts", "fp8x656", "--impls", "pallas", "--entries",
                   "36", "--host-run", "4", "--copies-per-call", "3",
                   "--pallas-block-units", "16", "--ceilings", "jax", "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["host_run"] == 4 and result["copies_per_call"] == 3
  assert all(r["ok"] is True for r in result["rows"] if r["impl"] == "pallas")
  # --fresh-rows: each of the three copies moves its own 36 host rows (fetch keeps the
  # last list's rows, evict writes every list's), still checked bit for bit.
  rc = fetch.main(["--quick", "--layouts", "fp8x656", "--impls", "pallas,xla", "--entries",
                   "36", "--host-run", "4", "--copies-per-call", "3", "--fresh-rows",
                   "--list-factor", "2", "--pallas-block-units", "16", "--ceilings", "jax",
                   "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["fresh_rows"] is True
  kernels = [r for r in result["rows"] if not r["impl"].startswith("contiguous")]
  assert len(kernels) == 4 and all(r["ok"] is True for r in kernels)
  with pytest.raises(ValueError, match=r"--device-rows=10: expected at least the largest"):
    fetch.main(["--quick", "--entries", "36", "--device-rows", "10"])
  with pytest.raises(ValueError, match=r"--host-rows=100: 3 lists of 36 distinct rows"):
    fetch.main(["--quick", "--entries", "36", "--copies-per-call", "3", "--fresh-rows",
                "--host-rows", "100"])
  with pytest.raises(ValueError, match=r"--entries \[37\]: with --host-run=4"):
    fetch.main(["--quick", "--entries", "37", "--host-run", "4"])
  with pytest.raises(ValueError, match=r"--host-run=0: expected >= 1"):
    fetch.main(["--quick", "--host-run", "0"])
  with pytest.raises(ValueError, match=r"--copies-per-call=0: expected >= 1"):
    fetch.main(["--quick", "--copies-per-call", "0"])


def test_fetch_benchmark_without_checks_fills_the_host_pool_in_place(tmp_path):
  """--no-check: the host pool (and a --device-rows device pool) is filled where it
  lives, with no copy of it in this process's memory, so serving-sized pools fit; every
  copy still runs and is timed, and nothing claims to be checked."""
  for sharding, kind in zip(fetch._shardings(), ("pinned_host", "device")):
    pool = fetch._filled_pool(sharding, (5, 656), np.uint8)
    assert pool.sharding.memory_kind == kind
    assert (np.asarray(pool) == 0x5A).all()
  out = tmp_path / "fetch.json"
  rc = fetch.main(["--quick", "--no-check", "--layouts", "fp8x656,bf16x576", "--impls",
                   "pallas,xla", "--entries", "12", "--host-rows", "700",
                   "--device-rows", "500", "--reps", "1", "--max-iters", "1",
                   "--pallas-block-units", "16", "--ceilings", "jax", "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["host_rows"] == 700 and result["device_rows"] == 500
  kernels = [r for r in result["rows"] if not r["impl"].startswith("contiguous")]
  assert len(kernels) == 8
  assert all(r["error"] is None and r["ok"] is None and r["seconds"] > 0 for r in kernels)


@pytest.mark.parametrize("direction", ["fetch", "evict"])
def test_fetch_benchmark_check_catches_a_copy_that_moves_nothing(direction, rng):
  """Every check first changes what the call must overwrite, so an implementation that
  returns its destination untouched fails even after another one moved the same rows."""
  host_s, dev_s = fetch._shardings()
  Sh, Sd, N, W = 40, 20, 7, 16
  mirror = {"host": rng.integers(0, 256, (Sh, W), dtype=np.uint8),
            "dev": rng.integers(0, 256, (Sd, W), dtype=np.uint8)}
  pools = {"host": jax.device_put(mirror["host"], host_s),
           "dev": jax.device_put(mirror["dev"], dev_s)}
  h_idx = rng.choice(Sh, N, replace=False).astype(np.int32)
  d_idx = rng.choice(Sd, N, replace=False).astype(np.int32)
  hi, di = jax.device_put(h_idx, dev_s), jax.device_put(d_idx, dev_s)
  if direction == "fetch":
    args_of = lambda s: (pools["host"], hi, s, di)
  else:
    args_of = lambda s: (pools["dev"], di, s, hi)
  real = jax.jit(functools.partial(fetch_rows if direction == "fetch" else evict_rows,
                                   impl="xla"))
  nothing = lambda *args: args[2]
  for _ in range(2):  # the second real copy moves rows the first one already moved
    assert fetch._check(direction, real, args_of, pools, mirror, h_idx, d_idx, dev_s)
  assert not fetch._check(direction, nothing, args_of, pools, mirror, h_idx, d_idx, dev_s)


@pytest.mark.parametrize("kind", ["pinned_host", "device"])
def test_rows_are_read_without_holding_the_pool(kind, rng):
  """``rows_of`` reads rows through a temporary, so the pool can still be donated."""
  host_s, dev_s = fetch._shardings()
  data = rng.integers(0, 256, (12, 8), dtype=np.uint8)
  pool = jax.device_put(data, host_s if kind == "pinned_host" else dev_s)
  np.testing.assert_array_equal(fetch.rows_of(pool, np.array([3, 0, 11]), dev_s),
                                data[[3, 0, 11]])
  i = jax.device_put(np.array([0], np.int32), dev_s)
  if kind == "pinned_host":
    out = jax.jit(functools.partial(evict_rows, impl="xla"), donate_argnums=2)(
        jax.device_put(data[:1] + 1, dev_s), i, pool, i)
  else:
    out = jax.jit(functools.partial(fetch_rows, impl="xla"), donate_argnums=2)(
        jax.device_put(data[:1] + 1, host_s), i, pool, i)
  jax.block_until_ready(out)
  assert pool.is_deleted()
  np.testing.assert_array_equal(fetch.rows_of(out, np.array([0, 1]), dev_s),
                                np.stack([data[0] + 1, data[1]]))


def test_attention_benchmark_reports_read_rate_against_a_device_copy(tmp_path, capsys):
  out = tmp_path / "attention.json"
  rc = attention.main(["--quick", "--configs", "auto,h16k16s2n3", "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["geometry"] == {"heads": 4, "k": 40, "latent": 32, "rope": 16,
                                "pool_rows": 256, "dtype": "bfloat16", "kv_layout": "bf16"}
  assert (result["loop"], result["reps"]) == (2, 2)
  rows = result["rows"]
  assert [(r["batch"], r["impl"]) for r in rows] == [
      (b, impl) for b in (1, 3)
      for impl in ("device copy", "xla", "pallas[auto]", "pallas[h16k16s2n3]")]
  for r in rows:
    assert r["error"] is None and r["reps"] == 2  # the loop always lasts the same
    # k rows of 48 bf16 values and the queries of every request
    assert r["bytes_read"] == r["batch"] * (40 * 96 + 4 * 48 * 2)
    assert r["read_gbps"] == pytest.approx(r["bytes_read"] / r["seconds"] / 1e9)
    assert r["fraction"] == pytest.approx(r["read_gbps"] / r["copy_gbps"])
    if r["impl"] == "device copy":
      assert r["fraction"] == pytest.approx(0.5)  # a copy reads half of its traffic
    else:
      assert r["max_err"] < 2e-2
  split = [r for r in rows if r["impl"] == "pallas[h16k16s2n3]"]
  assert [(r["block_h"], r["splits"], r["programs"]) for r in split] == [(16, 2, 2), (16, 2, 6)]
  assert all(r["partial_bytes"] == 2 * r["batch"] * 2 * 4 * 33 * 4 for r in split)
  assert "sparse MLA decode attention" in capsys.readouterr().out


def test_attention_benchmark_reads_fp8_rows(tmp_path, capsys):
  """--kv-layout fp8: the pool holds 164-byte fp8 rows (latent 128 + 4 + 2 x 16); xla
  and pallas read them, within the fp8 kernel's tolerance of the reference."""
  out = tmp_path / "attention.json"
  rc = attention.main(["--quick", "--kv-layout", "fp8", "--latent", "128", "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["geometry"]["kv_layout"] == "fp8"
  rows = result["rows"]
  assert [(r["batch"], r["impl"]) for r in rows] == [
      (b, impl) for b in (1, 3) for impl in ("device copy", "xla", "pallas")]
  for r in rows:
    assert r["error"] is None
    assert r["bytes_read"] == r["batch"] * (40 * 164 + 4 * 144 * 2)
    if r["impl"] != "device copy":
      assert r["max_err"] < 2e-2
  assert "fp8 rows" in capsys.readouterr().out
  with pytest.raises(ValueError, match=r"--impls='xla,mosaic' with --kv-layout='fp8': "
                     r"'mosaic' reads bf16 rows only"):
    attention.main(["--quick", "--kv-layout", "fp8", "--latent", "128", "--impls",
                    "xla,mosaic", "--out", str(out)])


def test_attention_configs_parse():
  assert attention.parse_config("auto") == AttentionConfig()
  assert attention.parse_config("h64k32w8s2n3") == AttentionConfig(
      block_h=64, block_k=32, num_warps=8, num_splits=2, num_stages=3)
  assert attention.parse_config("s1h32") == AttentionConfig(block_h=32, num_splits=1)
  for bad in ("h64x2", "64", "h", "h64 k32"):
    with pytest.raises(ValueError, match=r"--configs: .*: expected 'auto' or letters h "
                       r"\(block_h\), k \(block_k\)"):
      attention.parse_config(bad)


def test_mosaic_configs_parse():
  from ula_jax.kernels.sparse_attention.mosaic import MosaicAttentionConfig
  assert attention.parse_mosaic_config("auto") == MosaicAttentionConfig()
  assert attention.parse_mosaic_config("s1r208") == MosaicAttentionConfig(
      num_splits=1, consumer_registers=208)
  assert attention.parse_mosaic_config("r232s2") == MosaicAttentionConfig(
      num_splits=2, consumer_registers=232)
  for bad in ("x64", "s", "s2 r208", "t1p1r240"):
    with pytest.raises(ValueError, match=r"--mosaic-configs: .*: expected 'auto' or "
                       r"letters s \(num_splits\), r \(consumer_registers\)"):
      attention.parse_mosaic_config(bad)


def test_argument_lists_are_checked():
  assert parse_sizes("64, 1K,64k") == [64, 1024, 65536]
  assert parse_sizes("1M") == [1 << 20]
  with pytest.raises(ValueError, match=r"size 'X1': expected an integer, optionally with a K "
                     r"or M suffix"):
    parse_sizes("64,x1")
  with pytest.raises(ValueError, match=r"size '-3': expected >= 0"):
    parse_sizes("-3")
  with pytest.raises(ValueError, match=r"--impls='xla,cuda': unknown \['cuda'\]; expected a "
                     r"comma list of \['xla', 'pallas', 'ffi'\]"):
    parse_list("xla,cuda", fetch.IMPLS, flag="--impls")
  with pytest.raises(ValueError, match=r"--reps=0: expected >= 1"):
    fetch.main(["--quick", "--reps", "0"])
  with pytest.raises(ValueError, match=r"--loop=0, --reps=2: expected both >= 1"):
    attention.main(["--quick", "--loop", "0"])
  assert best_and_median([3.0, 1.0, 2.0]) == (1.0, 2.0)
  assert best_and_median([4.0, 1.0]) == (1.0, 2.5)
  assert best_and_median([]) == (None, None)


def test_summary_keeps_the_best_configuration_of_each_implementation(tmp_path, capsys):
  row = dict(direction="fetch", layout="bf16x576", entries=4096, ok=True, in_place=True,
             error=None, baseline_gbps=55.0, baseline="contiguous[memcpy]")
  fetch_result = {"benchmark": "fetch", "reps": 3, "rows": [
      {**row, "impl": "contiguous[jax]", "fraction": 0.96},
      {**row, "impl": "contiguous[memcpy]", "fraction": 1.0},
      {**row, "impl": "xla", "fraction": 0.21, "in_place": None},
      {**row, "impl": "pallas[u512,w4]", "fraction": 0.62},
      {**row, "impl": "pallas[u2048,w8]", "fraction": 0.87},
      {**row, "impl": "ffi", "fraction": 0.9, "in_place": False},
      {**row, "layout": "fp8x656", "impl": "pallas", "fraction": 0.8},  # no target
      {**row, "direction": "evict", "impl": "pallas", "fraction": 0.8},
      {**row, "entries": 64, "impl": "ffi", "fraction": 0.1},  # below min_entries
  ]}
  assert summary.fetch_rows(fetch_result) == [
      ["fetch", "bf16x576", "4096", "55.0 memcpy", "0.21", "0.87", "pallas[u2048,w8]",
       "0.90 copy!", "yes"],
      ["fetch", "fp8x656", "4096", "55.0 memcpy", "-", "0.80", "pallas", "-", "-"],
      ["evict", "bf16x576", "4096", "55.0 memcpy", "-", "0.80", "pallas", "-", "NO"]]
  att = dict(batch=8, bytes_read=1, seconds=1.0, read_gbps=1.0, copy_gbps=3000.0, error=None,
             block_h=None, splits=None, num_warps=None)
  launch = dict(block_h=64, splits=2, num_warps=8)
  attention_result = {"benchmark": "attention", "geometry": {"heads": 64, "k": 2048},
                      "rows": [{**att, "impl": "device copy", "fraction": 0.5, "max_err": None},
                               {**att, "impl": "xla", "fraction": 0.3, "max_err": 0.0},
                               {**att, **launch, "impl": "pallas[h64]", "fraction": 0.7,
                                "max_err": 0.01},
                               {**att, "impl": "pallas[h32]", "fraction": None,
                                "max_err": None, "error": "boom"},
                               {**att, **launch, "batch": 64, "impl": "pallas[h64]",
                                "fraction": 0.45, "max_err": 0.01}]}
  assert summary.attention_rows(attention_result) == [
      ["8", "3000", "0.30 (err 0.0000)", "0.70 (err 0.0100)", "pallas[h64]", "h64 s2 w8", "yes"],
      ["64", "3000", "-", "0.45 (err 0.0100)", "pallas[h64]", "h64 s2 w8", "NO"]]
  (tmp_path / "f.json").write_text(json.dumps(fetch_result))
  (tmp_path / "a.json").write_text(json.dumps(attention_result))
  assert summary.main([str(tmp_path / "f.json"), str(tmp_path / "a.json"),
                       str(tmp_path / "none.json")]) == 0
  out = capsys.readouterr().out
  assert "fraction of a contiguous copy" in out and "none.json: missing" in out
  assert "pallas[h64]" in out  # labels with brackets are printed, not read as markup


def test_environment_records_xla_flags_where_set(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert "xla_flags" not in environment()
  monkeypatch.setenv("XLA_FLAGS", " --xla_gpu_enable_command_buffer=+CONDITIONAL ")
  env = environment()
  assert env["xla_flags"] == "--xla_gpu_enable_command_buffer=+CONDITIONAL"
  assert {"backend", "device", "jax", "python", "date"} <= set(env)


def test_fetch_between_probe_copies_after_each_gather(tmp_path, rng):
  """gpu_fetch_between.py: each round gathers device-pool rows, then copies its own host
  rows: a fetch into the device pool (the gather's maximum written to its first row
  before), an evict from the staged rows (the maximum written to one of them before);
  the gathers-only programs copy nothing, and no program copies a pool. Its CPU smoke run
  writes its table's JSON."""
  between = load_probe("gpu_fetch_between")
  host_s, dev_s = fetch._shardings()
  C, N, G, Sh, Sd, W = 3, 8, 5, 64, 40, between.W
  host_np = rng.integers(0, 256, (Sh, W), dtype=np.uint8)
  dev_np = rng.integers(0, 256, (Sd, W), dtype=np.uint8)
  staged_np = rng.integers(0, 256, (N, W), dtype=np.uint8)
  hidx = fetch.host_indices(rng, Sh, C * N, 4).reshape(C, N)
  didx = np.stack([rng.choice(Sd, N, replace=False) for _ in range(C)]).astype(np.int32)
  gidx = rng.integers(0, Sd, (C, G), dtype=np.int32)
  lists = tuple(jax.device_put(x, dev_s) for x in (hidx, didx, gidx))

  def pools():
    return (jax.device_put(dev_np, dev_s), jax.device_put(host_np, host_s),
            jax.device_put(staged_np, dev_s))

  for direction in ("fetch", "evict"):
    for with_copy in (True, False):
      dev, host, staged = dev_np.copy(), host_np.copy(), staged_np.copy()
      for c in range(C):
        top = dev[gidx[c]].max(axis=0)
        if direction == "fetch":
          dev[gidx[c, 0]] = top
        else:
          staged[c % N] = top
        if with_copy and direction == "fetch":
          dev[didx[c]] = host[hidx[c]]
        elif with_copy:
          host[hidx[c]] = staged
      got = between.program(C, G, with_copy, direction)(pools(), *lists)
      for g, w in zip(got, (dev, host, staged)):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{direction} {with_copy}")
  out = tmp_path / "between.json"
  assert between.main(["--quick", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert [(r["direction"], r["gather_rows"]) for r in result["results"]] == [
      ("fetch", 0), ("fetch", 100), ("evict", 0), ("evict", 100)]
  assert all(len(r["times"]["program"]) == 2 for r in result["results"])
  assert all(r["in_place"] for r in result["results"])
  with pytest.raises(ValueError, match=r"--directions='fetch,stage': expected"):
    between.main(["--quick", "--directions", "fetch,stage"])


def test_layer_weights_probe_forms_compute_the_same_pass(tmp_path):
  """gpu_layer_weights.py: the layer stack run as the engine runs it (scans over stacked
  parameters) and unrolled (static slices) give the same hidden states and the same
  indexer and projection sums; its CPU smoke run writes its JSON."""
  lw = load_probe("gpu_layer_weights")
  cfg = lw.model_config(6, quick=True)  # a mixed first group (dense, MoE), then MoE ones
  model = lw.Transformer(cfg)
  x = jax.random.normal(jax.random.key(1), (5, cfg.hidden_size), jnp.float32)
  pos = jnp.arange(5, dtype=jnp.int32) + 7
  ys, accs = jax.jit(lw.scan_forward)(model, x, pos)
  yu, accu = jax.jit(lw.unrolled_forward)(model, x, pos)
  assert float(jnp.abs(ys - x).max()) > 1e-3  # the layers changed the hidden state
  np.testing.assert_allclose(np.asarray(ys), np.asarray(yu), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(float(accs), float(accu), rtol=2e-5)
  out = tmp_path / "lw.json"
  assert lw.main(["--quick", "--layers", "4", "--reps", "1", "--json", str(out)]) == 0
  row = json.loads(out.read_text())["row"]
  assert (row["form"], row["layers"], row["rows"]) == ("scan", 4, 64)
  glm5 = lw.model_config(16, quick=False)  # the GLM-5 experiment's model, 16 layers
  assert (glm5.preset, glm5.num_layers, glm5.hidden_size, glm5.moe_intermediate_size) == (
      "glm5", 16, 1024, 256)
  assert row["call_s"] > 0 and row["layer_weight_bytes"] > 0


def test_layer_weights_ops_table_sums_by_hlo_op(tmp_path):
  """gpu_layer_weights.py --ops: the device operations summed by (name, HLO op), and the
  copies' trace arguments."""
  import gzip
  lw = load_probe("gpu_layer_weights")
  gpu = 2
  meta = [{"ph": "M", "pid": gpu, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": gpu, "tid": 7, "name": "thread_name",
           "args": {"name": "Stream #7(Compute)"}}]

  def op(ts, dur, name, hlo):
    return {"ph": "X", "pid": gpu, "tid": 7, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": hlo}}

  events = meta + [op(0, 2, "memcpy32_post", "dynamic-slice.4"),
                   op(5, 3, "memcpy32_post", "dynamic-slice.4"),
                   op(10, 1, "memcpy32_post", "dynamic-slice.9"),
                   op(20, 50, "ula_stacked_matmul", "custom-call.1")]
  d = tmp_path / "trace" / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  lw.write_ops(str(tmp_path / "trace"), str(tmp_path / "ops.json"))
  ops = json.loads((tmp_path / "ops.json").read_text())
  assert ops["by_op"] == [["ula_stacked_matmul", "custom-call.1", 1, 50],
                          ["memcpy32_post", "dynamic-slice.4", 2, 5],
                          ["memcpy32_post", "dynamic-slice.9", 1, 1]]
  assert ops["copy_args"] == [{"hlo_op": "dynamic-slice.4"}] * 2 + [
      {"hlo_op": "dynamic-slice.9"}]


def test_stacked_matmul_probe_runs_both_products(tmp_path, monkeypatch):
  """gpu_stacked_matmul.py's CPU smoke run: XLA's product and the kernel's
  (``kernels.stacked_matmul``) for each shape, equal, in its JSON."""
  sm = load_probe("gpu_stacked_matmul")
  out = tmp_path / "sm.json"
  assert sm.main(["--quick", "--layers", "2", "--rows", "16", "--reps", "1", "--json",
                  str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["weight"], r["impl"]) for r in rows] == [
      ("a", "xla"), ("a", "pallas"), ("b", "xla"), ("b", "pallas")]
  assert all(r["max_rel_err"] < 1e-2 for r in rows if r["impl"] == "pallas")
  assert rows[3]["transposed"] and rows[3]["splits"] == 2
  # A launch that fails (here every Pallas one) is recorded and the sweep goes on.
  def refuse(*a, **k):
    raise RuntimeError("out of shared memory\nmore")

  monkeypatch.setattr(sm, "stacked_matmul_pallas", refuse)
  assert sm.main(["--quick", "--layers", "2", "--rows", "16", "--reps", "1", "--json",
                  str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["weight"], r["impl"], r.get("failed")) for r in rows] == [
      ("a", "xla", None), ("a", "pallas", "RuntimeError: out of shared memory"),
      ("b", "xla", None), ("b", "pallas", "RuntimeError: out of shared memory")]
  c = sm.parse_configs("64,128,4,3,264; 128,64,8,4,132,0.25;")
  assert [(x.block_k, x.block_n, x.num_warps, x.num_stages, x.programs, x.max_partials)
          for x in c] == [(64, 128, 4, 3, 264, None), (128, 64, 8, 4, 132, 0.25)]
  assert [sm.tag(x) for x in c] == ["64,128,4,3,264", "128,64,8,4,132,0.25"]


def test_device_copy_rate_is_the_copys_read_and_write_traffic(monkeypatch):
  """Two bytes of traffic (one read, one written) per byte copied, over the seconds
  ``time_calls`` measures for the copy of that many bytes."""
  from ula_jax.bench import common
  seen = {}

  def fake_time_calls(step, state, **kw):
    seen["bytes"] = state.nbytes
    return 0.5, step(state)

  monkeypatch.setattr(common, "time_calls", fake_time_calls)
  assert device_copy_rate(4096) == 2 * 4096 / 0.5
  assert seen["bytes"] == 4096
