"""Sparse MLA attention of a prefill chunk: many query rows, each over its own top-k.

* ``sparse_attention_rows``: the decode kernels with the chunk's queries as their batch
  rows. The Pallas and Mosaic kernels gather each row's selected entries straight from
  the pool into on-chip memory, so one call takes the whole chunk; the jnp reference
  (``impl='xla'``) materialises ``[B, k, W]`` gathered entries, so it runs over blocks
  of rows whose gathered entries and scores fit ``scratch_bytes``.
* ``dense_causal_attention``: every row over the rows ``t < limit_n[n]`` of one
  contiguous window of the pool, no gather: while a prompt is no longer than top-k its
  selection is every earlier position, and attention is a dense causal one. Plain
  matmuls over row blocks within ``scratch_bytes``: 16-bit entries are multiplied in
  their dtype with float32 accumulation (the kernels' numerics, the softmax weights
  rounded to that dtype), float32 ones at full precision (the reference's).

Both return what ``sparse_mla_attention`` returns for the same rows: ``o_lat`` [N, H,
Dl] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ula_jax.core import kv_layout as kv_layout_lib
from ula_jax.kernels.sparse_attention import sparse_mla_attention
from ula_jax.kernels.sparse_attention.reference import masked_softmax

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def _rows_per_block(N: int, per_row: int, scratch_bytes: int) -> int:
  """The largest power of 2 of rows whose scratch (``per_row`` bytes each) fits, >= 1."""
  rows = max(1, scratch_bytes // max(1, per_row))
  return min(1 << (rows.bit_length() - 1), max(N, 1))


def _map_rows(fn, rows: int, *arrays: jax.Array) -> jax.Array:
  """``fn`` over blocks of ``rows`` leading rows of ``arrays`` (padded with zeros to whole
  blocks; the padding's results dropped), one block at a time."""
  N = arrays[0].shape[0]
  nb = -(-N // rows)
  if nb == 1:
    return fn(*arrays)
  pad = nb * rows - N
  blocks = [jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(nb, rows, *a.shape[1:])
            for a in arrays]
  out = jax.lax.map(lambda bs: fn(*bs), tuple(blocks))
  return out.reshape(nb * rows, *out.shape[2:])[:N]


def sparse_attention_rows(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                          slots: jax.Array, valid: jax.Array, *, scale: float,
                          impl: str = "xla", scratch_bytes: int, kv_layout: str = "bf16",
                          interpret: bool | None = None) -> jax.Array:
  """``sparse_mla_attention`` of many query rows (a prefill chunk's).

  q_lat: [N, H, Dl]; q_rope: [N, H, Dr]; pool: [S, W] stored rows; slots, valid: [N, k]
  impl: ``kernels.attention``; 'xla' runs blocks of rows whose gathered entries
        (float32) and scores fit ``scratch_bytes``, the kernels one call
  returns o_lat [N, H, Dl] float32
  """
  call = lambda ql, qr, s, v: sparse_mla_attention(ql, qr, pool, s, v, scale=scale,
                                                   impl=impl, interpret=interpret,
                                                   kv_layout=kv_layout)
  if impl != "xla":
    return call(q_lat, q_rope, slots, valid)
  N, H, Dl = q_lat.shape
  k, Dr = slots.shape[1], q_rope.shape[-1]
  per_row = k * 4 * (Dl + Dr) + 3 * H * k * 4  # gathered entries, scores, weights
  return _map_rows(call, _rows_per_block(N, per_row, scratch_bytes), q_lat, q_rope, slots,
                   valid)


def dense_causal_attention(q_lat: jax.Array, q_rope: jax.Array, window: jax.Array,
                           limit_n: jax.Array, *, scale: float, scratch_bytes: int,
                           kv_layout: str = "bf16") -> jax.Array:
  """Every row's attention over the window rows ``t < limit_n[n]``.

  q_lat: [N, H, Dl]; q_rope: [N, H, Dr]
  window: [Tw, W] stored rows of consecutive positions (``kv_layout``)
  limit_n: [N] int32: row n attends over window rows [0, limit_n[n]) (0: none, zeros)
  returns o_lat [N, H, Dl] float32: ``sparse_mla_attention`` over slots
          ``0 .. limit_n[n] - 1`` of the window, up to rounding
  """
  N, H, Dl = q_lat.shape
  Tw = window.shape[0]
  if kv_layout == "bf16" and jnp.dtype(window.dtype).itemsize == 2:
    dtype, precision = window.dtype, None  # tensor cores, float32 accumulation
    ent = window
  else:
    dtype, precision = F32, _HIGHEST
    ent = kv_layout_lib.decode(window, kv_layout, Dl)
  c_tc, kr_tr = ent[:, :Dl].astype(dtype), ent[:, Dl:].astype(dtype)
  t = jnp.arange(Tw, dtype=jnp.int32)

  def rows(ql, qr, lim):
    s_nht = (jnp.einsum("nhc,tc->nht", ql.astype(dtype), c_tc, precision=precision,
                        preferred_element_type=F32)
             + jnp.einsum("nhr,tr->nht", qr.astype(dtype), kr_tr, precision=precision,
                          preferred_element_type=F32)) * scale
    p_nht = masked_softmax(s_nht, (t[None, :] < lim[:, None])[:, None, :])
    return jnp.einsum("nht,tc->nhc", p_nht.astype(dtype), c_tc, precision=precision,
                      preferred_element_type=F32)

  per_row = 3 * H * Tw * 4  # scores, weights, their 16-bit copy
  return _map_rows(rows, _rows_per_block(N, per_row, scratch_bytes), q_lat, q_rope,
                   limit_n.astype(jnp.int32))


__all__ = ["dense_causal_attention", "sparse_attention_rows"]
