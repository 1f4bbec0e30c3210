"""The DSA lightning indexer's scoring and top-k selection (pure jnp, the reference).

Memory systems call these through ``MemorySystem.select``: the default scores every
key of a row on one device; a sharded layout scores its local keys and merges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ula_jax.core.types import INVALID

F32 = jnp.float32


def index_scores(q_nik: jax.Array, w_ni: jax.Array, keys: jax.Array) -> jax.Array:
  """Indexer scores.

  q_nik: [N, I, K]; w_ni: [N, I] float32
  keys:  [N, T, K] (per-row candidates) or [T, K] (candidates shared by all rows)
  returns [N, T] float32
  """
  K = q_nik.shape[-1]
  q = q_nik.astype(F32) * K ** -0.5
  spec = "nik,tk->nit" if keys.ndim == 2 else "nik,ntk->nit"
  s_nit = jax.nn.relu(jnp.einsum(spec, q, keys.astype(F32)))
  return jnp.einsum("nit,ni->nt", s_nit, w_ni)


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
