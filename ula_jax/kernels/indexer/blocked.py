"""Indexer scores of many rows against shared keys, one column tile at a time (plain jnp).

``index_scores`` (the reference) forms the per-head products ``[N, I, T]`` before it
sums over heads; at a 4096-row prefill chunk over 64K positions that is 32 GiB of
float32. ``index_scores_blocked`` computes ``[N, block_t]`` columns at a time, so only
``[N, I, block_t]`` exists at once, and only the tiles that hold some row's candidates
(columns below its ``limit``): a causal prefill chunk skips the positions after it.
It is the portable form of ``kernels.indexer``; ``pallas.index_scores_pallas`` fuses the
head sum into the matmul and keeps the per-head products in registers.

Operands as the reference's (``reference.score_operands``): two 16-bit operands (bf16
queries and keys) are multiplied in their dtype with float32 accumulation and the
``1 / sqrt(K)`` scale is folded into the head weights; otherwise both are read as
float32 and the queries scaled first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ula_jax.kernels.indexer.reference import low_precision, score_operands

F32 = jnp.float32


def index_scores_blocked(q_nik: jax.Array, w_ni: jax.Array, keys_tk: jax.Array,
                         limit_n: jax.Array, *, block_t: int) -> jax.Array:
  """Indexer scores of rows against shared keys, ``block_t`` columns at a time.

  q_nik: [N, I, K]; w_ni: [N, I]; keys_tk: [T, K] with T a multiple of ``block_t``
  limit_n: [N] int32: row n's candidates are the positions t < limit_n[n]
  returns [N, T] float32: the scores at t < limit_n[n]; elsewhere unspecified (0 in
          tiles past every row's limit)
  """
  N, _, K = q_nik.shape
  T = keys_tk.shape[0]
  if T % block_t:
    raise ValueError(f"keys_tk.shape[0]={T} must be a multiple of block_t={block_t}")
  q, w, keys = score_operands(q_nik, w_ni, keys_tk)
  tiles = (jnp.max(limit_n, initial=0) + block_t - 1) // block_t

  def tile(j, out_nt):
    k_tk = jax.lax.dynamic_slice_in_dim(keys, j * block_t, block_t)
    s_nit = jax.nn.relu(jnp.einsum("nik,tk->nit", q, k_tk, preferred_element_type=F32))
    s_nt = jnp.einsum("nit,ni->nt", s_nit, w)
    return jax.lax.dynamic_update_slice_in_dim(out_nt, s_nt, j * block_t, axis=1)

  return jax.lax.fori_loop(0, tiles, tile, jnp.zeros((N, T), F32))


__all__ = ["index_scores_blocked"]
