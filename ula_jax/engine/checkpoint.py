"""Checkpoints of a run in progress, from which ``ula-jax run --resume`` continues.

A run with ``engine.checkpoint_every = N > 0`` keeps its latest checkpoint in its run
directory::

    RUN/checkpoint/step-00000123/     the engine as it stood before step 123
        state/                        the memory system's state and the prefill workspace
                                      (orbax): every leaf but the pools below; each comes
                                      back with the sharding and memory kind (device,
                                      pinned_host) of the live one
        pools/leaf_0007/shard-00000.bin  the pools: every leaf in host memory and every
                                      leaf of STREAMED_BYTES or more, one raw file per
                                      shard, moved in bounded chunks
                                      (``core.shard_files``): orbax would copy each shard
                                      whole into host memory, and a 100 GiB host pool
                                      would need another 100 GiB of RAM. A host pool is
                                      restored into the live pool in place
        engine.json                   the host side (``RunState``): queued, running and
                                      finished requests with their tokens, decode rows,
                                      page tables and free pages, the step, the metrics and
                                      totals so far; the config and the requests' digests

A checkpoint is written into a hidden folder and renamed into place; only then are the
older ones removed, so the highest ``step-*`` folder is always a whole checkpoint.

A resumed run decodes the tokens the uninterrupted run would have: the device state is
restored bit for bit, the scheduler exactly (the free-page lists in their order). Its
metrics go on from the checkpoint's: steps, totals, tokens, ``wall_time_s`` and each
request's ``ttft_s`` / ``decode_time_s`` count the time run before and after, not the time
in between; ``compilation`` counts the resumed process only.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from ula_jax.config.schema import ExperimentConfig
from ula_jax.core import pinned_region, shard_files
from ula_jax.core.serialize import dumps
from ula_jax.core.addressing import PageAllocator
from ula_jax.engine.engine import Engine, RunState, _Live
from ula_jax.engine.types import Request, RequestResult, StepMetrics
from ula_jax.memory.base import CapacityReport

CHECKPOINT_DIR = "checkpoint"  # in the run directory
STATE_DIR = "state"
POOLS_DIR = "pools"
HOST_FILE = "engine.json"
FORMAT = 2
READS_FORMATS = (1, 2)  # 1: every leaf through orbax
STREAMED_BYTES = 256 << 20
"""Device-memory leaves of at least this many bytes are written as shard files, not
through orbax (leaves in host memory always are)."""
_STEP_DIR = re.compile(r"step-(\d+)")

RESUMABLE_FIELDS = ("engine.max_steps", "engine.progress", "engine.report_every",
                    "engine.checkpoint_every", "engine.pack_state", "engine.compilation_cache",
                    "engine.compilation_cache_dir", "experiment.plots",
                    "experiment.description", "experiment.out_dir")
"""Config fields a resumed run may change: they change neither the state nor the tokens.
Every other field must be the checkpoint's."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be resumed (the message names it and why)."""


# ----------------------------------------------------------------------------------
# Where checkpoints are
# ----------------------------------------------------------------------------------


def latest(root: str | Path) -> Path | None:
  """The newest whole checkpoint under ``root`` (``RUN/checkpoint``), or None."""
  root = Path(root)
  if not root.is_dir():
    return None
  found = [(int(m.group(1)), p) for p in root.iterdir()
           if (m := _STEP_DIR.fullmatch(p.name)) and (p / HOST_FILE).is_file()]
  return max(found)[1] if found else None


def step_of(path: str | Path) -> int:
  """The engine step a checkpoint folder continues from (``step-00000123`` -> 123)."""
  return int(_STEP_DIR.fullmatch(Path(path).name).group(1))


# ----------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------


def save(engine: Engine, root: str | Path) -> Path:
  """Writes a checkpoint of ``engine``'s run (between two steps) under ``root`` and
  removes the older ones; returns its folder. One of this step already there is kept.

  Synchronous: the state's buffers are donated to the next step, so every byte is
  written before this returns.
  """
  rs = engine.run_state
  if not rs.at_boundary:
    raise CheckpointError("a checkpoint is taken between engine steps; the engine is "
                          "inside one")
  root = Path(root)
  final = root / f"step-{rs.step:08d}"
  if not (final / HOST_FILE).is_file():
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
      import orbax.checkpoint as ocp  # (only runs that checkpoint import it)

      names, leaves, paths, _ = _flat_device_state(engine)
      streamed = [_streamed(x) for x in leaves]
      files = {n: shard_files.save(x, tmp / POOLS_DIR / n)
               for n, x, s in zip(names, leaves, streamed) if s}
      rest = {n: x for n, x, s in zip(names, leaves, streamed) if not s}
      if rest:
        ocp.Checkpointer(ocp.StandardCheckpointHandler()).save(
            tmp / STATE_DIR, args=ocp.args.StandardSave(rest))
      doc = _host_doc(engine, rs)
      doc["device_leaves"] = [{"path": p, "shape": list(x.shape), "dtype": str(x.dtype)}
                              for p, x in zip(paths, leaves)]
      doc["pool_files"] = files
      (tmp / HOST_FILE).write_text(dumps(doc) + "\n")
      shutil.rmtree(final, ignore_errors=True)  # (a folder of that name left incomplete)
      os.rename(tmp, final)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
  for old in root.iterdir():  # older checkpoints, and leftovers of interrupted writes
    m = _STEP_DIR.fullmatch(old.name)
    if (m and int(m.group(1)) != rs.step) or old.name.startswith(".tmp-"):
      shutil.rmtree(old, ignore_errors=True)
  return final


def _streamed(x: jax.Array) -> bool:
  """Whether leaf ``x`` is written as shard files (else through orbax)."""
  return shard_files.in_host_memory(x) or x.size * x.dtype.itemsize >= STREAMED_BYTES


def _flat_device_state(engine: Engine) -> tuple[list[str], list[jax.Array], list[str], Any]:
  """The device side of a run as orbax leaf names, leaves, their pytree paths and the
  tree's structure."""
  tree = {"memory": engine.state, "workspace": engine.workspace}
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  names = [f"leaf_{i:04d}" for i in range(len(flat))]
  return names, [x for _, x in flat], [jax.tree_util.keystr(p) for p, _ in flat], treedef


def _host_doc(engine: Engine, rs: RunState) -> dict:
  now = time.perf_counter()
  return {
      "format": FORMAT,
      "step": rs.step,
      "config": engine.cfg.model_dump(mode="json"),
      "requests": [request_digest(r) for r in rs.requests],
      "pending": [r.id for r in rs.pending],
      "queue": [r.id for r in rs.queue],
      "rows": [[None if l is None else _live_doc(l, now) for l in rank] for rank in rs.rows],
      # Each rank's free pages in order (the next ones handed out come last).
      "free_pages": [{"num_pages": a.num_pages, "free": list(a._free)} for a in rs.alloc],
      "results": [r.as_dict() for r in rs.results.values()],
      "steps": [dataclasses.asdict(m) for m in rs.steps],
      "totals": dict(rs.totals),
      "finished_count": rs.finished_count,
      "peak_device_used": rs.peak["device_used"],
      "peak_report": _report_doc(rs.peak["report"]),
      "last_report": _report_doc(rs.last_report),
      "elapsed_s": rs.elapsed_s,
      "callback_s": rs.callback_s,
      "resumed_at": list(rs.resumed_at),
      "try_speculate": engine._try_speculate,
  }


def request_digest(r: Request) -> dict:
  """What identifies a request: a resumed run must be given the same ones."""
  prompt = np.ascontiguousarray(np.asarray(r.prompt, np.int32))
  return {"id": r.id, "prompt_len": r.prompt_len,
          "prompt_sha1": hashlib.sha1(prompt.tobytes()).hexdigest(),
          "max_new_tokens": r.max_new_tokens, "arrival_step": r.arrival_step}


def _live_doc(l: _Live, now: float) -> dict:
  return {"id": l.req.id, "device": l.device, "row": l.row, "pages": l.pages.tolist(),
          "admitted_step": l.admitted_step, "admitted_age_s": now - l.admitted_time,
          "prefilled": l.prefilled, "generated": list(l.generated),
          "drafts": list(l.drafts), "first_token_step": l.first_token_step, "ttft_s": l.ttft_s,
          "decode_time_s": l.decode_time_s}


_REPORT_ARRAYS = ("device_capacity", "device_used", "host_capacity", "host_used", "distinct")


def _report_doc(rep: CapacityReport | None) -> dict | None:
  if rep is None:
    return None
  return {"system": rep.system, "entry_bytes": rep.entry_bytes, "extra": rep.extra,
          **{f: {"dtype": str(getattr(rep, f).dtype), "value": getattr(rep, f).tolist()}
             for f in _REPORT_ARRAYS}}


# ----------------------------------------------------------------------------------
# Reading and restoring
# ----------------------------------------------------------------------------------


def read_host(path: str | Path) -> dict:
  """The host side of the checkpoint in folder ``path`` (CheckpointError naming the file
  when it is missing, unreadable or of another format)."""
  file = Path(path) / HOST_FILE
  try:
    doc = json.loads(file.read_text())
  except FileNotFoundError:
    raise CheckpointError(f"{file}: missing; not a checkpoint") from None
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{file}: unreadable ({e})") from None
  if not isinstance(doc, dict) or doc.get("format") not in READS_FORMATS:
    got = doc.get("format") if isinstance(doc, dict) else None
    raise CheckpointError(f"{file}: format={got!r}, this version reads format "
                          f"{' or '.join(map(str, READS_FORMATS))}")
  return doc


def config_changes(saved: dict, cfg: ExperimentConfig) -> list[str]:
  """One line per field of ``cfg`` that differs from the checkpoint's config ``saved``
  (``read_host(...)["config"]``) and that a resumed run may not change."""
  old, new = _dotted(saved), _dotted(cfg.model_dump(mode="json"))
  # (a field only one side knows is one this version added or dropped: not a change)
  return [f"{k}={new[k]!r}, but the checkpointed run has {k}={old[k]!r}"
          for k in sorted(set(old) & set(new))
          if old[k] != new[k] and k not in RESUMABLE_FIELDS]


def _dotted(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out: dict[str, Any] = {}
  for k, v in tree.items():
    out.update(_dotted(v, f"{prefix}.{k}" if prefix else str(k)))
  return out


def request_changes(saved: dict, requests: Sequence[Request]) -> list[str]:
  """The first differences between the checkpoint's requests and ``requests``."""
  old = saved["requests"]
  new = [request_digest(r) for r in requests]
  if len(old) != len(new):
    return [f"{len(new)} requests, but the checkpointed run has {len(old)}"]
  out = []
  for o, n in zip(old, new):
    if o != n:
      diff = ", ".join(f"{k} {n[k]!r} (was {o[k]!r})" for k in o if o[k] != n.get(k))
      out.append(f"request {o['id']!r}: {diff}")
  return out[:3]


def restore(engine: Engine, path: str | Path, requests: Sequence[Request]) -> RunState:
  """Puts the checkpoint in folder ``path`` back into ``engine`` (built from the run's
  config) and returns the run state to pass to ``engine.run(requests, resume=...)``.

  ``requests`` must be the checkpointed run's (ids, prompts, lengths, arrivals) and
  the engine's state must have the checkpoint's leaves (CheckpointError otherwise).
  Each leaf is read into the sharding and memory kind of the live one: a leaf in host
  memory written as shard files is filled in place; every other leaf's buffers are
  freed first. A pool is never held twice.
  """
  path = Path(path)
  doc = read_host(path)
  problems = request_changes(doc, requests)
  if problems:
    raise CheckpointError(f"{path}: the workload's requests differ from the checkpointed "
                          f"run's: {'; '.join(problems)}")
  try:
    run_state = _run_state(doc, requests)
    saved_leaves = doc["device_leaves"]
    files = doc.get("pool_files", {})  # (none in format 1)
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"{path / HOST_FILE}: unreadable ({type(e).__name__}: {e})") from None
  names, leaves, paths, treedef = _flat_device_state(engine)
  want = [{"path": p, "shape": list(x.shape), "dtype": str(x.dtype)}
          for p, x in zip(paths, leaves)]
  if want != saved_leaves:
    diff = next((f"{w} vs {s}" for w, s in zip(want, saved_leaves) if w != s),
                f"{len(want)} leaves vs {len(saved_leaves)}")
    raise CheckpointError(f"{path}: the memory system's state is laid out unlike the "
                          f"checkpoint's (live vs saved: {diff})")
  in_place = [n in files and shard_files.in_host_memory(x) for n, x in zip(names, leaves)]
  # The carry (the state as the steps take it) holds the state's own leaves, and with
  # engine.pack_state packed copies of the others.
  from_files = {id(x) for n, x in zip(names, leaves) if n in files}
  carry = [x for x in jax.tree.leaves(engine.carry) if id(x) not in from_files]
  # A pool filled in place must own its buffers: no other array may share them, or
  # filling it would change that one too.
  pointers = pinned_region.buffer_pointers
  owned = [p for x, keep in zip(leaves, in_place) if keep for p in pointers(x)]
  others = {p for x, keep in zip(leaves, in_place) if not keep for p in pointers(x)}
  others.update(p for x in carry for p in pointers(x))
  if len(set(owned)) != len(owned) or others & set(owned):
    raise CheckpointError(f"{path}: the live state's host pools share buffers with other "
                          "leaves; they cannot be restored in place")
  try:  # every pool's files, before anything is deleted
    for n, x in zip(names, leaves):
      if n in files:
        shard_files.check(x, path / POOLS_DIR / n, files[n])
  except shard_files.ShardFileError as e:
    raise CheckpointError(str(e)) from None
  abstract = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
              for n, x in zip(names, leaves) if n not in files}
  import orbax.checkpoint as ocp  # (only runs that checkpoint import it)

  # Leaves read back from shard files are deleted by the restore, one at a time (or
  # filled in place); every other buffer goes now.
  for x in [*carry, *(x for n, x in zip(names, leaves) if n not in files)]:
    if not x.is_deleted():
      x.delete()
  # Host pools on regions of this process (memory.host_alloc) that the deleted leaves
  # held are given back now, not when the next pool is made.
  pinned_region.release_unused()
  restored = {n: shard_files.restore(x, path / POOLS_DIR / n, files[n])
              for n, x in zip(names, leaves) if n in files}
  if abstract:
    restored.update(ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
        path / STATE_DIR, args=ocp.args.StandardRestore(abstract)))
  tree = jax.tree.unflatten(treedef, [restored[n] for n in names])
  engine.state, engine.workspace = tree["memory"], tree["workspace"]
  engine._try_speculate = bool(doc.get("try_speculate", True))
  return run_state


def _run_state(doc: dict, requests: Sequence[Request]) -> RunState:
  by_id = {r.id: r for r in requests}
  now = time.perf_counter()

  def live(d: dict | None) -> _Live | None:
    if d is None:
      return None
    return _Live(by_id[d["id"]], d["device"], d["row"], np.asarray(d["pages"], np.int32),
                 d["admitted_step"], now - d["admitted_age_s"], prefilled=d["prefilled"],
                 generated=list(d["generated"]), drafts=list(d.get("drafts", [])),
                 first_token_step=d["first_token_step"],
                 ttft_s=d["ttft_s"], decode_time_s=d["decode_time_s"])

  alloc = []
  for d in doc["free_pages"]:
    a = PageAllocator(d["num_pages"])
    a._free = [int(p) for p in d["free"]]
    alloc.append(a)
  return RunState(
      requests=list(requests),
      pending=collections.deque(by_id[i] for i in doc["pending"]),
      queue=collections.deque(by_id[i] for i in doc["queue"]),
      rows=[[live(d) for d in rank] for rank in doc["rows"]],
      alloc=alloc,
      results={d["id"]: RequestResult(**d) for d in doc["results"]},
      steps=[StepMetrics(**d) for d in doc["steps"]],
      totals=collections.Counter(doc["totals"]),
      step=doc["step"], finished_count=doc["finished_count"],
      peak={"device_used": doc["peak_device_used"],
            "report": _report_of(doc["peak_report"])},
      last_report=_report_of(doc["last_report"]), elapsed_s=doc["elapsed_s"],
      callback_s=doc.get("callback_s", 0.0),  # (not in format 1)
      resumed_at=[*doc["resumed_at"], doc["step"]])


def _report_of(d: dict | None) -> CapacityReport | None:
  if d is None:
    return None
  arrays = {f: np.asarray(d[f]["value"], d[f]["dtype"]) for f in _REPORT_ARRAYS}
  return CapacityReport(system=d["system"], entry_bytes=d["entry_bytes"], extra=d["extra"],
                        **arrays)
