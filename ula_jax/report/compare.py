"""Token-by-token comparison of two runs (memory systems must not change greedy tokens)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ula_jax.report.output import read_summary


@dataclasses.dataclass
class Comparison:
  """rows: one per request id in either run (id, statuses, token counts, result)."""

  rows: list[dict]

  @property
  def mismatches(self) -> list[dict]:
    return [r for r in self.rows if r["result"] != "match"]

  @property
  def ok(self) -> bool:
    return not self.mismatches


def _first_difference(a: list[int], b: list[int]) -> int:
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return min(len(a), len(b))


def compare_runs(dir_a: str | Path, dir_b: str | Path) -> Comparison:
  """Compares generated tokens request by request (matched by id, in A's order, then
  ids only B has). A request matches when status and every token agree."""
  reqs_a = {r["id"]: r for r in read_summary(dir_a)["requests"]}
  reqs_b = {r["id"]: r for r in read_summary(dir_b)["requests"]}
  rows = []
  for rid in [*reqs_a, *(i for i in reqs_b if i not in reqs_a)]:
    a, b = reqs_a.get(rid), reqs_b.get(rid)
    row = {"id": rid,
           "status_a": a["status"] if a else None, "status_b": b["status"] if b else None,
           "tokens_a": len(a["output_tokens"]) if a else None,
           "tokens_b": len(b["output_tokens"]) if b else None}
    if a is None or b is None:
      row["result"] = f"only in {'B' if a is None else 'A'}"
    elif a["status"] != b["status"]:
      row["result"] = "status differs"
    elif a["output_tokens"] != b["output_tokens"]:
      i = _first_difference(a["output_tokens"], b["output_tokens"])
      row["result"] = f"tokens differ from index {i}"
    else:
      row["result"] = "match"
    rows.append(row)
  return Comparison(rows=rows)
