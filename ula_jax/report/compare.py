"""Token-by-token comparison of two runs (memory systems must not change greedy tokens).

Tokens are compared only between runs that can agree: the same workload (request ids,
prompt hashes and lengths, max_new_tokens) and the same model (the ``model`` section of
each run's config.yaml). Anything else is refused with what differs (IncomparableRuns).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ula_jax.core.digest import STEP_DIGESTS
from ula_jax.report.output import (CONFIG_FILE, DIGESTS_FILE, SUMMARY_FILE, RunDirError,
                                   read_summary)

# Fields every request of summary.json has, with the type each must be.
REQUEST_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "prompt_len": (int,), "max_new_tokens": (int,), "status": (str,),
    "output_tokens": (list,)}
# Differences listed in an IncomparableRuns message (then a count of the rest).
MAX_LISTED = 5


class IncomparableRuns(RunDirError):
  """Two run directories whose tokens cannot be compared (different workload or model,
  or nothing generated)."""


@dataclasses.dataclass
class Comparison:
  """rows: one per request id in either run (id, statuses, token counts, result).
  tokens_compared: token positions both runs generated (a request's shorter output)
  notes: what could not be checked (prompt hashes a run did not record)."""

  rows: list[dict]
  tokens_compared: int = 0
  notes: list[str] = dataclasses.field(default_factory=list)
  # With both runs' digests (engine.record_digests): per request whose digests differ,
  # where the two runs first computed different bits (``first_digest_difference``).
  digest_differences: dict[str, str] | None = None

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


def _is(value: Any, types: tuple[type, ...]) -> bool:
  return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def read_requests(run_dir: str | Path) -> dict[str, dict]:
  """The ``requests`` of a run's summary.json by id, each checked to have every
  REQUEST_FIELDS field (RunDirError naming the file, the request and the field)."""
  path = Path(run_dir) / SUMMARY_FILE
  out: dict[str, dict] = {}
  for i, r in enumerate(read_summary(run_dir)["requests"]):
    if not isinstance(r, dict):
      raise RunDirError(f"{path}: requests[{i}] is {type(r).__name__}, expected an object")
    for field, types in REQUEST_FIELDS.items():
      if field not in r:
        raise RunDirError(f"{path}: requests[{i}] has no '{field}' field")
      if not _is(r[field], types):
        raise RunDirError(f"{path}: requests[{i}].{field}={r[field]!r}: expected "
                          f"{' or '.join(t.__name__ for t in types)}")
    if not all(_is(t, (int,)) for t in r["output_tokens"]):
      raise RunDirError(f"{path}: requests[{i}].output_tokens: expected a list of integers")
    sha = r.get("prompt_sha1")
    if sha is not None and not isinstance(sha, str):
      raise RunDirError(f"{path}: requests[{i}].prompt_sha1={sha!r}: expected a hex string "
                        f"or null")
    if r["id"] in out:
      raise RunDirError(f"{path}: requests[{i}].id={r['id']!r} appears twice")
    out[r["id"]] = r
  return out


def read_model(run_dir: str | Path) -> dict:
  """The ``model`` section of a run's config.yaml (RunDirError naming the file)."""
  path = Path(run_dir) / CONFIG_FILE
  if not path.is_file():
    raise RunDirError(f"{path}: missing; a run directory holds the config it ran "
                      f"({CONFIG_FILE}) beside {SUMMARY_FILE}")
  try:
    doc = yaml.safe_load(path.read_text())
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f":{mark.line + 1}" if mark is not None else ""
    raise RunDirError(f"{path}{where}: not valid YAML: "
                      f"{getattr(e, 'problem', None) or e}") from None
  if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
    raise RunDirError(f"{path}: expected a mapping with a 'model' section")
  return doc["model"]


def _flatten(d: Any, prefix: str) -> dict[str, Any]:
  if not isinstance(d, dict):
    return {prefix: d}
  out: dict[str, Any] = {}
  for k, v in d.items():
    out.update(_flatten(v, f"{prefix}.{k}"))
  return out


_MISSING = "(not set)"


def model_differences(model_a: dict, model_b: dict) -> list[str]:
  """``model.FIELD: A vs B`` for every field that differs."""
  a, b = _flatten(model_a, "model"), _flatten(model_b, "model")
  return [f"{k}: {a.get(k, _MISSING)!r} in A, {b.get(k, _MISSING)!r} in B"
          for k in dict.fromkeys([*a, *b]) if a.get(k, _MISSING) != b.get(k, _MISSING)]


def workload_differences(reqs_a: dict[str, dict], reqs_b: dict[str, dict]) -> list[str]:
  """What keeps two runs from having served the same requests: ids only one has, then
  per request a different prompt length, prompt hash (when both recorded one) or
  max_new_tokens."""
  out = []
  only_a = [i for i in reqs_a if i not in reqs_b]
  only_b = [i for i in reqs_b if i not in reqs_a]
  for ids, run in ((only_a, "A"), (only_b, "B")):
    if ids:
      listed = ", ".join(ids[:MAX_LISTED]) + (", ..." if len(ids) > MAX_LISTED else "")
      out.append(f"{len(ids)} request(s) only in {run}: {listed}")
  for rid, a in reqs_a.items():
    b = reqs_b.get(rid)
    if b is None:
      continue
    for field in ("prompt_len", "prompt_sha1", "max_new_tokens"):
      va, vb = a.get(field), b.get(field)
      if field == "prompt_sha1" and (va is None or vb is None):
        continue  # not recorded (a run written before prompt hashes were)
      if va != vb:
        out.append(f"request {rid}: {field} {va!r} in A, {vb!r} in B")
  return out


def _refuse(what: str, dir_a: Path, dir_b: Path, differences: list[str]) -> None:
  listed = differences[:MAX_LISTED]
  more = len(differences) - len(listed)
  raise IncomparableRuns(
      f"compare: {dir_a} and {dir_b} ran different {what}; their tokens cannot be compared "
      f"({len(differences)} difference(s)):\n" + "\n".join(f"  - {d}" for d in listed)
      + (f"\n  - ... and {more} more" if more else ""))


def compare_runs(dir_a: str | Path, dir_b: str | Path, *, check: bool = True) -> Comparison:
  """Compares generated tokens request by request (matched by id, in A's order, then
  ids only B has). A request matches when status and every token agree.

  check: first refuse (IncomparableRuns) runs of a different workload or model, and
    runs in which no token position was generated by both (nothing would be compared).
  Malformed run directories raise RunDirError naming the file and field.
  """
  dir_a, dir_b = Path(dir_a), Path(dir_b)
  reqs_a, reqs_b = read_requests(dir_a), read_requests(dir_b)
  if check:
    models = read_model(dir_a), read_model(dir_b)
    if diff := workload_differences(reqs_a, reqs_b):
      _refuse("workloads", dir_a, dir_b, diff)
    if diff := model_differences(*models):
      _refuse("models", dir_a, dir_b, diff)
  notes = [f"{d}: no prompt_sha1 recorded; prompts were checked by length only"
           for d, reqs in ((dir_a, reqs_a), (dir_b, reqs_b))
           if check and any(r.get("prompt_sha1") is None for r in reqs.values())]
  rows, compared = [], 0
  for rid in [*reqs_a, *(i for i in reqs_b if i not in reqs_a)]:
    a, b = reqs_a.get(rid), reqs_b.get(rid)
    row = {"id": rid,
           "status_a": a["status"] if a else None, "status_b": b["status"] if b else None,
           "tokens_a": len(a["output_tokens"]) if a else None,
           "tokens_b": len(b["output_tokens"]) if b else None}
    if a is None or b is None:
      row["result"] = f"only in {'B' if a is None else 'A'}"
    else:
      compared += min(len(a["output_tokens"]), len(b["output_tokens"]))
      if a["status"] != b["status"]:
        row["result"] = "status differs"
      elif a["output_tokens"] != b["output_tokens"]:
        i = _first_difference(a["output_tokens"], b["output_tokens"])
        row["result"] = f"tokens differ from index {i}"
      else:
        row["result"] = "match"
    rows.append(row)
  if check and not compared:
    tokens = [sum(len(r["output_tokens"]) for r in reqs.values()) for reqs in (reqs_a, reqs_b)]
    raise IncomparableRuns(
        f"compare: no token to compare: {dir_a} generated {tokens[0]} token(s) and {dir_b} "
        f"{tokens[1]} over {len(reqs_a)} request(s), none at a position both generated")
  digests = read_digests(dir_a), read_digests(dir_b)
  differences = (None if digests[0] is None or digests[1] is None
                 else digest_differences(*digests))
  return Comparison(rows=rows, tokens_compared=compared, notes=notes,
                    digest_differences=differences)


# ----------------------------------------------------------------------------------
# digests (engine.record_digests)
# ----------------------------------------------------------------------------------

_DIGEST_ARRAYS = ("request", "token") + STEP_DIGESTS


def group_digests(arrays: Any) -> dict[str, dict[int, tuple]]:
  """digests.npz's arrays (or ``RunResult.digests``) as {request id: {token index:
  (selection [G], new [L], entries [L], output [L])}}."""
  out: dict[str, dict[int, tuple]] = {}
  for i in range(arrays["request"].shape[0]):
    out.setdefault(str(arrays["request"][i]), {})[int(arrays["token"][i])] = tuple(
        arrays[k][i] for k in STEP_DIGESTS)
  return out


def read_digests(run_dir: str | Path) -> dict[str, dict[int, tuple]] | None:
  """A run's digests.npz, ``group_digests``'d; None when the run recorded none."""
  path = Path(run_dir) / DIGESTS_FILE
  if not path.exists():
    return None
  try:
    with np.load(path) as z:
      arrays = {k: z[k] for k in _DIGEST_ARRAYS}
  except (OSError, ValueError, KeyError) as e:
    raise RunDirError(f"{path}: not a digests file with arrays {list(_DIGEST_ARRAYS)} ({e})")
  n = arrays["request"].shape[0]
  if any(arrays[k].shape[0] != n for k in _DIGEST_ARRAYS):
    raise RunDirError(f"{path}: arrays {list(_DIGEST_ARRAYS)} must have one row per "
                      f"(request, step); got {[arrays[k].shape[0] for k in _DIGEST_ARRAYS]}")
  return group_digests(arrays)


def first_digest_difference(a: dict[int, tuple], b: dict[int, tuple]) -> str | None:
  """Where one request's decode steps first computed different bits in two runs, in the
  order a step computes them: per layer group its selection, then per layer of the group
  the new token's entry (the model's computation), the stored entries attention read
  (the memory system's bytes) and the attention output. None when every shared step
  agrees."""
  for t in sorted(set(a) & set(b)):
    (sel_a, new_a, ent_a, out_a), (sel_b, new_b, ent_b, out_b) = a[t], b[t]
    G, L = len(sel_a), len(ent_a)
    size = -(-L // G)  # layers per group
    for g in range(G):
      if sel_a[g] != sel_b[g]:
        return f"token {t}: layer group {g}'s selected positions"
      for l in range(g * size, min(L, (g + 1) * size)):
        if new_a[l] != new_b[l]:
          return f"token {t}: layer {l}'s new entry (computed by the model)"
        if ent_a[l] != ent_b[l]:
          return f"token {t}: layer {l}'s stored entries read (same selection)"
        if out_a[l] != out_b[l]:
          return f"token {t}: layer {l}'s attention output (same entries)"
  return None


def digest_differences(a: dict[str, dict[int, tuple]], b: dict[str, dict[int, tuple]]
                       ) -> dict[str, str]:
  """{request id: ``first_digest_difference``} for every request both runs digested
  whose digests differ."""
  out = {}
  for rid in a:
    if rid in b and (where := first_digest_difference(a[rid], b[rid])) is not None:
      out[rid] = where
  return out
