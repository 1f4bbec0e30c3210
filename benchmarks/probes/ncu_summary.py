"""Summarise an Nsight Compute report of one kernel from its CSV pages.

    ncu -i rows.ncu-rep --page details --csv > details.csv
    ncu -i rows.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/probes/ncu_summary.py details.csv sass.csv

Prints the headline metrics (duration, cycles, issue rate, occupancy, spills), the warp
stall reasons over all samples, the opcodes by share of executed instructions and of
stall samples (with each opcode's main stall reasons), and the shared-memory wavefronts
per opcode against the ideal (bank conflicts).
"""

from __future__ import annotations

import collections
import csv
import sys

HEADLINE = ("Duration", "Elapsed Cycles", "SM Frequency", "Executed Ipc Active",
            "Issue Slots Busy", "L1/TEX Cache Throughput", "Achieved Active Warps Per SM",
            "Registers Per Thread", "Local Memory Spilling Requests",
            "Warp Cycles Per Issued Instruction", "Executed Instructions")


def _num(x: str) -> float:
  try:
    return float(x.replace(",", ""))
  except ValueError:
    return 0.0


def _table(path: str) -> tuple[dict[str, int], list[list[str]]]:
  rows = list(csv.reader(open(path)))
  head = next(i for i, r in enumerate(rows[:10]) if "Source" in r or "Metric Name" in r)
  return {h: i for i, h in enumerate(rows[head])}, rows[head + 1:]


def details(path: str) -> None:
  ix, rows = _table(path)
  for r in rows:
    if r[ix["Metric Name"]] in HEADLINE:
      print(f"{r[ix['Metric Name']]:36s} {r[ix['Metric Value']]:>14s} {r[ix['Metric Unit']]}")


def source(path: str, top: int = 16) -> None:
  ix, rows = _table(path)
  stalls = [h for h in ix if h.startswith("stall_") and "Not Issued" not in h]
  total = collections.Counter()
  per_op = collections.defaultdict(collections.Counter)
  executed, smem = collections.Counter(), collections.defaultdict(lambda: [0.0, 0.0])
  for r in rows:
    words = r[ix["Source"]].split()
    if not words:
      continue
    opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    family = opcode.split(".")[0]
    executed[family] += _num(r[ix["Instructions Executed"]])
    for s in stalls:
      total[s] += _num(r[ix[s]])
      per_op[family][s] += _num(r[ix[s]])
    if _num(r[ix["L1 Wavefronts Shared"]]):
      smem[opcode][0] += _num(r[ix["L1 Wavefronts Shared"]])
      smem[opcode][1] += _num(r[ix["L1 Wavefronts Shared Ideal"]])
  samples, count = sum(total.values()), sum(executed.values())
  print(f"\nwarp stall samples: {samples:.0f}")
  for s, v in total.most_common(8):
    print(f"  {s[6:]:20s} {100 * v / samples:5.1f}%")
  print(f"\n{'opcode':12s} {'executed':>9s} {'samples':>8s}  main stalls")
  for family, v in executed.most_common(top):
    c = per_op[family]
    main = ", ".join(f"{k[6:]} {100 * n / samples:.1f}" for k, n in c.most_common(2) if n)
    print(f"{family:12s} {100 * v / count:8.1f}% {100 * sum(c.values()) / samples:7.1f}%  {main}")
  print(f"\n{'shared-memory opcode':30s} {'wavefronts':>11s} {'ideal':>11s}")
  for opcode, (w, ideal) in sorted(smem.items()):
    print(f"{opcode:30s} {w:11.0f} {ideal:11.0f}")


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    raise SystemExit(__doc__)
  details(argv[0])
  source(argv[1])
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
