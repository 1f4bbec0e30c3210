"""``workload.kind: trace``: a recorded or imported selection trace replayed through the
configured memory system, without the model (metadata only: no entry is stored or
moved; ``memory.traces.replay``).

The run reports what a live run reports: per step the system's counters
(``Resolution.stats``: hits, misses, evictions, ...), the capacity report at the peak of
device use, the totals in the summary (``total_hits``, ``hit_rate``, ...,
``run_summary``'s figures), and the bytes the system would have moved. What it needs:

* ``workload.trace``: a trace (``.npz`` or trace directory) or a run directory recorded
  with ``engine.record_trace`` (one trace per dp rank; each rank is replayed on its own
  system and the counts are summed, as a live run sums its ranks);
* the ``model`` section: the KV geometry the trace is of (its layer groups and top-k
  must match the trace; its entry size turns pool sizes in bytes into tokens and counts
  into bytes). No weights are read;
* ``engine.max_batch`` and ``engine.page_size``: the trace's rows and page size;
  ``engine.max_context`` sizes pools left ``null`` as in a live run;
* ``memory``: any system; ``mesh.tp > 1`` gives ula's TP mode (replayed over ``tp``
  devices); ``mesh.dp`` is the number of traces;
* ``workload.trace_replay``: ``fast`` (NumPy models, where there is one) or ``system``.

No model runs: steps take no time and requests generate no tokens (``decode_steps``
counts their steps); ``wall_time_s`` and ``trace.replay_seconds`` are the replay's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from ula_jax.config.schema import ExperimentConfig
from ula_jax.engine.types import RequestResult, RunResult, StepMetrics
from ula_jax.memory.base import CapacityReport
from ula_jax.memory.traces.build import trace_source
from ula_jax.memory.traces.format import (DECODE, META_FILE, PREFILL, SelectionTrace,
                                          TraceError, load_traces, trace_requests)
from ula_jax.memory.traces.replay import Replay, build_rank_system, replay
from ula_jax.memory.traces.sglang import MANIFEST, import_sglang


class TraceWorkloadError(ValueError):
  """A trace that the configured run cannot replay (names the field and what is valid)."""


def _sglang_manifest(path: Path) -> Path | None:
  """The SGLang manifest ``workload.trace`` names (a directory holding one, or the file),
  or None when it names a trace."""
  if path.is_dir() and not (path / META_FILE).is_file() and (path / MANIFEST).is_file():
    return path / MANIFEST
  return path if path.suffix == ".json" and path.is_file() else None


def load_workload_traces(cfg: ExperimentConfig, scratch: str | Path | None = None
                         ) -> list[SelectionTrace]:
  """The traces of ``workload.trace``, checked against the config (TraceWorkloadError).

  An SGLang directory (``manifest.json`` and the requests' ``indexer_topk`` arrays:
  ``traces.sglang``) is imported first into ``scratch`` (a directory the caller removes
  after the replay), with the model's geometry, ``engine.max_batch`` rows,
  ``engine.page_size`` and ``engine.prefill_chunk``."""
  path = cfg.workload.trace
  try:
    manifest = _sglang_manifest(Path(path))
    if manifest is not None:
      if scratch is None:
        raise TraceWorkloadError(f"workload.trace={path!r} is an SGLang manifest: import it "
                                 f"with ula-jax trace import, or replay it with ula-jax run")
      out = import_sglang(manifest, Path(scratch) / "imported", cfg.model.kv_geometry(),
                          max_batch=cfg.engine.max_batch, page_size=cfg.engine.page_size,
                          prefill_chunk=cfg.engine.prefill_chunk)
      traces = [SelectionTrace.load(out)]
    else:
      traces = load_traces(path)
    for t in traces:
      t.validate()
  except TraceWorkloadError:
    raise
  except TraceError as e:
    raise TraceWorkloadError(f"workload.trace={path!r}: {e}") from None
  except ValueError as e:
    raise TraceWorkloadError(f"workload.trace={path!r}: not a valid trace: {e}") from None
  for d, t in enumerate(traces):
    where = f"workload.trace={path!r}" + (f" (rank {d})" if len(traces) > 1 else "")
    if t.page_size != cfg.engine.page_size:
      raise TraceWorkloadError(f"{where} was made with pages of {t.page_size} addresses; "
                               f"set engine.page_size={t.page_size}")
    if t.max_batch != cfg.engine.max_batch:
      raise TraceWorkloadError(f"{where} has {t.max_batch} batch rows; set "
                               f"engine.max_batch={t.max_batch}")
  return traces


def replay_workload(cfg: ExperimentConfig, *, on_progress: Callable[[int, int], None] | None
                    = None) -> RunResult:
  """Replays ``workload.trace`` through ``cfg.memory`` (one system per dp rank).

  on_progress: called with (decode steps replayed, decode steps in all) as it goes
  """
  with tempfile.TemporaryDirectory(prefix="ula-jax-trace-") as scratch:
    traces = load_workload_traces(cfg, scratch)
    imported = Path(scratch) / "imported"
    source = trace_source(imported if imported.exists() else cfg.workload.trace)
    return _replay(cfg, traces, source, on_progress)


def _replay(cfg: ExperimentConfig, traces: list[SelectionTrace], source: dict,
            on_progress) -> RunResult:
  geo = cfg.model.kv_geometry()
  total = sum(t.num_steps for t in traces)
  replays: list[Replay] = []
  done = 0
  for d, trace in enumerate(traces):
    try:
      system = build_rank_system(cfg.memory, geo, tp=cfg.mesh.tp, dp=len(traces),
                                 max_batch=cfg.engine.max_batch,
                                 page_size=cfg.engine.page_size,
                                 max_context=cfg.engine.max_context)
      progress = None if on_progress is None else (
          lambda n, base=done: on_progress(base + n, total))
      replays.append(replay(trace, system, engine=cfg.workload.trace_replay,
                            report_every=cfg.engine.report_every, on_progress=progress,
                            validate=False))  # load_workload_traces checked it
    except ValueError as e:
      raise TraceWorkloadError(f"workload.trace={cfg.workload.trace!r}"
                               + (f" (rank {d})" if len(traces) > 1 else "") + f": {e}") from None
    done += trace.num_steps
  return _result(cfg, traces, replays, system, source)


def _result(cfg: ExperimentConfig, traces, replays: list[Replay], system,
            source: dict) -> RunResult:
  geo = cfg.model.kv_geometry()
  keys = replays[0].stat_keys
  T = max(t.num_steps for t in traces)
  steps: list[StepMetrics] = []
  requests: list[RequestResult] = []
  listed = source.get("requests") if len(traces) == 1 else None  # the importer's ids
  names = [r.get("id") for r in listed if isinstance(r, dict)] if isinstance(listed, list) else []
  for d, (trace, rep) in enumerate(zip(traces, replays)):
    reqs = trace_requests(trace)
    for r in range(reqs.num_requests):
      rid = names[r] if r < len(names) and names[r] else (
          f"req-{r:04d}" if len(traces) == 1 else f"rank{d}-req-{r:04d}")
      status = "finished" if reqs.released[r] else "rejected"
      requests.append(RequestResult(
          id=str(rid), prompt_len=int(reqs.prompt_len[r]), max_new_tokens=int(reqs.steps[r]),
          status=status, output_tokens=[], device=d,
          reason=None if reqs.released[r] else "the trace ends before its release"))
  per_step = [_rank_steps(t, r) for t, r in zip(traces, replays)]
  for i in range(T):
    rows = [p[i] for p in per_step if i < len(p)]
    extra: dict = {}
    for row in rows:
      for k, v in row["extra"].items():
        extra[k] = extra.get(k, 0) + v
    running = sum(row["running"] for row in rows)
    steps.append(StepMetrics(
        step=i, kind="decode", running=running, prefilling=0, waiting=0,
        finished=sum(row["finished"] for row in rows), decode_tokens=running,
        prefill_tokens=sum(row["prefill"] for row in rows),
        # No model ran: no step time, no tokens (the replay's time is the summary's).
        step_time_s=0.0, decode_time_s=0.0, tokens_per_s=0.0,
        device_used=sum(row["device_used"] for row in rows),
        host_used=sum(row["host_used"] for row in rows),
        distinct=sum(row["distinct"] for row in rows),
        admitted=running, extra=extra))
  peaks = [r.peak_report() for r in replays]
  capacity = _combine([p for p in peaks if p is not None])
  wall = sum(r.seconds for r in replays)
  totals = {k: sum(r.totals()[k] for r in replays) for k in keys}
  summary = {
      "memory_system": system.name, "dp": len(traces), "tp": cfg.mesh.tp, "processes": 1,
      "max_batch": cfg.engine.max_batch, "max_context": cfg.engine.max_context,
      "requests": len(requests), "finished": sum(r.status == "finished" for r in requests),
      "rejected": sum(r.status == "rejected" for r in requests), "steps": T,
      "generated_tokens": 0, "decode_steps": int(sum(r.max_new_tokens for r in requests)),
      "wall_time_s": wall, "decode_time_s": 0.0,
      "decode_tokens_per_s": 0.0, "tokens_per_s": 0.0,
      "peak_running": max((m.running for m in steps), default=0),
      "capacity_tokens_per_rank": system.capacity_tokens, "prefill": "trace",
  }
  summary.update({f"total_{k}": v for k, v in totals.items()})
  summary.update(system.run_summary(steps, requests))
  if totals.get("hits", 0) + totals.get("misses", 0):
    summary["hit_rate"] = totals["hits"] / (totals["hits"] + totals["misses"])
  summary["bytes_moved"] = moved_bytes(system.name, keys,
                                       [r.counts for r in replays],
                                       [np.asarray(t.active).sum(axis=1) for t in traces], geo)
  summary["trace"] = {
      "path": str(cfg.workload.trace), "ranks": len(traces),
      "decode_steps": [t.num_steps for t in traces],
      "rows": traces[0].max_batch, "groups": traces[0].num_groups, "top_k": traces[0].top_k,
      "replay": replays[0].engine, "replay_seconds": wall,
      "compile_seconds": sum(r.compile_seconds for r in replays),
      "source": source,
  }
  return RunResult(steps=steps, requests=requests,
                   capacity=capacity.as_dict() if capacity is not None else {},
                   summary=summary, traces=None)


def _rank_steps(trace: SelectionTrace, rep: Replay) -> list[dict]:
  """Per decode step of one rank: rows running, prompt tokens written before it,
  requests finished, counters summed over groups, the capacity last reported."""
  kind, ref, count = np.asarray(trace.kind), np.asarray(trace.ref), np.asarray(trace.count)
  active = np.asarray(trace.active)
  reqs = trace_requests(trace)
  T = trace.num_steps
  prefill = np.zeros((T + 1,), np.int64)
  t_next = 0
  for e in range(kind.shape[0]):
    if kind[e] == DECODE:
      t_next = int(ref[e]) + 1
    elif kind[e] == PREFILL:
      prefill[min(t_next, T)] += int(count[e])
  last = np.full((reqs.num_requests,), -1, np.int64)
  for r in range(reqs.num_requests):
    ts = np.flatnonzero((reqs.step_req == r).any(axis=1))
    last[r] = ts[-1] if ts.size and reqs.released[r] else -1
  finished = np.cumsum(np.bincount(last[last >= 0], minlength=T))[:T] if T else []
  sums = rep.counts.sum(axis=1)  # [T, K]
  out, ri = [], 0
  reports = rep.reports
  for t in range(T):
    while ri + 1 < len(reports) and reports[ri + 1][0] <= t:
      ri += 1
    rpt = reports[ri][1] if reports else None
    out.append({
        "running": int(active[t].sum()), "prefill": int(prefill[t]),
        "finished": int(finished[t]) if T else 0,
        "extra": {k: int(sums[t, i]) for i, k in enumerate(rep.stat_keys)},
        "device_used": int(rpt.device_used.sum()) if rpt is not None else 0,
        "host_used": int(rpt.host_used.sum()) if rpt is not None else 0,
        "distinct": rpt.distinct_total if rpt is not None else 0})
  return out


def _combine(reports: list[CapacityReport]) -> CapacityReport | None:
  """One report of the ranks' reports (their dp axes side by side)."""
  if not reports:
    return None
  if len(reports) == 1:
    return reports[0]
  cat = lambda name: np.concatenate([getattr(r, name) for r in reports], axis=0)
  extra = dict(reports[0].extra)
  for k, v in extra.items():
    if isinstance(v, list) and all(isinstance(r.extra.get(k), list) for r in reports):
      extra[k] = [x for r in reports for x in r.extra[k]]
  first = reports[0]
  return CapacityReport(system=first.system, device_capacity=cat("device_capacity"),
                        device_used=cat("device_used"), host_capacity=cat("host_capacity"),
                        host_used=cat("host_used"), distinct=cat("distinct"),
                        entry_bytes=first.entry_bytes, extra=extra)


def moved_bytes(system: str, keys: tuple[str, ...], counts: list[np.ndarray],
                active_rows: list[np.ndarray], geo) -> dict[str, int]:
  """Bytes the decode steps would have moved into device memory (``fetch``) and out of
  it (``writeback``), from the counters: a group's entry is one row per layer of the
  group.

  ula: fetch = misses (host -> device), writeback = evictions (device -> host, the tiers
  are exclusive); ula TP: fetch = rows delivered between ranks (``xdev_rows``) + the
  owners' host fetches, writeback = their host evictions; hisparse: fetch = misses,
  writeback = every new token written through to the host; far_tier: its far reads and
  writes; resident: none."""
  layers = np.asarray([len(geo.group_layers(g)) for g in range(geo.num_groups)], np.int64)
  rb = geo.row_bytes

  def rows(key: str, per_layer: bool = True) -> int:
    if key not in keys:
      return 0
    i = keys.index(key)
    total = 0
    for c in counts:
      per_group = c[..., i].sum(axis=0)  # [G]
      total += int((per_group * layers).sum()) if per_layer else int(per_group.sum())
    return total

  fetch = write = 0
  if system == "ula" and "xdev_rows" in keys:
    fetch = rows("xdev_rows", per_layer=False) + rows("host_fetches")
    write = rows("host_evictions")
  elif system == "ula":
    fetch, write = rows("misses"), rows("evictions")
  elif system == "hisparse":
    fetch = rows("misses")
    write = int(sum(a.sum() for a in active_rows)) * geo.num_layers
  elif system == "far_tier":
    fetch, write = rows("far_read_rows", per_layer=False), rows("far_write_rows", per_layer=False)
  return {"fetch": fetch * rb, "writeback": write * rb, "row_bytes": rb}
