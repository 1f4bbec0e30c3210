"""The multi-device benchmarks end to end at toy sizes on simulated CPU devices:
``tp_link`` (TP miss delivery against the device link) and ``serving`` (capacity and
throughput of every system at equal budgets)."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from ula_jax.bench import serving, tp_link
from tests.engine_util import DENSE

CONTEXT, PAGE = 512, 64


def test_tp_link_delivers_exact_rows_and_rates_against_the_copy(tmp_path, capsys):
  out = tmp_path / "tp_link.json"
  assert tp_link.main(["--quick", "--devices", "2", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["ranks"] == 2 and result["row_bytes"] == 40 * 2
  rows = result["rows"]
  assert {(r["entries"], r["impl"]) for r in rows} == {
      (n, i) for n in (64, 256) for i in tp_link.IMPLS}
  for r in rows:
    assert r["error"] is None and r["reps"] == 2
    assert r["seconds"] > 0 and r["link_gbps"] > 0
    # Half the misses are owned by the other rank: the bytes that cross.
    want = r["entries"] * 80 if r["impl"] in tp_link.LINKS else r["entries"] // 2 * 80
    assert r["useful_bytes"] == want
    assert r["fraction"] == pytest.approx(r["gbps"] / r["link_gbps"])
  for n in (64, 256):  # the link rate is the faster of the two one-way copies
    links = [r["gbps"] for r in rows if r["entries"] == n and r["impl"] in tp_link.LINKS]
    assert {r["link_gbps"] for r in rows if r["entries"] == n} == {max(links)}
    assert r["ok"] is (True if r["impl"] == "deliver" else None)
  assert "TP miss delivery over 2" in capsys.readouterr().out


def test_tp_link_rejects_a_single_device(tmp_path):
  with pytest.raises(SystemExit):
    tp_link.main(["--quick", "--devices", "1", "--out", str(tmp_path / "x.json")])


def _args(**kw) -> argparse.Namespace:
  base = dict(config=serving.DEFAULT_CONFIG, overrides=["model=tiny", "mesh.platform=cpu"],
              context=CONTEXT, max_rows=16, device_budget="1024", host_budget="2048")
  base.update(kw)
  return argparse.Namespace(**base)


def test_capacity_at_equal_budgets_follows_each_systems_layout():
  args = _args()
  caps = {name: serving.capacity(args, serving.setup(
      name, 2, device_budget="1024", host_budget="2048", hisparse_buffer=16))
          for name in serving.SYSTEMS}
  need = CONTEXT // PAGE
  # resident: 1024 device tokens per device; TP keeps a copy on each of the 2 ranks.
  assert caps["resident_tp"]["requests"] == 1024 // CONTEXT
  assert caps["resident_dp"]["requests"] == 2 * (1024 // CONTEXT)
  # hisparse: every entry in the (replicated) host pool of 2048 tokens.
  assert caps["hisparse"]["requests"] == 2048 // CONTEXT
  # ula DP: each device's device + host pools.
  assert caps["ula_dp"]["requests"] == 2 * ((1024 + 2048) // CONTEXT)
  assert caps["ula_dp"]["tokens_per_rank"] == 1024 + 2048
  # ula TP: both ranks' pools less the local buffers (one step's entries per row), one
  # logical space: more than DP's half and less than the whole of both devices.
  tp = caps["ula_tp"]
  assert tp["requests"] == tp["tokens_per_rank"] // PAGE // need
  assert caps["resident_tp"]["requests"] * 4 < tp["requests"] < 2 * (1024 + 2048) // CONTEXT
  assert all(c["limit"] == "memory" for c in caps.values())


def test_serving_measures_each_batch_up_to_capacity_then_merges(tmp_path, capsys, caplog):
  caplog.set_level(logging.INFO, logger="ula_jax.bench.serving")  # --log-level info
  out = tmp_path / "dp"
  rc = serving.main(["--systems", "resident_dp,ula_dp", "--devices", "2", "--context", "512",
                     "--device-budget", "1024", "--host-budget", "1024", "--batches", "4",
                     "--max-rows", "8", "--decode-steps", "2", "--out", str(out),
                     "model=tiny", *DENSE, "mesh.platform=cpu"])
  assert rc == 0
  result = json.loads((out / "serving.json").read_text())
  res, ula = result["systems"]["resident_dp"], result["systems"]["ula_dp"]
  assert res["capacity"]["requests"] == 4 and ula["capacity"]["requests"] == 8
  assert [p["batch"] for p in res["points"]] == [4]
  assert [p["batch"] for p in ula["points"]] == [4, 8]
  for p in res["points"] + ula["points"]:
    assert p["peak_admitted"] == p["batch"]
    assert p["steps"] >= 2 and p["tokens_per_s"] == pytest.approx(p["batch"] / p["median_step_s"])
    assert p["prompt"] + p["output"] == CONTEXT
  assert [(r["system"], r["reference"], r["batch"]) for r in result["ratios"]] == [
      ("ula_dp", "resident_dp", 4)]
  assert (out / "serving.png").stat().st_size > 0
  printed = capsys.readouterr().out
  assert "same-batch step time" in printed and "capacity and peak" in printed
  # At info level each system's capacity and each point's engine steps are logged as
  # they happen, so a run stopped by a time limit still shows where its time went.
  logged = [r.getMessage() for r in caplog.records]
  assert "ula_dp: capacity 8 requests of 512 tokens (memory)" in logged
  steps = [m for m in logged if m.startswith("ula_dp batch 8: step ")]
  assert steps and all(" s in" in m for m in steps)
  assert any(m.startswith("ula_dp batch 8: engine ready in ") for m in logged)
  # Parts run separately combine into one table and plot.
  half = dict(result, systems={"resident_dp": res})
  other = dict(result, systems={"ula_dp": ula})
  (tmp_path / "a.json").write_text(json.dumps(half))
  (tmp_path / "b.json").write_text(json.dumps(other))
  merged = tmp_path / "merged"
  assert serving.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(merged)]) == 0
  both = json.loads((merged / "serving.json").read_text())
  assert set(both["systems"]) == {"resident_dp", "ula_dp"}
  assert both["ratios"] == result["ratios"]
  # FILE:systems takes only those; a system's points combine by batch, later files win.
  first = dict(ula, points=[dict(ula["points"][0], median_step_s=1.0),
                            dict(ula["points"][1], batch=6)])
  (tmp_path / "d.json").write_text(json.dumps(dict(result, systems={"ula_dp": first})))
  assert serving.main(["--merge", f"{tmp_path / 'a.json'}:resident_dp", str(tmp_path / "d.json"),
                       str(tmp_path / "b.json"), "--out", str(merged)]) == 0
  both = json.loads((merged / "serving.json").read_text())
  assert [p["batch"] for p in both["systems"]["ula_dp"]["points"]] == [4, 6, 8]
  assert both["systems"]["ula_dp"]["points"][0] == ula["points"][0]
  with pytest.raises(SystemExit):
    serving.main(["--merge", f"{tmp_path / 'a.json'}:ula_dp", "--out", str(merged)])
  bad = dict(other, context=1024)
  (tmp_path / "c.json").write_text(json.dumps(bad))
  with pytest.raises(SystemExit):
    serving.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "c.json"),
                  "--out", str(merged)])


def test_serving_arguments_are_checked(tmp_path):
  with pytest.raises(SystemExit):
    serving.main(["--systems", "resident,ula", "--out", str(tmp_path)])


def test_a_memory_override_reaches_only_the_systems_that_read_it():
  """memory.host_layout (ula's) and memory.hisparse.* (hisparse's) in one override list:
  each system's config gets the fields it reads and none it would refuse."""
  args = _args(overrides=["model=tiny", "mesh.platform=cpu", "memory.host_layout=entry_major",
                          "memory.hisparse.device_buffer_size=32", "memory.policy=lru"])
  cfgs = {name: serving._load(args, serving.setup(
      name, 2, device_budget="1024", host_budget="2048", hisparse_buffer=16), rows=1)
          for name in ("resident_dp", "hisparse", "ula_dp")}
  assert cfgs["ula_dp"].memory.host_layout == "entry_major"
  assert cfgs["ula_dp"].memory.policy == "lru"
  assert cfgs["resident_dp"].memory.system == "resident"
  # The setup's own buffer size comes after the user's and wins.
  assert cfgs["hisparse"].memory.hisparse.device_buffer_size == 16
  assert serving.overrides_for(None, args.overrides) == ["model=tiny", "mesh.platform=cpu"]
  assert serving.overrides_for("hisparse", ["memory.host_pool=9", "memory.system=x"]) == [
      "memory.host_pool=9", "memory.system=x"]
