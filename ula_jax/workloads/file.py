"""Requests read from a request file (format and checks: ``config.request_file``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ula_jax.config.request_file import WorkloadError, read_records
from ula_jax.engine.types import Request
from ula_jax.workloads.synthetic import zipf_tokens


def file_requests(path: str | Path, vocab_size: int, seed: int = 0) -> list[Request]:
  """Requests of the file, in file order. Synthetic prompts (``prompt_len``) come from
  ``seed`` and the request's position in the file."""
  ranking = np.random.default_rng(seed).permutation(vocab_size)
  requests = []
  for i, (where, rec) in enumerate(read_records(path)):
    if "prompt" in rec:
      # Checked as Python ints: an id past int64 (10**30) would stop numpy's conversion
      # with an OverflowError that names no file, line or field.
      bad = next((t for t in rec["prompt"] if not 0 <= t < vocab_size), None)
      if bad is not None:
        raise WorkloadError(f"{where}: field 'prompt' has token id {bad} outside "
                            f"[0, {vocab_size}) (model.vocab_size={vocab_size})")
      prompt = np.asarray(rec["prompt"], np.int32)
    else:
      rng = np.random.default_rng([seed, i])
      prompt = zipf_tokens(rng, rec["prompt_len"], vocab_size, ranking=ranking)
    requests.append(Request(id=rec["id"], prompt=prompt, max_new_tokens=rec["max_new_tokens"],
                            arrival_step=rec["arrival_step"]))
  return requests
