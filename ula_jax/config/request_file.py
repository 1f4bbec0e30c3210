"""The request-file format (JSONL, one object per line, or a JSON list of objects), read
and checked before anything is computed; ``workloads.file`` turns its records into requests.

Fields of one request:
  id              string (or integer), unique in the file
  prompt          list of token ids in [0, vocab_size)        } exactly one of the two
  prompt_len      integer >= 1: a synthetic (Zipf) prompt     }
  max_new_tokens  integer >= 1
  arrival_step    integer >= 0 (optional, default 0)
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

FIELDS = ("id", "prompt", "prompt_len", "max_new_tokens", "arrival_step")


class WorkloadError(ValueError):
  """A malformed request file; the message names the file, line (or entry) and field."""


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def read_records(path: str | Path) -> list[tuple[str, dict]]:
  """``[(where, record)]``: ``where`` is ``'file:line N'`` (JSONL) or ``'file: entry N'``
  (JSON list), for error messages."""
  path = Path(path)
  if not path.is_file():
    raise WorkloadError(f"workload.path={str(path)!r}: no such file")
  text = path.read_text()
  if not text.strip():
    raise WorkloadError(f"{path}: empty request file (expected JSONL or a JSON list)")
  records: list[tuple[str, Any]] = []
  if text.lstrip().startswith("["):
    try:
      items = json.loads(text)
    except json.JSONDecodeError as e:
      raise WorkloadError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
    records = [(f"{path}: entry {i}", item) for i, item in enumerate(items)]
  else:
    for lineno, line in enumerate(text.splitlines(), start=1):
      if not line.strip():
        continue
      try:
        records.append((f"{path}:{lineno}", json.loads(line)))
      except json.JSONDecodeError as e:
        raise WorkloadError(f"{path}:{lineno}: not valid JSON: {e.msg} "
                            f"(one request object per line)") from None
  checked, seen = [], {}
  for where, rec in records:
    rec = check_record(where, rec)
    if rec["id"] in seen:
      raise WorkloadError(f"{where}: field 'id'={rec['id']!r} repeats the id of {seen[rec['id']]}")
    seen[rec["id"]] = where
    checked.append((where, rec))
  if not checked:
    raise WorkloadError(f"{path}: no requests in the file")
  return checked


def check_record(where: str, rec: Any) -> dict:
  """Validates one request object; returns it with ``id`` as a string and defaults filled."""
  if not isinstance(rec, dict):
    raise WorkloadError(f"{where}: expected a JSON object with fields {', '.join(FIELDS)}, "
                        f"got {type(rec).__name__}")
  for key in rec:
    if key not in FIELDS:
      close = difflib.get_close_matches(str(key), FIELDS, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise WorkloadError(f"{where}: unknown field {key!r}{hint}; fields: {', '.join(FIELDS)}")
  if "id" not in rec or not isinstance(rec["id"], (str, int)) or isinstance(rec["id"], bool):
    raise WorkloadError(f"{where}: field 'id' is missing or not a string")
  if ("prompt" in rec) == ("prompt_len" in rec):
    raise WorkloadError(f"{where}: give exactly one of the fields 'prompt' (token ids) "
                        f"and 'prompt_len' (a synthetic prompt)")
  if "prompt" in rec:
    p = rec["prompt"]
    if not isinstance(p, list) or not p or not all(_is_int(t) for t in p):
      raise WorkloadError(f"{where}: field 'prompt' must be a non-empty list of integer token ids")
  elif not _is_int(rec["prompt_len"]) or rec["prompt_len"] < 1:
    raise WorkloadError(f"{where}: field 'prompt_len'={rec['prompt_len']!r}: expected an "
                        f"integer >= 1")
  m = rec.get("max_new_tokens")
  if not _is_int(m) or m < 1:
    raise WorkloadError(f"{where}: field 'max_new_tokens'={m!r}: expected an integer >= 1")
  a = rec.get("arrival_step", 0)
  if not _is_int(a) or a < 0:
    raise WorkloadError(f"{where}: field 'arrival_step'={a!r}: expected an integer >= 0")
  return {**rec, "id": str(rec["id"]), "arrival_step": a}


def file_lengths(path: str | Path) -> list[tuple[int, int]]:
  """``[(prompt tokens, max_new_tokens)]`` of every request in the file."""
  out = []
  for _, rec in read_records(path):
    plen = len(rec["prompt"]) if "prompt" in rec else rec["prompt_len"]
    out.append((plen, rec["max_new_tokens"]))
  return out
