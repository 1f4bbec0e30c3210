"""The papers' questions as experiments (``ula-jax experiment NAME --scale cpu``): each
writes its figure, table and JSON, and its numbers obey the invariants it claims.

Every experiment runs once, at its cpu scale as shipped, into a module-wide folder;
throughput runs before latency, whose engines are throughput's (the session's
compilation cache serves them)."""

from __future__ import annotations

import json

import pytest

from ula_jax import experiments
from ula_jax.cli.main import main
from ula_jax.config import ConfigError

FILES = ("figure.png", "table.md", "results.json", "params.yaml")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
  return tmp_path_factory.mktemp("experiments")


_RESULTS: dict[str, dict] = {}


def result(name: str, out) -> dict:
  """The experiment's results.json, running it (cpu scale) the first time it is asked."""
  if name not in _RESULTS:
    outcome, run_dir = experiments.run(name, "cpu", out=out / name, progress=False,
                                       log=lambda line: None)
    for f in FILES:
      assert (run_dir / f).is_file(), f"{name}: no {f} in {run_dir}"
    assert (run_dir / "figure.png").read_bytes()[:4] == b"\x89PNG"
    res = json.loads((run_dir / "results.json").read_text())
    assert res["experiment"] == name and res["scale"] == "cpu"
    assert res["rows"] and set(res["columns"]) >= set().union(*map(set, res["rows"])) - {""}
    assert res["ok"], [c for c in res["checks"] if not c["holds"]]
    table = (run_dir / "table.md").read_text()
    assert "| " + " | ".join(res["columns"]) + " |" in table
    _RESULTS[name] = res
  return _RESULTS[name]


def anchors(res: dict) -> dict:
  return {a["what"]: a for a in res["anchor"]}


def test_capacity(out):
  res = result("capacity", out)
  fill = res["data"]["fill"]
  # Resident keeps a full copy on each of the 8 tp ranks; ula stores every entry once.
  assert fill["resident_tp"]["distinct_fraction"] == 0.125
  assert fill["ula_dp"]["distinct_fraction"] == 1.0
  assert fill["resident_dp"]["distinct_fraction"] == 1.0
  assert fill["hisparse"]["distinct_fraction"] < 0.125  # TP copies and device buffers
  cap = res["data"]["capacity"]
  for c in map(str, res["params"]["contexts"]):
    assert cap["ula_tp"][c]["requests"] > cap["resident_tp"][c]["requests"]
    assert cap["ula_dp"][c]["requests"] > cap["resident_dp"][c]["requests"]
  a = anchors(res)
  assert a["resident TP8 distinct fraction"]["ours"] == a["resident TP8 distinct fraction"][
      "anchor"] == 0.125


def test_throughput(out):
  res = result("throughput", out)
  systems = res["data"]["serving"]["systems"]
  caps = {n: e["capacity"]["requests"] for n, e in systems.items()}
  assert caps["ula_dp"] > caps["resident_dp"] and caps["ula_dp"] > caps["hisparse"]
  for name, e in systems.items():
    batches = [p["batch"] for p in e["points"]]
    assert max(batches) == caps[name]  # measured up to its capacity
    assert all(p["tokens_per_s"] > 0 for p in e["points"])
  assert "ula DP peak / HiSparse peak" in anchors(res)


def test_throughput_reuses_the_systems_of_earlier_runs(out, tmp_path):
  res = result("throughput", out)
  src = out / "throughput"
  systems = res["data"]["serving"]["systems"]

  def run(*overrides):
    _, run_dir = experiments.run("throughput", "cpu", list(overrides),
                                 out=tmp_path / str(len(list(tmp_path.iterdir()))),
                                 progress=False, log=lambda line: None)
    return json.loads((run_dir / "results.json").read_text())

  # Every system from the earlier run: the same entries, each marked with where and on
  # which machine it was measured.
  again = run(f"reuse=[{src}]")["data"]["serving"]["systems"]
  for name, e in systems.items():
    assert again[name]["reused_from"] == str(src)
    assert again[name]["reused_environment"] == res["environment"]
    assert {k: v for k, v in again[name].items() if not k.startswith("reused_")} == e
  # A system the earlier run lacks is measured; the others are taken from it.
  part = tmp_path / "part"
  part.mkdir()
  lacking = dict(res, data=dict(res["data"], serving=dict(
      res["data"]["serving"], systems={n: e for n, e in systems.items() if n != "ula_dp"})))
  (part / "results.json").write_text(json.dumps(lacking))
  # profile=true: the measured system's capacity point is served once more under the
  # profiler (a CPU trace has no device lines: wall times only), the reused ones untouched.
  mixed = run(f"reuse=[{part}]", "profile=true")["data"]["serving"]["systems"]
  assert "reused_from" not in mixed["ula_dp"]
  prof = mixed["ula_dp"]["points"][-1]["profile"]
  assert mixed["ula_dp"]["points"][-1]["batch"] == mixed["ula_dp"]["capacity"]["requests"]
  assert prof["steps"] >= 1 and prof["wall_us"] > 0 and "trace" not in prof
  assert all("profile" not in p for p in mixed["ula_dp"]["points"][:-1])
  assert mixed["ula_dp"]["capacity"] == systems["ula_dp"]["capacity"]
  assert all(mixed[n]["reused_from"] == str(part) for n in systems if n != "ula_dp")
  # Points measured with other parameters are refused, naming what differs.
  with pytest.raises(ConfigError, match=r"reuse\[0\].*context=256 there, 512 here"):
    experiments.load_params(experiments.get("throughput"), "cpu",
                            ["context=512", f"reuse=[{src}]"])
  with pytest.raises(ConfigError, match=r"reuse\[0\].*no results.json"):
    experiments.load_params(experiments.get("throughput"), "cpu", [f"reuse=[{tmp_path}]"])


def test_latency(out):
  res = result("latency", out)
  points = res["data"]["points"]
  # Batch 1: ula's device pool holds the whole request; HiSparse's 16-slot quota does not.
  assert points["ula_dp"]["1"]["full_batch_stats"]["misses"] == 0
  assert points["hisparse"]["1"]["full_batch_stats"]["misses"] > 0
  assert anchors(res)["HiSparse / GPU-only TPOT, batch 1"]["anchor"] == 1.235


def test_policies(out):
  res = result("policies", out)
  hits = res["data"]["hit_rates"]
  assert len(hits) == len(res["params"]["batches"])
  for h in hits.values():
    assert abs(h["pb_lru"]["hit_rate"] - h["lru"]["hit_rate"]) < 0.02
    assert h["lru"]["evictions"] > 0
  assert all(h[pol]["replay_s"] > 0 for h in hits.values() for pol in ("pb_lru", "lru"))
  # Ring sizes at the largest batch: a ring longer than the rounds replayed never makes
  # a slot cold, so PB-LRU's victims (oldest round first, lowest slot within it) are
  # exact LRU's (oldest stamp first, lowest slot among equals), miss for miss.
  ring, steps = res["data"]["ring_hit_rates"], res["params"]["steps"]
  lru = hits[str(max(res["params"]["batches"]))]["lru"]
  assert sorted(map(int, ring)) == sorted(res["params"]["bucket_sweep"])
  long = [h for r, h in ring.items() if int(r) > steps]
  assert long and all((h["misses"], h["evictions"]) == (lru["misses"], lru["evictions"])
                      for h in long)
  assert ring["1"]["misses"] > lru["misses"]  # one bucket: everything untouched is cold


def test_buffer_sizing(out):
  res = result("buffer_sizing", out)
  his = res["data"]["hisparse"]
  rates = [his[str(float(f))]["miss_rate"] for f in res["params"]["factors"]]
  assert rates == sorted(rates, reverse=True) and rates[-1] < rates[0]  # 4k < 2k < k
  assert all(0 <= r <= 1 for r in rates)


def test_layouts(out):
  res = result("layouts", out)
  lay = res["data"]["layouts"]
  assert lay["replicated"]["distinct_fraction"] == 0.125
  assert lay["replicated"]["xdev_bytes_per_step"] == 0
  assert lay["mod"]["storage_balance"] <= 1.01
  assert lay["request"]["storage_balance"] > lay["mod"]["storage_balance"]
  for name in ("mod", "block", "request"):
    assert lay[name]["xdev_bytes_per_step"] > 0
    assert lay[name]["tokens_per_rank"] > lay["replicated"]["tokens_per_rank"]


def test_far_tier(out):
  res = result("far_tier", out)
  fr = res["data"]["by_fraction"]
  small = fr[min(fr, key=float)]
  assert small["on_demand/cxl"]["throughput"] > small["full_prefetch/rdma"]["throughput"]
  # SAC's baseline: the same bulk prefetch, then every step's top-k from host DRAM
  staged = small["staged_prefetch/rdma"]
  assert small["on_demand/cxl"]["throughput"] > staged["throughput"]
  assert staged["tbt_s"] == small["on_demand/dram"]["tbt_s"]
  assert staged["ttft_s"] > small["full_prefetch/rdma"]["ttft_s"]
  for d in list(fr.values()) + list(res["data"]["by_context"].values()):
    assert d["on_demand/cxl"]["throughput"] <= d["on_demand/dram"]["throughput"]


def test_every_experiment_has_its_folder():
  names = [e.name for e in experiments.all_experiments()]
  assert names == list(experiments.NAMES)
  for exp in experiments.all_experiments():
    assert (exp.folder / "experiment.yaml").is_file() and (exp.folder / "README.md").is_file()
    for scale in experiments.SCALES:  # both scales validate
      experiments.load_params(exp, scale)


def test_list_and_errors(capsys, tmp_path):
  assert main(["experiment", "list"]) == 0
  listed = capsys.readouterr().out
  assert all(name in listed for name in experiments.NAMES)
  assert main(["experiment", "capacitty"]) == 2
  assert "did you mean 'capacity'" in capsys.readouterr().err
  assert main(["experiment", "capacity", "contexts=[1]", "--out", str(tmp_path / "x")]) == 2
  assert "contexts=[1]" in capsys.readouterr().err
  with pytest.raises(ConfigError, match="unknown field 'devicez'.*did you mean 'devices'"):
    experiments.load_params(experiments.get("capacity"), "cpu", ["devicez=2"])
  bad = tmp_path / "experiment.yaml"
  bad.write_text("cpu: {}\ntpu: {}\n")
  with pytest.raises(ConfigError, match="unknown section 'tpu'.*did you mean 'gpu'"):
    experiments.load_params(experiments.get("far_tier"), "cpu", path=bad)
  assert not (tmp_path / "x").exists()
