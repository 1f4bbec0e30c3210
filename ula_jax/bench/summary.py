"""A short table from the benchmarks' JSON: the best configuration of each implementation,
and whether the issue's targets are met.

    python -m ula_jax.bench.summary runs/bench/fetch.json runs/bench/attention.json

Targets: fetch and evict of 1152-B entries reach ``FETCH_TARGET`` of the contiguous copy at
>= 4K entries per call (Pallas or FFI); sparse attention reads at ``ATTENTION_TARGET`` of a
device copy's traffic (read + write), i.e. as fast as the copy reads.
"""

from __future__ import annotations

import json
import pathlib
import sys

from ula_jax.bench.common import fmt, print_table

FETCH_TARGET = 0.85
FETCH_TARGET_LAYOUT = "bf16x576"
ATTENTION_TARGET = 0.50


def _family(impl: str) -> str:
  return impl.split("[")[0]


def _best(rows: list[dict], key: str) -> dict[str, dict]:
  """family -> its row with the highest ``key`` (rows with errors only if nothing else)."""
  best: dict[str, dict] = {}
  for r in rows:
    fam = _family(r["impl"])
    cur = best.get(fam)
    if cur is None or (r[key] or -1) > (cur[key] or -1):
      best[fam] = r
  return best


def _met(value: float | None, target: float) -> str:
  return "-" if value is None else ("yes" if value >= target else "NO")


def fetch_rows(result: dict, min_entries: int = 4096) -> list[list[str]]:
  """One line per (direction, layout, entries >= min_entries): the ceiling (fastest
  contiguous copy, GB/s and how it was measured), each implementation's fraction of it
  (Pallas: its best configuration, named), and the target where one applies."""
  groups: dict[tuple, list[dict]] = {}
  for r in result["rows"]:
    if r["entries"] >= min_entries:
      groups.setdefault((r["direction"], r["layout"], r["entries"]), []).append(r)
  out = []
  for (direction, layout, n), rows in groups.items():
    g = _best(rows, "fraction")
    cell = lambda fam: ("-" if fam not in g else "ERROR" if g[fam]["error"] else
                        fmt(g[fam]["fraction"]) + ("" if g[fam]["ok"] is not False else " BAD")
                        + (" copy!" if g[fam]["in_place"] is False else ""))
    ceiling = next((r for r in rows if r["baseline_gbps"]), None)
    ceiling_cell = ("-" if ceiling is None else
                    f"{fmt(ceiling['baseline_gbps'], 1)} {ceiling['baseline'].split('[')[-1][:-1]}")
    pallas = g.get("pallas", {}).get("impl", "-")
    kernels = [g[f]["fraction"] for f in ("pallas", "ffi")
               if f in g and not g[f]["error"] and g[f]["ok"] is not False
               and g[f]["fraction"] is not None]
    target = _met(max(kernels) if kernels else None, FETCH_TARGET) if (
        layout == FETCH_TARGET_LAYOUT) else "-"
    out.append([direction, layout, str(n), ceiling_cell, cell("xla"), cell("pallas"), pallas,
                cell("ffi"), target])
  return out


def attention_rows(result: dict) -> list[list[str]]:
  """One line per batch: the copy's traffic rate, xla and the best Pallas configuration
  (fraction, max error, launch), and the target."""
  groups: dict[int, list[dict]] = {}
  for r in result["rows"]:
    groups.setdefault(r["batch"], []).append(r)
  out = []
  for batch, rows in groups.items():
    g = _best(rows, "fraction")
    cell = lambda fam: ("-" if fam not in g else "ERROR" if g[fam]["error"] else
                        f"{fmt(g[fam]['fraction'])} (err {fmt(g[fam]['max_err'], 4)})")
    copy = next((r["copy_gbps"] for r in rows if r.get("copy_gbps")), None)
    p = g.get("pallas")
    launch = "-" if p is None or p.get("block_h") is None else (
        f"h{p['block_h']} s{p['splits']} w{p['num_warps']}")
    value = None if p is None or p["error"] else p["fraction"]
    out.append([str(batch), fmt(copy, 0), cell("xla"), cell("pallas"),
                "-" if p is None else p["impl"], launch, _met(value, ATTENTION_TARGET)])
  return out


def summarize(paths: list[str]) -> None:
  for path in paths:
    p = pathlib.Path(path)
    if not p.exists():
      print(f"{path}: missing")
      continue
    result = json.loads(p.read_text())
    if result.get("benchmark") == "fetch":
      print_table(f"fetch/evict: fraction of a contiguous copy of the same bytes (best of "
                  f"{result.get('reps', 1)}; target {FETCH_TARGET} for {FETCH_TARGET_LAYOUT})",
                  ("dir", "layout", "entries", "ceiling GB/s", "xla", "pallas", "best pallas",
                   "ffi", "target"),
                  fetch_rows(result), left=("dir", "layout", "best pallas"))
    elif result.get("benchmark") == "attention":
      g = result["geometry"]
      print_table(f"sparse attention (H={g['heads']} k={g['k']}): read rate as a fraction "
                  f"of a device copy's traffic (target {ATTENTION_TARGET})",
                  ("batch", "copy GB/s", "xla", "pallas", "best pallas", "launch", "target"),
                  attention_rows(result), left=("best pallas", "launch"))


def main(argv: list[str]) -> int:
  summarize(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
