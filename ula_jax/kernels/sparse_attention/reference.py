"""Sparse MLA attention in plain jnp: the reference and the portable fallback.

Absorbed-form MLA decoding reads one shared row per selected token,
``entry = concat(c [Dl], k_rope [Dr])``, for every head:

    score[h, i] = (q_lat[h] . c_i + q_rope[h] . k_rope_i) * scale
    o_lat[h]    = sum_i softmax(score[h])_i * c_i

Only the selected slots of the pool are read. Rows with no valid slot return zeros.
Products are computed at full float32 precision (``Precision.HIGHEST``): on GPUs the
default float32 matmul rounds its inputs to TF32, which would make the reference less
exact than the kernels it checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ula_jax.core import kv_layout as kv_layout_lib

_HIGHEST = jax.lax.Precision.HIGHEST


def masked_softmax(s: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis restricted to ``mask`` (broadcast against ``s``).

  Rows with nothing unmasked (including an empty last axis) give zeros, not NaN.
  """
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # an all-masked row: exp(-inf - 0) = 0
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(l > 0, l, 1.0)


def sparse_mla_attention_reference(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                                   slots: jax.Array, valid: jax.Array, *,
                                   scale: float, kv_layout: str = "bf16") -> jax.Array:
  """Attention of every head over the selected pool rows.

  q_lat:  [B, H, Dl] latent queries (q_nope absorbed through W_uk)
  q_rope: [B, H, Dr] rotary queries
  pool:   [S, Dl + Dr] entries (any float dtype; read as float32), or with
          ``kv_layout='fp8'`` their rows [S, Dl + 4 Dl/128 + 2 Dr] uint8
  slots:  [B, k] int32 pool rows (ignored where not valid)
  valid:  [B, k] bool
  scale:  softmax scale
  kv_layout: 'bf16' | 'fp8' (``core.kv_layout``): only the gathered rows are decoded
  returns o_lat: [B, H, Dl] float32
  """
  Dl = q_lat.shape[-1]
  # Invalid slots may hold INVALID (-1); read row 0 instead and zero it below: a
  # weight of 0 times an uninitialised (NaN) row would still be NaN.
  idx = jnp.where(valid, jnp.clip(slots, 0, pool.shape[0] - 1), 0)
  ent_bkw = jnp.where(valid[..., None], kv_layout_lib.decode(pool[idx], kv_layout, Dl), 0.0)
  # The gathered rows are the same in every memory system, its pool's shape is not: keep
  # the gather out of the fusions below so their code depends only on [B, k, W].
  ent_bkw = jax.lax.optimization_barrier(ent_bkw)
  c_bkc, kr_bkr = ent_bkw[..., :Dl], ent_bkw[..., Dl:]
  s_bhk = (jnp.einsum("bhc,bkc->bhk", q_lat.astype(jnp.float32), c_bkc, precision=_HIGHEST)
           + jnp.einsum("bhr,bkr->bhk", q_rope.astype(jnp.float32), kr_bkr,
                        precision=_HIGHEST)) * scale
  p_bhk = masked_softmax(s_bhk, valid[:, None, :])
  return jnp.einsum("bhk,bkc->bhc", p_bhk, c_bkc, precision=_HIGHEST)
