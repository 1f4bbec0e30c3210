"""The resolve benchmark runs end to end at tiny sizes, writes what it prints, and checks
the issue's targets on its rows."""

from __future__ import annotations

import json
import types

import pytest

from ula_jax.bench import resolve
from ula_jax.memory.ula.resolve.pallas import FUSED_CONFIG, ResolveConfig


def test_resolve_benchmark_at_tiny_sizes(tmp_path, capsys):
  out = tmp_path / "resolve.json"
  rc = resolve.main(["--quick", "--batch", "2", "--pools", "64,32", "--policies", "pb_lru",
                     "--pallas-fuse", "on,off", "--profile", str(tmp_path / "traces"),
                     "--out", str(out)])
  assert rc == 0
  result = json.loads(out.read_text())
  assert result["benchmark"] == "resolve" and result["stream"]["k"] == 16
  assert result["stream"]["loop"] == "while"
  # The profiled segment left a trace per measured row (a CPU trace has no device lines).
  assert len(list((tmp_path / "traces").glob("*/**/perfetto_trace.json.gz"))) == 3
  rows = {(r["pool"], r["impl"]): r for r in result["rows"]}
  impls = ("jnp", "pallas", "pallas[fused]")
  assert sorted(rows) == sorted((p, i) for p in (32, 64) for i in impls)
  for impl in impls:
    # 2 * 17 entries per step do not fit a 32-slot pool
    assert rows[(32, impl)]["error"] == ("skipped: a 32-slot pool holds less than one "
                                         "step (34 entries)")
    r = rows[(64, impl)]
    assert r["error"] is None and r["us"] > 0 and r["resolves"] == 2
    assert len(r["segments_us"]) == 1
    # The device pool is full: every entry placed (the misses and one new token per
    # request) evicts one; every miss is fetched.
    assert r["evictions"] == r["placed"] == r["misses"] + 2
    assert r["fetches"] == r["misses"]
    assert r["work"]["M"] == 2 * 16 + 2
  # Both implementations resolve the same stream to the same arrays: the same counts.
  count = lambda r: (r["hits"], r["misses"], r["evictions"], r["fetches"])
  assert count(rows[(64, "jnp")]) == count(rows[(64, "pallas")])
  assert count(rows[(64, "jnp")]) == count(rows[(64, "pallas[fused]")])
  assert rows[(64, "pallas[fused]")]["fused"] and not rows[(64, "pallas")]["fused"]
  # --quick's blocks replace both launch forms' own (interpreted: one program)
  assert rows[(64, "pallas[fused]")]["config"] == dict(block_elems=32, block_place=16,
                                                       num_warps=4, fuse=True, per_sm=None)
  assert rows[(64, "jnp")]["config"] is None
  assert rows[(64, "pallas[fused]")]["work"]["launches"] == "1 + fill"
  assert rows[(64, "pallas")]["work"]["launches"] == 5
  assert rows[(64, "pallas")]["kernels"] == [] and rows[(64, "pallas")]["device_us"] is None
  assert rows[(64, "pallas")]["launches"] == {}  # no device lines on a CPU backend
  # The profiled resolves: new steps after the timed ones (--quick: one segment of 2,
  # after an untimed one).
  profiled = rows[(64, "pallas")]["profiled"]
  assert profiled["resolves"] == 2 and profiled["misses"] >= 0
  assert profiled["evictions"] == profiled["misses"] + 2
  # As straight-line code with a cache-clearing pass between resolves: the same stream,
  # the same counts.
  rc = resolve.main(["--quick", "--batch", "2", "--pools", "64", "--policies", "pb_lru",
                     "--impls", "jnp", "--loop", "unrolled", "--flush-mb", "1", "--out",
                     str(out)])
  result = json.loads(out.read_text())
  assert rc == 0 and result["stream"]["loop"] == "unrolled"
  assert result["stream"]["flush_mb"] == 1
  assert count(result["rows"][0]) == count(rows[(64, "jnp")])
  assert "resolve of one layer group on" in capsys.readouterr().out
  with pytest.raises(ValueError, match="--flush-mb=-1"):
    resolve.main(["--quick", "--flush-mb", "-1", "--out", str(out)])


def _row(pool, batch, policy, impl, us):
  return resolve.Row(pool=pool, batch=batch, policy=policy, impl=impl, k=2048, us=us,
                     fused=impl == "pallas" and policy == "pb_lru")


def test_targets_from_rows():
  rows = [_row(1 << 20, 64, "pb_lru", "pallas", 40.0), _row(1 << 20, 64, "lru", "pallas", 100.0),
          _row(1 << 20, 64, "pb_lru", "jnp", 300.0), _row(1 << 20, 64, "lru", "jnp", 360.0),
          _row(1 << 20, 8, "pb_lru", "jnp", 10.0), _row(1 << 20, 8, "lru", "jnp", 100.0)]
  got = {(t["target"], t["impl"], t.get("policy")): (t["value"], t["met"])
         for t in resolve.targets(rows, 2048)}
  # Profiled, the fused resolve is judged by its kernel's device time.
  rows[0].kernel_us = 45.0
  fused = [t for t in resolve.targets(rows, 2048) if t["target"].startswith("fused")]
  assert [(t["value"], t["measure"], t["met"]) for t in fused] == [(45.0, "kernel", True)]
  rows[0].kernel_us = None
  assert got == {
      ("pb_lru >= 1.5x faster than lru", "jnp", None): (1.2, False),
      ("pb_lru >= 1.5x faster than lru", "pallas", None): (2.5, True),
      ("fused resolve <= 50 us", "pallas", "pb_lru"): (40.0, True),
  }  # batch 8 is below the speedup target's batch 32; exact LRU is never one launch
  assert resolve.targets(rows, 1024) == [t for t in resolve.targets(rows, 2048)
                                         if "faster" in t["target"]]


def test_work_model_counts():
  system = types.SimpleNamespace(device_slots=2048, host_rows=4096, num_logical=6144,
                                 buckets=4)
  B, k = 2, 16
  M = B * k + B
  lru = resolve.work_model("jnp", "lru", system, B, k, placed=5.0)
  assert lru["ranked"] == M + 2048  # the argsort of M addresses, top_k over every slot
  pb = resolve.work_model("pallas", "pb_lru", system, B, k, placed=5.0)
  assert pb["ranked"] == 0 and pb["launches"] == 5
  assert resolve.work_model("pallas", "pb_lru", system, B, k, 5.0, fused=True)["launches"] \
      == "1 + fill"
  # 5 placed entries each read 32 counts per level: address (6144 bits: 3 levels, 2 of
  # siblings), device (2048 bits: 2 levels), host (4096 bits: 2 levels)
  assert pb["pyramid_reads"] == 5 * 32 * (2 + 2 + 2)
  for w in (lru, pb):
    assert w["bytes"] == 4 * (w["table_lookups"] + w["bitmap_words"] + w["pyramid_reads"]
                              + w["ranked"] + w["scratch_words"]) + 5 * M


def test_pallas_launch_forms():
  """``--pallas-fuse`` picks the launch forms ``kernels.resolve`` runs; the sweep flags
  replace their fields, and the fused launch keeps three programs per SM only with
  ``FUSED_CONFIG``'s own blocks (or when asked)."""
  parse = lambda *argv: resolve._pallas_configs(resolve._parser().parse_args(list(argv)))
  assert parse() == [("pallas", ResolveConfig())]
  assert parse("--pallas-fuse", "off,on") == [("pallas", ResolveConfig()),
                                              ("pallas[fused]", FUSED_CONFIG)]
  swept = dict(parse("--pallas-fuse", "on", "--pallas-block-elems", "128,256"))
  assert swept["pallas[e128,p8,w4,fused]"] == FUSED_CONFIG
  assert swept["pallas[e256,p8,w4,fused]"] == ResolveConfig(fuse=True, block_elems=256,
                                                            block_place=8)
  (_, config), = parse("--pallas-fuse", "on", "--pallas-block-elems", "256",
                       "--pallas-per-sm", "2")
  assert (config.block_elems, config.per_sm, config.fuse) == (256, 2, True)
  with pytest.raises(ValueError, match=r"--pallas-fuse='maybe'"):
    parse("--pallas-fuse", "maybe")


def test_summary_columns_per_launch_form(capsys):
  rows = [dict(pool=64, batch=2, policy=p, impl=i, us=us) for p, i, us in (
      ("pb_lru", "jnp", 30.0), ("lru", "jnp", 60.0), ("pb_lru", "pallas", 10.0),
      ("lru", "pallas", 20.0), ("pb_lru", "pallas[e128,p8,w4,fused]", 8.0),
      ("pb_lru", "pallas[e256,p8,w4,fused]", 9.0))]
  assert [resolve._form(r["impl"]) for r in rows[2:]] == ["pallas", "pallas",
                                                           "pallas_fused", "pallas_fused"]
  resolve.print_summary({"rows": rows, "stream": {"k": 16}, "targets": []})
  out = capsys.readouterr().out
  assert "pallas_fused pb_lru" in out and "8.0" in out and "9.0" not in out


def test_unknown_implementation_flag():
  with pytest.raises(ValueError, match=r"--impls='jnp,cuda': unknown \['cuda'\]; expected a "
                     r"comma list of \['jnp', 'pallas'\]"):
    resolve.main(["--quick", "--impls", "jnp,cuda"])


def test_pool_sizes_accept_k_and_m():
  assert resolve.parse_pools("64K, 1M,300") == [65536, 1 << 20, 300]
  with pytest.raises(ValueError, match=r"--pools: size '2G': expected an integer, "
                     r"optionally with a K or M suffix \(e.g. 64,1K,1M\)"):
    resolve.parse_pools("64K,2G")
  with pytest.raises(ValueError, match=r"--pools: size '0': expected >= 1 slot"):
    resolve.parse_pools("0")
