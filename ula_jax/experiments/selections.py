"""A trained model's selections, per request, and traces built from them at any batch.

A recorded trace (``engine.record_trace``) is one dp rank's events at the batch it was
recorded with. The experiments that ask "against batch" or "against pool size" need the
same requests' selections served at other batches, so the file they read keeps each
request's selections by *position*, not by logical address:

``Selections`` (``.npz``)::

    prompt_len [R] int32         prompt tokens of request r
    positions  [R, T, G, k] uint16  the positions request r's decode step t selected in
                                 layer group g, ascending (``NONE`` last, where fewer
                                 than k); the step's new token is at position
                                 ``prompt_len[r] + t``. Stored as differences along k
                                 (``positions_delta``): a third of the bytes compressed
    num_layers, group_size, entry_width, index_dim, kv_dtype: the KV geometry
    source_json                  how it was recorded

``from_trace`` makes one from a recorded trace (positions from the trace's own prefill
and decode events); ``build`` serves ``n`` requests (request ``i`` replays recorded
request ``i mod R``) on ``batch`` rows with ``plan_schedule`` and writes the trace
(``write_trace``). A position fits in 16 bits: the recorded contexts are below 64K.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from ula_jax.core.types import KVGeometry

NONE = np.iinfo(np.uint16).max


@dataclasses.dataclass(frozen=True)
class Selections:
  prompt_len: np.ndarray  # [R] int32
  positions: np.ndarray  # [R, T, G, k] uint16
  num_layers: int
  group_size: int
  entry_width: int
  index_dim: int
  kv_dtype: str
  source: dict

  @property
  def num_requests(self) -> int:
    return int(self.positions.shape[0])

  @property
  def num_steps(self) -> int:
    return int(self.positions.shape[1])

  @property
  def num_groups(self) -> int:
    return int(self.positions.shape[2])

  @property
  def top_k(self) -> int:
    return int(self.positions.shape[3])

  def geometry(self) -> KVGeometry:
    return KVGeometry(num_layers=self.num_layers, group_size=self.group_size,
                      entry_width=self.entry_width, index_dim=self.index_dim,
                      top_k=self.top_k, kv_dtype=self.kv_dtype)

  def subset(self, *, steps: int | None = None, groups: Sequence[int] | None = None
             ) -> Selections:
    """The first ``steps`` decode steps of each request, and only layer groups
    ``groups`` (their layers: a model of ``len(groups) x group_size`` layers)."""
    pos = self.positions
    if steps is not None:
      if not 1 <= steps <= self.num_steps:
        raise ValueError(f"steps={steps}: the selections have 1..{self.num_steps} decode "
                         "steps per request")
      pos = pos[:, :steps]
    layers = self.num_layers
    if groups is not None:
      bad = [g for g in groups if not 0 <= g < self.num_groups]
      if bad or not groups or len(set(groups)) != len(groups):
        raise ValueError(f"groups={list(groups)}: expected distinct layer groups in "
                         f"0..{self.num_groups - 1}")
      pos = pos[:, :, list(groups)]
      layers = len(groups) * self.group_size
    return dataclasses.replace(self, positions=pos, num_layers=layers)

  def save(self, path: str | Path) -> Path:
    path = Path(path)
    pos = np.sort(self.positions.astype(np.int32), axis=-1)
    delta = np.diff(pos, axis=-1, prepend=0).astype(np.uint16)
    np.savez_compressed(path, prompt_len=self.prompt_len.astype(np.int32),
                        positions_delta=delta,
                        num_layers=self.num_layers, group_size=self.group_size,
                        entry_width=self.entry_width, index_dim=self.index_dim,
                        kv_dtype=np.asarray(self.kv_dtype),
                        source_json=np.asarray(json.dumps(self.source)))
    return path

  @classmethod
  def load(cls, path: str | Path) -> Selections:
    path = Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"selections file not found: {path} (experiments/traces/"
                              f"README.md says how to record it)")
    with np.load(path) as z:
      missing = [f for f in ("prompt_len", "positions_delta", "num_layers")
                 if f not in z.files]
      if missing:
        raise ValueError(f"{path}: not a selections file (no {', '.join(missing)})")
      positions = np.cumsum(z["positions_delta"].astype(np.int32), axis=-1).astype(np.uint16)
      return cls(prompt_len=z["prompt_len"].astype(np.int32), positions=positions,
                 num_layers=int(z["num_layers"]), group_size=int(z["group_size"]),
                 entry_width=int(z["entry_width"]), index_dim=int(z["index_dim"]),
                 kv_dtype=str(z["kv_dtype"]), source=json.loads(str(z["source_json"])))


def from_trace(trace, source: dict | None = None, steps: int | None = None) -> Selections:
  """The selections of a recorded ``SelectionTrace`` by request and position: requests
  in the order their prompts were first written, each one's positions from its prefill
  addresses (in order) and its decode steps' new tokens. Requests are kept up to the
  fewest decode steps any of them made (or ``steps``)."""
  from ula_jax.memory.traces.format import DECODE, PREFILL, RELEASE

  N = trace.num_logical
  pos_of = np.full((N,), -1, np.int64)
  row_req = {}  # row -> request index
  prompt: list[int] = []
  sels: list[list[np.ndarray]] = []
  kind, ref, row = np.asarray(trace.kind), np.asarray(trace.ref), np.asarray(trace.row)
  written = []  # positions written per request so far
  for e in range(kind.shape[0]):
    if kind[e] == PREFILL:
      b = int(row[e])
      if b not in row_req:
        row_req[b] = len(prompt)
        prompt.append(0)
        sels.append([])
        written.append(0)
      r = row_req[b]
      a = trace.event_addrs(e).astype(np.int64)
      pos_of[a] = written[r] + np.arange(a.shape[0])
      written[r] += a.shape[0]
      prompt[r] = written[r]
    elif kind[e] == RELEASE:
      pos_of[trace.event_addrs(e).astype(np.int64)] = -1
      row_req.pop(int(row[e]), None)
    elif kind[e] == DECODE:
      t = int(ref[e])
      act = np.asarray(trace.active[t])
      new = np.asarray(trace.new_addr[t]).astype(np.int64)
      sel = np.asarray(trace.sel_addr[t]).astype(np.int64)  # [G, B, k]
      ok = np.asarray(trace.sel_valid[t]) & (sel >= 0)
      for b in np.flatnonzero(act):
        r = row_req[int(b)]
        pos_of[new[b]] = written[r]
        written[r] += 1
        p = np.where(ok[:, b], pos_of[np.where(ok[:, b], sel[:, b], 0)], -1)
        sels[r].append(np.where(p >= 0, p, NONE).astype(np.uint16))
  if not sels:
    raise ValueError("the trace has no request")
  T = min(len(s) for s in sels) if steps is None else steps
  if T < 1 or any(len(s) < T for s in sels):
    raise ValueError(f"every request needs {max(T, 1)} decode steps; they made "
                     f"{[len(s) for s in sels]}")
  positions = np.sort(np.stack([np.stack(s[:T]) for s in sels]), axis=-1)
  if int(np.asarray(prompt).max()) + T >= NONE:
    raise ValueError("contexts of 64K tokens or more do not fit 16-bit positions")
  return Selections(prompt_len=np.asarray(prompt, np.int32), positions=positions,
                    num_layers=trace.num_layers, group_size=trace.group_size,
                    entry_width=trace.entry_width, index_dim=trace.index_dim,
                    kv_dtype=trace.kv_dtype, source=dict(source or {}))


def build(sel: Selections, out: str | Path, *, requests: int, batch: int, page_size: int = 64,
          prefill_chunk: int = 4096) -> Path:
  """Writes the trace of ``requests`` requests (request ``i`` replays recorded request
  ``i mod R``: its prompt length and selections) served on ``batch`` rows (``.npz``)."""
  from ula_jax.memory.traces.build import plan_schedule, write_trace

  src = np.arange(requests) % sel.num_requests
  prompt = sel.prompt_len[src]
  sched = plan_schedule(prompt, np.full((requests,), sel.num_steps), max_batch=batch,
                        page_size=page_size, prefill_chunk=prefill_chunk)
  G, k = sel.num_groups, sel.top_k

  def select(t: int, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
    del t
    out_ = np.full((G, req.shape[0], k), -1, np.int64)
    for b in np.flatnonzero(req >= 0):
      r = int(req[b])
      p = sel.positions[src[r], int(pos[b]) - int(prompt[r])].astype(np.int64)
      out_[:, b] = np.where(p == NONE, -1, p)
    return out_

  return write_trace(sched, select, sel.geometry(), out,
                     source={"selections": sel.source, "requests": requests,
                             "batch": batch})


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m ula_jax.experiments.selections RUN_DIR_OR_TRACE OUT.npz [--steps N]``:
  the selections file of a recorded run (``engine.record_trace``, one dp rank)."""
  import argparse

  from ula_jax.memory.traces import load_traces

  p = argparse.ArgumentParser(prog="python -m ula_jax.experiments.selections",
                              description=main.__doc__.split("\n\n")[0])
  p.add_argument("trace", help="a recorded run directory (trace_rank0.npz) or a trace")
  p.add_argument("out", help="the selections file to write (.npz)")
  p.add_argument("--steps", type=int, default=None,
                 help="decode steps kept per request (default: the fewest any made)")
  args = p.parse_args(argv)
  traces = load_traces(args.trace)
  if len(traces) != 1:
    p.error(f"{args.trace} holds {len(traces)} traces (dp ranks); record with mesh.dp=1")
  source = {"recorded": Path(args.trace).name}
  cfg_file = Path(args.trace) / "config.yaml"
  if cfg_file.is_file():  # a run directory: what served the requests
    import yaml
    cfg = yaml.safe_load(cfg_file.read_text())
    source.update(checkpoint=cfg["model"].get("checkpoint"), requests=cfg["workload"].get(
        "path"), max_batch=cfg["engine"]["max_batch"],
        prefill_chunk=cfg["engine"]["prefill_chunk"], memory=cfg["memory"]["system"])
  sel = from_trace(traces[0], source=source, steps=args.steps)
  path = sel.save(args.out)
  print(f"wrote {path}: {sel.num_requests} requests (prompts {sel.prompt_len.tolist()}), "
        f"{sel.num_steps} decode steps, {sel.num_groups} layer groups, top-k {sel.top_k}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
