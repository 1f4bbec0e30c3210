"""Run statistics derived from a RunResult (the numbers the tables, sweeps and plots show)."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from ula_jax.engine.types import RequestResult, RunResult, StepMetrics

# Keys of ``run_stats`` in table order, with their labels.
STAT_LABELS: dict[str, str] = {
    "requests": "requests",
    "finished": "finished",
    "rejected": "rejected",
    "interrupted": "interrupted",
    "tokens_generated": "tokens generated",
    "wall_time_s": "wall time (s)",
    "tokens_per_s": "tokens/s (wall)",
    "decode_tokens_per_s": "decode tokens/s",
    "peak_batch": "peak running batch",
    "peak_device_used": "peak device slots used",
    "device_capacity": "device slots",
    "peak_host_used": "peak host slots used",
    "host_capacity": "host slots",
    "distinct_fraction": "distinct fraction",
    "mean_ttft_s": "mean TTFT (s)",
    "mean_tpot_s": "mean TPOT (s)",
    "steps": "engine steps",
}


def _total(x: Any) -> int | None:
  """Sum of a (nested) list of counts, e.g. ``capacity['device_capacity']`` ([dp, tp])."""
  if x is None:
    return None
  return int(np.asarray(x).sum())


def aggregate_extra(steps: Sequence[StepMetrics]) -> dict[str, float]:
  """System counters of ``StepMetrics.extra`` over the run: integer counters summed,
  other numbers averaged over the steps that report them; ``hit_rate`` =
  hits / (hits + misses) when both are counted."""
  sums: dict[str, float] = {}
  counts: dict[str, int] = {}
  integral: dict[str, bool] = {}
  for m in steps:
    for k, v in m.extra.items():
      if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        continue
      sums[k] = sums.get(k, 0) + v
      counts[k] = counts.get(k, 0) + 1
      integral[k] = integral.get(k, True) and isinstance(v, (int, np.integer))
  out: dict[str, float] = {}
  for k in sums:
    out[k] = int(sums[k]) if integral[k] else float(sums[k] / counts[k])
  if "hits" in out and "misses" in out and "hit_rate" not in out:
    looked_up = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / looked_up if looked_up else 1.0
  if "drafted" in out and "accepted" in out and "acceptance_rate" not in out:
    # speculative.num_draft: the share of the verified drafts that were accepted
    out["acceptance_rate"] = out["accepted"] / out["drafted"] if out["drafted"] else 0.0
  return out


def _mean(values: list[float]) -> float | None:
  return float(np.mean(values)) if values else None


def run_stats(result: RunResult) -> dict[str, Any]:
  """Totals of a run: request counts, tokens, throughput, peak batch and slots,
  distinct fraction, latencies, then every system counter (``aggregate_extra``)."""
  steps, reqs = result.steps, result.requests
  finished = [r for r in reqs if r.status == "finished"]
  tokens = sum(len(r.output_tokens) for r in reqs)
  wall = result.summary.get("wall_time_s")
  if wall is None:
    wall = sum(m.step_time_s for m in steps)
  decode_time = sum(m.decode_time_s for m in steps)
  decode_tokens = sum(m.decode_tokens for m in steps)
  cap = result.capacity or {}
  stats: dict[str, Any] = {
      "requests": len(reqs),
      "finished": len(finished),
      "rejected": sum(r.status == "rejected" for r in reqs),
      "interrupted": sum(r.status == "interrupted" for r in reqs),
      "tokens_generated": tokens,
      "wall_time_s": float(wall),
      "tokens_per_s": tokens / wall if wall > 0 else 0.0,
      "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else 0.0,
      "peak_batch": max((m.running for m in steps), default=0),
      "peak_device_used": max((m.device_used for m in steps), default=0),
      "device_capacity": _total(cap.get("device_capacity")),
      "peak_host_used": max((m.host_used for m in steps), default=0),
      "host_capacity": _total(cap.get("host_capacity")),
      "distinct_fraction": cap.get("distinct_fraction"),
      "mean_ttft_s": _mean([r.ttft_s for r in finished if r.ttft_s is not None]),
      "mean_tpot_s": _mean([r.decode_time_s / len(r.output_tokens) for r in finished
                            if r.decode_time_s is not None and r.output_tokens]),
      "steps": len(steps),
  }
  stats.update({k: v for k, v in aggregate_extra(steps).items() if k not in stats})
  if "drafted" in stats:  # speculative decoding: tokens a request gains per verify step
    verified = sum(m.running for m in steps if m.decode_tokens)
    stats["tokens_per_verify_step"] = decode_tokens / verified if verified else 0.0
  return stats


def prompt_sha1(prompt: Any) -> str:
  """SHA-1 of a prompt's token ids as little-endian int32: two runs served the same
  prompt exactly when these agree."""
  tokens = np.ascontiguousarray(np.asarray(prompt), dtype="<i4")
  return hashlib.sha1(tokens.tobytes()).hexdigest()


def request_record(r: RequestResult, prompt: Any = None) -> dict[str, Any]:
  """What ``summary.json`` keeps of a request: enough to compare two runs token by token.

  prompt: the request's prompt tokens, for ``prompt_sha1`` (None: not known, null)
  """
  return {"id": r.id, "prompt_len": r.prompt_len,
          "prompt_sha1": None if prompt is None else prompt_sha1(prompt),
          "max_new_tokens": r.max_new_tokens, "status": r.status, "reason": r.reason,
          "output_tokens": [int(t) for t in r.output_tokens]}
