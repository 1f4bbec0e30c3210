"""A short table from the benchmarks' JSON: the best configuration of each implementation.

    python -m ula_jax.bench.summary runs/bench/fetch.json runs/bench/attention.json
"""

from __future__ import annotations

import json
import pathlib
import sys

from ula_jax.bench.common import fmt, print_table


def _family(impl: str) -> str:
  return impl.split("[")[0]


def fetch_rows(result: dict, min_entries: int = 4096) -> list[list[str]]:
  """One line per (direction, layout, entries >= min_entries): each implementation's
  fraction of the contiguous copy (Pallas: its best configuration, named)."""
  groups: dict[tuple, dict[str, dict]] = {}
  for r in result["rows"]:
    if r["entries"] < min_entries or r["impl"] == "contiguous copy":
      continue
    g = groups.setdefault((r["direction"], r["layout"], r["entries"]), {})
    fam = _family(r["impl"])
    best = g.get(fam)
    if best is None or (r["fraction"] or -1) > (best["fraction"] or -1):
      g[fam] = r
  out = []
  for (direction, layout, n), g in groups.items():
    cell = lambda fam: ("-" if fam not in g else "ERROR" if g[fam]["error"] else
                        fmt(g[fam]["fraction"]) + ("" if g[fam]["ok"] is not False else " BAD")
                        + (" copy!" if g[fam]["in_place"] is False else ""))
    pallas = g.get("pallas", {}).get("impl", "-")
    out.append([direction, layout, str(n), cell("xla"), cell("pallas"), pallas, cell("ffi")])
  return out


def attention_rows(result: dict) -> list[list[str]]:
  """One line per batch: xla and the best Pallas configuration, fraction and max error."""
  groups: dict[int, dict[str, dict]] = {}
  for r in result["rows"]:
    g = groups.setdefault(r["batch"], {})
    fam = _family(r["impl"])
    best = g.get(fam)
    if best is None or (r["fraction"] or -1) > (best["fraction"] or -1):
      g[fam] = r
  out = []
  for batch, g in groups.items():
    cell = lambda fam: ("-" if fam not in g else "ERROR" if g[fam]["error"] else
                        f"{fmt(g[fam]['fraction'])} (err {fmt(g[fam]['max_err'], 4)})")
    out.append([str(batch), cell("xla"), cell("pallas"), g.get("pallas", {}).get("impl", "-")])
  return out


def summarize(paths: list[str]) -> None:
  for path in paths:
    p = pathlib.Path(path)
    if not p.exists():
      print(f"{path}: missing")
      continue
    result = json.loads(p.read_text())
    if result.get("benchmark") == "fetch":
      print_table("fetch/evict: fraction of a contiguous copy of the same bytes",
                  ("dir", "layout", "entries", "xla", "pallas", "best pallas", "ffi"),
                  fetch_rows(result), left=("dir", "layout", "best pallas"))
    elif result.get("benchmark") == "attention":
      g = result["geometry"]
      print_table(f"sparse attention (H={g['heads']} k={g['k']}): read rate as a fraction "
                  "of a device copy's traffic", ("batch", "xla", "pallas", "best pallas"),
                  attention_rows(result), left=("best pallas",))


def main(argv: list[str]) -> int:
  summarize(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
