"""Importing SGLang's indexer top-k (``--enable-return-indexer-topk``) as a trace.

SGLang returns, per request, ``meta_info["indexer_topk"]``: int32 ``[seqlen - 1,
num_indexer_layers, index_topk]``, row ``i`` the positions the indexer selected for the
token at position ``i`` in each indexer layer, ``-1`` where fewer than ``index_topk``
were selected. A directory to import holds one file per request and a manifest:

``manifest.json``::

    {"requests": [
       {"id": "req-0", "file": "req-0.npy", "prompt_len": 65536},
       {"id": "req-1", "file": "req-1.npz", "prompt_len": 70000, "key": "indexer_topk"},
       {"id": "req-2", "file": "req-2.json", "prompt_len": 900, "first_position": 900}],
     "layers": [0, 4, 8]}

* ``id`` (str), ``file`` (relative to the manifest) and ``prompt_len`` (int >= 1, the
  prompt's tokens) are required;
* ``first_position`` (int >= 0, default 0): the position of the array's row 0. SGLang's
  array starts at position 0; an array cut to its decode rows (``first_position =
  prompt_len``) is much smaller;
* ``key``: the array's name in an ``.npz`` (default ``indexer_topk``, or its only array);
* files: ``.npy`` (memory-mapped: the form for long prompts), ``.npz``, or ``.json`` (a
  nested list ``[rows][layers][k]``);
* ``layers`` (optional, top level): the indexer layer each layer group takes, one per
  group. Without it: one indexer layer per group, or one per model layer (each group
  takes its first layer's selection, which the others share).

Decode steps are the rows at positions ``prompt_len`` onwards (the prompt's rows are not
read). A position must be ``-1`` or in ``[0, p]`` for the row at position ``p`` (a token
attends to itself and the past). A malformed manifest or file is an error naming the
file, the request and the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np

from ula_jax.core.types import KVGeometry
from ula_jax.memory.traces.build import plan_schedule, write_trace
from ula_jax.memory.traces.format import TraceError

MANIFEST = "manifest.json"
DEFAULT_KEY = "indexer_topk"


class SglangImportError(TraceError):
  """A manifest or request file that cannot be imported."""


@dataclasses.dataclass
class SglRequest:
  """One request's array (memory-mapped for ``.npy``): ``array[offset + j]`` holds the
  selections of decode step ``j`` (position ``prompt_len + j``)."""

  id: str
  file: Path
  prompt_len: int
  array: np.ndarray  # [rows, num_indexer_layers, index_topk]
  offset: int

  @property
  def steps(self) -> int:
    return max(int(self.array.shape[0]) - self.offset, 0)

  def step(self, j: int) -> np.ndarray:
    """[num_indexer_layers, index_topk] int64 decode step ``j``'s selections."""
    return np.asarray(self.array[self.offset + j], np.int64)


def _field(entry: dict, name: str, where: str, kind, *, default=None, required=True):
  if name not in entry:
    if required:
      raise SglangImportError(f"{where}: field {name!r} missing")
    return default
  v = entry[name]
  if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
    raise SglangImportError(f"{where}: field {name!r}={v!r}: expected an integer")
  if kind is str and not isinstance(v, str):
    raise SglangImportError(f"{where}: field {name!r}={v!r}: expected a string")
  return v


def read_manifest(path) -> tuple[Path, list[dict], list[int] | None]:
  """(the manifest's directory, its request entries, its ``layers`` or None)."""
  path = Path(path)
  if path.is_dir():
    path = path / MANIFEST
  try:
    doc = json.loads(path.read_text())
  except FileNotFoundError:
    raise SglangImportError(
        f"{path}: no such manifest (a directory to import holds {MANIFEST}: "
        f"{{\"requests\": [{{\"id\", \"file\", \"prompt_len\"}}, ...]}})") from None
  except ValueError as e:
    raise SglangImportError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list) or not doc["requests"]:
    raise SglangImportError(f"{path}: field 'requests' must be a non-empty list of "
                            f"{{\"id\", \"file\", \"prompt_len\"}} objects")
  layers = doc.get("layers")
  if layers is not None and (not isinstance(layers, list) or not all(
      isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
    raise SglangImportError(f"{path}: field 'layers'={layers!r}: expected a list of indexer "
                            f"layer indices >= 0, one per layer group")
  entries, seen = [], set()
  for i, e in enumerate(doc["requests"]):
    where = f"{path}: requests[{i}]"
    if not isinstance(e, dict):
      raise SglangImportError(f"{where}: expected an object with 'id', 'file', 'prompt_len'")
    rid = _field(e, "id", where, str)
    where = f"{path}: request {rid!r}"
    if rid in seen:
      raise SglangImportError(f"{where}: field 'id' repeats an earlier request's id")
    seen.add(rid)
    _field(e, "file", where, str)
    if _field(e, "prompt_len", where, int) < 1:
      raise SglangImportError(f"{where}: field 'prompt_len'={e['prompt_len']}: must be >= 1")
    if _field(e, "first_position", where, int, default=0, required=False) < 0:
      raise SglangImportError(f"{where}: field 'first_position'={e['first_position']}: must be "
                              f">= 0")
    _field(e, "key", where, str, required=False)
    unknown = set(e) - {"id", "file", "prompt_len", "first_position", "key"}
    if unknown:
      raise SglangImportError(f"{where}: unknown field(s) {sorted(unknown)}; expected id, file, "
                              f"prompt_len, first_position, key")
    entries.append(e)
  return path.parent, entries, layers


def _read_array(file: Path, key: str | None, where: str) -> np.ndarray:
  if not file.is_file():
    raise SglangImportError(f"{where}: file {str(file)!r} not found")
  suffix = file.suffix.lower()
  try:
    if suffix == ".npy":
      return np.load(file, mmap_mode="r")
    if suffix == ".npz":
      with np.load(file) as z:
        name = key or (DEFAULT_KEY if DEFAULT_KEY in z.files else
                       (z.files[0] if len(z.files) == 1 else None))
        if name is None or name not in z.files:
          raise SglangImportError(f"{where}: {file.name} has arrays {z.files}; name the indexer "
                                  f"top-k one with the manifest's field 'key'"
                                  + (f" ({name!r} is not one)" if name else ""))
        return z[name]
    if suffix == ".json":
      doc = json.loads(file.read_text())
      if isinstance(doc, dict):
        if (key or DEFAULT_KEY) not in doc:
          raise SglangImportError(f"{where}: {file.name} is an object without field "
                                  f"{key or DEFAULT_KEY!r}; give a list [rows][layers][k]")
        doc = doc[key or DEFAULT_KEY]
      try:
        arr = np.asarray(doc)
      except ValueError:
        arr = np.asarray(doc, dtype=object)  # ragged: reported below
      if arr.dtype == object:
        raise SglangImportError(f"{where}: field indexer_topk in {file.name} is not a rectangular "
                                f"[rows][layers][k] list of integers")
      return arr
  except SglangImportError:
    raise
  except (OSError, ValueError) as e:
    raise SglangImportError(f"{where}: cannot read {file.name}: {e}") from None
  raise SglangImportError(f"{where}: file {file.name}: expected .npy, .npz or .json")


def read_request(base: Path, entry: dict, manifest: Path) -> SglRequest:
  """One request's decode rows, checked (SglangImportError naming file, request and field)."""
  rid, prompt = entry["id"], entry["prompt_len"]
  first = entry.get("first_position", 0)
  file = base / entry["file"]
  where = f"{manifest}: request {rid!r} ({file.name})"
  arr = _read_array(file, entry.get("key"), where)
  if arr.ndim != 3:
    raise SglangImportError(f"{where}: field indexer_topk has shape {arr.shape}: expected "
                            f"[rows, num_indexer_layers, index_topk]")
  if not np.issubdtype(arr.dtype, np.integer):
    raise SglangImportError(f"{where}: field indexer_topk has dtype {arr.dtype}: expected "
                            f"integers (int32 positions, -1 for none)")
  if first > prompt:
    raise SglangImportError(f"{where}: field 'first_position'={first} is past prompt_len="
                            f"{prompt}: the decode positions {prompt}..{first - 1} have no rows")
  req = SglRequest(id=rid, file=file, prompt_len=prompt, array=arr, offset=prompt - first)
  # Checked a block of rows at a time: a memory-mapped array stays on disk.
  for j0 in range(0, req.steps, 64):
    dec = np.asarray(arr[req.offset + j0:req.offset + min(j0 + 64, req.steps)])
    lo = int(dec.min())
    if lo < -1:
      raise SglangImportError(f"{where}: field indexer_topk holds {lo}: positions are >= 0, "
                              f"-1 for none")
    pos = prompt + j0 + np.arange(dec.shape[0], dtype=np.int64)
    over = dec.max(axis=(1, 2)) > pos
    if over.any():
      j = int(np.flatnonzero(over)[0])
      layer = int(np.flatnonzero((dec[j] > pos[j]).any(axis=1))[0])
      raise SglangImportError(
          f"{where}: field indexer_topk row {req.offset + j0 + j} (position {pos[j]}), "
          f"indexer layer {layer}, selects position {int(dec[j].max())}: a token selects "
          f"positions <= its own")
  return req


def group_layers(num_indexer_layers: int, geometry: KVGeometry,
                 layers: list[int] | None, where: str) -> np.ndarray:
  """[G] the indexer layer each layer group takes (see the module docstring)."""
  G, L, S = geometry.num_groups, geometry.num_layers, geometry.group_size
  if layers is not None:
    if len(layers) != G or max(layers) >= num_indexer_layers:
      raise SglangImportError(f"{where}: field 'layers' has {len(layers)} entries up to "
                              f"{max(layers)}: expected {G} (one per layer group) in "
                              f"[0, {num_indexer_layers})")
    return np.asarray(layers, np.int64)
  if num_indexer_layers == G:
    return np.arange(G, dtype=np.int64)
  if num_indexer_layers == L:
    return np.arange(G, dtype=np.int64) * S
  raise SglangImportError(
      f"{where}: field indexer_topk has {num_indexer_layers} indexer layers; the model has "
      f"{L} layers in {G} groups of {S}: expected {G} (one per group) or {L} (one per "
      f"layer; each group takes its first layer's), or give the manifest's 'layers' (one "
      f"indexer layer per group)")


def import_sglang(src, out, geometry: KVGeometry, *, max_batch: int | None = None,
                  page_size: int = 64, prefill_chunk: int = 8192,
                  layers: list[int] | None = None,
                  on_step: Callable[[int], None] | None = None) -> Path:
  """Imports the manifest at ``src`` (a directory holding ``manifest.json``, or the
  manifest itself) into a trace at ``out`` (``.npz`` or a directory).

  geometry: the model's KV geometry (its ``index_topk`` must be the files' k)
  max_batch: rows of the rank (default: every request at once, at most 64); requests
    beyond wait for a free row, in manifest order
  layers: the indexer layer of each group (overrides the manifest's)
  """
  base, entries, manifest_layers = read_manifest(src)
  manifest = Path(src) / MANIFEST if Path(src).is_dir() else Path(src)
  reqs = [read_request(base, e, manifest) for e in entries]
  shapes = {tuple(r.array.shape[1:]) for r in reqs}
  if len(shapes) > 1:
    raise SglangImportError(f"{manifest}: the requests' indexer_topk arrays differ in "
                            f"[num_indexer_layers, index_topk]: {sorted(shapes)}")
  n_layers, k = next(iter(shapes))
  if k != geometry.top_k:
    raise SglangImportError(f"{manifest}: field indexer_topk has index_topk={k}; the model's "
                            f"index_topk is {geometry.top_k}: choose the model the trace is of")
  which = group_layers(n_layers, geometry, layers if layers is not None else manifest_layers,
                       str(manifest))
  B = max_batch or min(len(reqs), 64)
  schedule = plan_schedule([r.prompt_len for r in reqs], [r.steps for r in reqs],
                           max_batch=B, page_size=page_size, prefill_chunk=prefill_chunk)
  G = geometry.num_groups

  def select(t: int, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
    out_ = np.full((G, B, k), -1, np.int64)
    for b in np.flatnonzero(req >= 0):
      r = reqs[int(req[b])]
      out_[:, b] = r.step(int(pos[b]) - r.prompt_len)[which]
    return out_

  source = {"importer": "ula-jax trace import (SGLang indexer_topk)", "manifest": str(manifest),
            "requests": [{"id": r.id, "prompt_len": r.prompt_len, "steps": r.steps}
                         for r in reqs],
            "max_batch": B, "page_size": page_size, "prefill_chunk": prefill_chunk,
            "group_layers": which.tolist()}
  return write_trace(schedule, select, geometry, out, source=source, on_step=on_step)
