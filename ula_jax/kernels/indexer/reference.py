"""The DSA lightning indexer's scoring and top-k selection (pure jnp, the reference).

Memory systems call these through ``MemorySystem.select``: the default scores every
key of a row on one device; a sharded layout scores its local keys and merges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ula_jax.core.types import INVALID

F32 = jnp.float32


def low_precision(q_nik: jax.Array, keys: jax.Array) -> bool:
  """Whether the products run in the operands' 16-bit dtype (both 16-bit and alike)."""
  return q_nik.dtype == keys.dtype and jnp.dtype(q_nik.dtype).itemsize == 2


def score_operands(q_nik: jax.Array, w_ni: jax.Array, keys: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(queries, head weights, keys) as the products read them, scale applied: scores are
  ``sum_i w[n, i] relu(q[n, i] . keys[t])`` of these.

  Two 16-bit operands of one dtype (bf16 queries and keys) are multiplied in that dtype
  with float32 accumulation (exact products; tensor cores on a GPU) and the ``1 /
  sqrt(K)`` scale is folded into the head weights (``relu`` commutes with a positive
  scale); otherwise both are read as float32 and the queries scaled first."""
  scale = q_nik.shape[-1] ** -0.5
  if low_precision(q_nik, keys):
    return q_nik, w_ni.astype(F32) * scale, keys
  return q_nik.astype(F32) * scale, w_ni.astype(F32), keys.astype(F32)


def index_scores(q_nik: jax.Array, w_ni: jax.Array, keys: jax.Array) -> jax.Array:
  """Indexer scores.

  q_nik: [N, I, K]; w_ni: [N, I] float32
  keys:  [N, T, K] (per-row candidates) or [T, K] (candidates shared by all rows)
  returns [N, T] float32

  Operands as ``score_operands``: at a decode step of GLM-5's geometry (20 groups, 160K
  candidates a row) float32 keys were a converted copy of every candidate key and a
  float32 GEMM, 9 of the step's 61 ms on an H200.
  """
  q, w, k = score_operands(q_nik, w_ni, keys)
  spec = "nik,tk->nit" if keys.ndim == 2 else "nik,ntk->nit"
  s_nit = jax.nn.relu(jnp.einsum(spec, q, k, preferred_element_type=F32))
  return jnp.einsum("nit,ni->nt", s_nit, w)


def select_topk(scores_nt: jax.Array, cand_nt: jax.Array, k: int
                ) -> tuple[jax.Array, jax.Array]:
  """Top-k candidate positions per row (ties go to the lower position).

  scores_nt: [N, T] float32; cand_nt: [N, T] bool (positions that may be picked)
  returns positions [N, k] int32 (INVALID where not valid), valid [N, k] bool;
  a row has exactly min(k, candidates) valid picks.
  """
  T = scores_nt.shape[-1]
  s = jnp.where(cand_nt, scores_nt, -jnp.inf)
  if T < k:  # fewer positions than k: pad with picks that can never be valid
    s = jnp.pad(s, ((0, 0), (0, k - T)), constant_values=-jnp.inf)
    cand_nt = jnp.pad(cand_nt, ((0, 0), (0, k - T)))
  _, idx_nk = jax.lax.top_k(s, k)
  valid_nk = jnp.take_along_axis(cand_nt, idx_nk, axis=-1)
  return jnp.where(valid_nk, idx_nk, INVALID).astype(jnp.int32), valid_nk
