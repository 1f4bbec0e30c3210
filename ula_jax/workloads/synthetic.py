"""Seeded synthetic requests shaped like long-document summarisation: long prompts,
short outputs, token ids drawn from a Zipf-like distribution over the vocabulary."""

from __future__ import annotations

import numpy as np

from ula_jax.config.schema import WorkloadConfig
from ula_jax.engine.types import Request

ZIPF_EXPONENT = 1.1  # word frequencies in natural text fall off roughly as 1 / rank


def zipf_tokens(rng: np.random.Generator, n: int, vocab_size: int,
                exponent: float = ZIPF_EXPONENT, ranking: np.ndarray | None = None) -> np.ndarray:
  """[n] int32 token ids; id ``ranking[r]`` has probability proportional to
  ``1 / (r + 1) ** exponent`` (``ranking``: a permutation of the vocabulary, so the
  frequent ids are spread over it; identity when None)."""
  if vocab_size < 1:
    raise ValueError(f"vocab_size={vocab_size}: must be >= 1")
  weights = 1.0 / np.arange(1, vocab_size + 1, dtype=np.float64) ** exponent
  cdf = np.cumsum(weights)
  cdf /= cdf[-1]
  ranks = np.searchsorted(cdf, rng.random(n), side="right")
  ranks = np.minimum(ranks, vocab_size - 1)
  ids = ranks if ranking is None else ranking[ranks]
  return ids.astype(np.int32)


def arrival_steps(rng: np.random.Generator, n: int, kind: str, rate: float) -> np.ndarray:
  """[n] int64 engine steps at which requests arrive (non-decreasing, first at 0).

  'all_at_once': every request at step 0. 'poisson': exponential gaps of mean
  ``1 / rate`` steps after the first request.
  """
  if kind == "all_at_once":
    return np.zeros(n, np.int64)
  if kind == "poisson":
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.floor(np.cumsum(gaps)).astype(np.int64)
  raise ValueError(f"workload.arrival={kind!r}: expected one of ['all_at_once', 'poisson']")


def synthetic_requests(wcfg: WorkloadConfig, vocab_size: int) -> list[Request]:
  """``wcfg.num_requests`` requests, a pure function of ``wcfg`` and ``vocab_size``.

  Prompt lengths are uniform over ``prompt_len * length_scale`` and output lengths over
  ``output_len * output_scale`` (ends included, each at least 1). Lengths, arrivals and
  each request's tokens come from separate seed streams, so a request's lengths do not
  change with the vocabulary and its tokens do not change with the other requests.
  """
  n = wcfg.num_requests
  lengths_ss, arrival_ss, ranking_ss, tokens_ss = np.random.SeedSequence(wcfg.seed).spawn(4)
  lengths_rng = np.random.default_rng(lengths_ss)
  (p_lo, p_hi), (o_lo, o_hi) = wcfg.prompt_range, wcfg.output_range
  prompt_lens = lengths_rng.integers(p_lo, p_hi, endpoint=True, size=n)
  output_lens = lengths_rng.integers(o_lo, o_hi, endpoint=True, size=n)
  arrivals = arrival_steps(np.random.default_rng(arrival_ss), n, wcfg.arrival,
                           wcfg.arrival_rate)
  ranking = np.random.default_rng(ranking_ss).permutation(vocab_size)
  requests = []
  for i, ss in enumerate(tokens_ss.spawn(n)):
    prompt = zipf_tokens(np.random.default_rng(ss), int(prompt_lens[i]), vocab_size,
                         ranking=ranking)
    requests.append(Request(id=f"req-{i:04d}", prompt=prompt,
                            max_new_tokens=int(output_lens[i]),
                            arrival_step=int(arrivals[i])))
  return requests
