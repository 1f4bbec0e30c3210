"""Workloads: the requests an experiment serves (synthetic or from a file), or a
selection trace it replays without the model (``trace.py``)."""

from __future__ import annotations

from ula_jax.config.schema import ExperimentConfig
from ula_jax.engine.types import Request
from ula_jax.config.request_file import WorkloadError, file_lengths, read_records
from ula_jax.workloads.file import file_requests
from ula_jax.workloads.synthetic import arrival_steps, synthetic_requests, zipf_tokens


def build_requests(cfg: ExperimentConfig) -> list[Request]:
  """The requests of ``cfg.workload`` with token ids in ``[0, model.vocab_size)``."""
  wl = cfg.workload
  if wl.kind == "synthetic":
    return synthetic_requests(wl, cfg.model.vocab_size)
  if wl.kind == "file":
    return file_requests(wl.path, cfg.model.vocab_size, seed=wl.seed)
  if wl.kind == "trace":
    raise ValueError("workload.kind='trace' serves no requests through the engine: its trace "
                     "replays through the memory system (ula_jax.workloads.trace, ula-jax run)")
  raise ValueError(f"workload.kind={wl.kind!r}: expected one of ['synthetic', 'file', 'trace']")


__all__ = ["WorkloadError", "arrival_steps", "build_requests", "file_lengths",
           "file_requests", "read_records", "synthetic_requests", "zipf_tokens"]
