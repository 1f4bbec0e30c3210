"""The kernel benchmarks run end to end at tiny sizes and write what they print."""

from __future__ import annotations

import json

import pytest

from ula_jax.bench import attention, fetch, summary
from ula_jax.bench.common import parse_list, parse_sizes


def test_fetch_benchmark_covers_every_implementation(tmp_path, capsys):
  out = tmp_path / "fetch.json"
  rc = fetch.main(["--quick", "--layouts", "fp8x656", "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  rows = result["rows"]
  impls = {r["impl"] for r in rows}
  assert impls == {"contiguous copy", "xla", "pallas", "ffi"}, result["skipped"]
  assert {(r["direction"], r["entries"]) for r in rows} == {
      (d, n) for d in ("fetch", "evict") for n in (0, 1, 300)}
  for r in rows:
    assert r["error"] is None
    assert r["seconds"] > 0
    if r["impl"] != "contiguous copy":
      assert r["ok"] is True  # bit-exact rows
    if r["entries"]:
      assert r["gbps"] > 0 and r["fraction"] > 0
      assert r["gbps"] == pytest.approx(r["entries"] * 656 / r["seconds"] / 1e9)
  assert all(r["in_place"] is None for r in rows if r["impl"] in ("xla", "contiguous copy"))
  assert "row fetch/evict on" in capsys.readouterr().out


def test_fetch_benchmark_sweeps_pallas_configurations(tmp_path):
  out = tmp_path / "fetch.json"
  rc = fetch.main(["--quick", "--layouts", "bf16x576", "--impls", "pallas", "--directions",
                   "fetch", "--entries", "37", "--pallas-block-units", "64,256",
                   "--out", str(out)])
  assert rc == 0
  impls = [r["impl"] for r in json.loads(out.read_text())["rows"]]
  assert impls == ["contiguous copy", "pallas[u64,w4]", "pallas[u256,w4]"]


def test_attention_benchmark_reports_read_rate_against_a_device_copy(tmp_path, capsys):
  out = tmp_path / "attention.json"
  rc = attention.main(["--quick", "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["geometry"] == {"heads": 4, "k": 40, "latent": 32, "rope": 16,
                                "pool_rows": 256, "dtype": "bfloat16"}
  rows = result["rows"]
  assert [(r["batch"], r["impl"]) for r in rows] == [
      (1, "xla"), (1, "pallas"), (3, "xla"), (3, "pallas")]
  for r in rows:
    assert r["error"] is None
    # k rows of 48 bf16 values, the queries and the slots of every request
    assert r["bytes_read"] == r["batch"] * (40 * 96 + 4 * 48 * 2 + 40 * 4)
    assert r["read_gbps"] == pytest.approx(r["bytes_read"] / r["seconds"] / 1e9)
    assert r["fraction"] == pytest.approx(r["read_gbps"] / r["copy_gbps"])
    assert r["max_err"] < 2e-2
  assert "sparse MLA decode attention" in capsys.readouterr().out


def test_argument_lists_are_checked():
  assert parse_sizes("64, 1K,64k") == [64, 1024, 65536]
  with pytest.raises(ValueError, match=r"size 'X1': expected an integer, optionally with a K "
                     r"suffix"):
    parse_sizes("64,x1")
  with pytest.raises(ValueError, match=r"size '-3': expected >= 0"):
    parse_sizes("-3")
  with pytest.raises(ValueError, match=r"--impls='xla,cuda': unknown \['cuda'\]; expected a "
                     r"comma list of \['xla', 'pallas', 'ffi'\]"):
    parse_list("xla,cuda", fetch.IMPLS, flag="--impls")


def test_summary_keeps_the_best_configuration_of_each_implementation(tmp_path, capsys):
  row = dict(direction="fetch", layout="bf16x576", entries=4096, ok=True, in_place=True,
             error=None)
  fetch_result = {"benchmark": "fetch", "rows": [
      {**row, "impl": "contiguous copy", "fraction": 1.0, "in_place": None},
      {**row, "impl": "xla", "fraction": 0.21, "in_place": None},
      {**row, "impl": "pallas[u512,w4]", "fraction": 0.62},
      {**row, "impl": "pallas[u2048,w8]", "fraction": 0.87},
      {**row, "impl": "ffi", "fraction": 0.9, "in_place": False},
      {**row, "entries": 64, "impl": "ffi", "fraction": 0.1},  # below min_entries
  ]}
  assert summary.fetch_rows(fetch_result) == [
      ["fetch", "bf16x576", "4096", "0.21", "0.87", "pallas[u2048,w8]", "0.90 copy!"]]
  att = dict(batch=8, bytes_read=1, seconds=1.0, read_gbps=1.0, copy_gbps=1.0, error=None)
  attention_result = {"benchmark": "attention", "geometry": {"heads": 64, "k": 2048},
                      "rows": [{**att, "impl": "xla", "fraction": 0.3, "max_err": 0.0},
                               {**att, "impl": "pallas[h16]", "fraction": 0.7, "max_err": 0.01},
                               {**att, "impl": "pallas[h32]", "fraction": None,
                                "max_err": None, "error": "boom"}]}
  assert summary.attention_rows(attention_result) == [
      ["8", "0.30 (err 0.0000)", "0.70 (err 0.0100)", "pallas[h16]"]]
  (tmp_path / "f.json").write_text(json.dumps(fetch_result))
  assert summary.main([str(tmp_path / "f.json"), str(tmp_path / "none.json")]) == 0
  out = capsys.readouterr().out
  assert "fraction of a contiguous copy" in out and "none.json: missing" in out
