"""Decoder building blocks: RMSNorm, RoPE, MLA attention, the lightning indexer, MLP, MoE.

Dimension letters: N rows (tokens or batch rows), T candidate positions, D hidden,
H heads, Q q_lora_rank, C kv_lora_rank, E experts, F MLP width, I indexer heads,
K indexer head dim, W entry width (C + rope dim values; stored as a row of
``MLAttention.layout.row_width`` elements, ``model.kv_layout``).

Parameters are stored in ``cfg.dtype``; norms, RoPE, softmax, indexer scores and the
router run in float32.

Tensor parallelism splits attention heads: a ``HeadRange`` names the heads one rank
computes, and ``MLAttention`` slices its per-head weights to it (parameters stay whole on
every rank). Without one, every head is computed.

Inside the layer stack's scans, a parameter may hold an ``InPlaceWeight`` instead of its
array (``kernels.projections``, set by ``transformer._run_layers``): the layer's weight
left in the stacked array, which its products read in place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ula_jax.kernels.sparse_attention.reference import masked_softmax
from ula_jax.kernels.stacked_matmul import stacked_matmul
from ula_jax.models.config import ModelConfig

F32 = jnp.float32


# Parameters up to this many values are drawn by numpy: eager construction then compiles
# nothing per parameter shape (each shape would cost a jax compilation). Larger ones are
# drawn by jax on the device, where generation is fast and compilation is amortised.
HOST_DRAW_MAX = 1 << 20


def _host_normal(key_bits: np.ndarray, shape: tuple[int, ...], std: float) -> np.ndarray:
  rng = np.random.default_rng(np.asarray(key_bits).ravel().tolist())
  return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: str
                   ) -> jax.Array:
  # One program eagerly and under a trace, so both round the same way.
  return (jax.random.normal(key, shape, F32) * std).astype(dtype)


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype: str,
                 std: float | None = None) -> nnx.Param:
  """Normal init with std ``fan_in ** -0.5`` (or ``std``), stored in ``dtype``.

  The same key gives the same values eagerly and under a trace (``nnx.eval_shape``, jit):
  numpy draws run through a host callback there.
  """
  std = fan_in ** -0.5 if std is None else std
  key = rngs.params()
  if math.prod(shape) > HOST_DRAW_MAX:
    return nnx.Param(_device_normal(key, shape, std, dtype))
  bits = jax.random.key_data(key)
  if isinstance(bits, jax.core.Tracer):
    draw = functools.partial(_host_normal, shape=shape, std=std)
    value = jax.pure_callback(draw, jax.ShapeDtypeStruct(shape, F32), bits).astype(dtype)
  else:
    value = jnp.asarray(_host_normal(np.asarray(bits), shape, std).astype(jnp.dtype(dtype)))
  return nnx.Param(value)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype: str):
    self.scale = nnx.Param(jnp.asarray(np.ones((dim,), jnp.dtype(dtype))))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(F32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (rotate-half layout).

  x:         [..., R] with R even
  positions: int32, broadcastable to ``x.shape[:-1]``
  returns    [..., R] in x.dtype
  """
  half = x.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=F32) / half)
  ang = positions[..., None].astype(F32) * inv_freq
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  x32 = x.astype(F32)
  x1, x2 = x32[..., :half], x32[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------
# MLA attention
# ----------------------------------------------------------------------------------


class HeadRange(NamedTuple):
  """Heads ``[start, start + count)`` of one tensor-parallel rank.

  start: [] int32, may be traced (``axis_index * count`` inside ``shard_map``)
  count: static number of heads per rank
  """

  start: jax.Array | int
  count: int


def _heads(w: jax.Array, axis: int, heads: HeadRange | None) -> jax.Array:
  """``w`` restricted to ``heads`` along its head axis (all of ``w`` when None)."""
  if heads is None:
    return w
  return jax.lax.dynamic_slice_in_dim(w, heads.start, heads.count, axis)



@dataclasses.dataclass(frozen=True)
class InPlaceWeight:
  """One layer's weight left inside its stack's array, as a parameter's value.

  stack: [L, B, K, N] the stacked parameter with its layer axes merged, its batch axes
         (heads, experts; B = 1 for none) and the product's contracted and output axes
         each flattened: a free reshape of the array the scans would slice ([L, B, N,
         K] when ``transposed``)
  index: [] int32 this layer's row of ``stack``
  shape: the layer's own weight shape
  transposed: the weight holds its output axes before its contracted ones
  impl, interpret: ``kernels.stacked_matmul``'s (the ``kernels.projections`` field)

  ``matmul`` multiplies by the layer's weight without slicing it out; any other read
  (``param[...]``) gets the slice, so every use stays correct.
  """

  stack: jax.Array
  index: jax.Array
  shape: tuple[int, ...]
  transposed: bool
  impl: str
  interpret: bool | None

  @property
  def dtype(self):
    return self.stack.dtype

  def matmul(self, x: jax.Array, out_dtype) -> jax.Array:
    """[B | 1, M, K] -> [B, M, N] (per batch element, rows shared when 1), accumulated in
    float32 and rounded once to ``out_dtype``."""
    return stacked_matmul(x, self.stack, self.index, transposed=self.transposed,
                          out_dtype=out_dtype, impl=self.impl, interpret=self.interpret)

  def __getitem__(self, key):
    layer = jax.lax.dynamic_index_in_dim(self.stack, self.index, 0, keepdims=False)
    return layer.reshape(self.shape)[key]


def _in_place(param: nnx.Variable, heads: HeadRange | None = None) -> InPlaceWeight | None:
  """The parameter's ``InPlaceWeight`` when the product can read it in place (all heads)."""
  value = param.get_value()
  return value if isinstance(value, InPlaceWeight) and heads is None else None


def _dot(x_nk: jax.Array, param: nnx.Variable) -> jax.Array:
  """``x [N, K] @ param [K, ...]`` -> [N, ...] in the operands' dtype: read in place when
  the parameter holds an ``InPlaceWeight``."""
  if (w := _in_place(param)) is not None:
    out = w.matmul(x_nk[None], jnp.result_type(x_nk.dtype, w.dtype))[0]
    return out.reshape(x_nk.shape[0], *w.shape[1:])
  w = param[...]
  return jnp.einsum("nk,k...->n...", x_nk, w) if w.ndim > 2 else x_nk @ w


class MLAttention(nnx.Module):
  """Multi-head latent attention.

  q path:  x -> W_dq -> RMSNorm = c_q [Q] -> W_uq -> per head [q_nope, q_rope]
  kv path: x -> W_dkv -> RMSNorm = c [C];  k_rope = RoPE(x W_kr) [R], shared by heads
  The stored entry per token is ``concat(c, k_rope)`` [W]; keys and values per head are
  ``c W_uk[h]`` and ``c W_uv[h]``. Decoding absorbs W_uk into the query and W_uv into the
  output, so attention reads only the entries.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H, Q, C = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, dv, dt = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.dtype
    self.w_dq = normal_param(rngs, (D, Q), D, dt)
    self.q_norm = RMSNorm(Q, cfg.rms_norm_eps, dt)
    self.w_uq = normal_param(rngs, (Q, H, dn + dr), Q, dt)
    self.w_dkv = normal_param(rngs, (D, C), D, dt)
    self.kv_norm = RMSNorm(C, cfg.rms_norm_eps, dt)
    self.w_kr = normal_param(rngs, (D, dr), D, dt)
    self.w_uk = normal_param(rngs, (H, C, dn), C, dt)
    self.w_uv = normal_param(rngs, (H, C, dv), C, dt)
    self.w_o = normal_param(rngs, (H, dv, D), H * dv, dt)
    self.nope_dim = dn
    self.kv_lora_rank = C
    self.rope_theta = cfg.rope_theta
    self.kv_dtype = cfg.kv_dtype
    self.layout = cfg.entry_layout  # model.kv_layout: how entries are stored

  def project(self, x_nd: jax.Array, pos_n: jax.Array, heads: HeadRange | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Queries and the token's entry.

    x_nd: [N, D] normed hidden; pos_n: [N] int32 positions
    heads: the heads to compute queries for (None = all H)
    returns c_q [N, Q], q_nope [N, H, dn], q_rope [N, H, dr] (rotated; H = heads.count
            when split), entry: the stored row [N, layout.row_width] (kv_dtype values,
            or fp8 bytes; the same for any ``heads``). Encoded once here, so every
            store and every attention path sees the same bytes.
    """
    cq_nq = self.query_latent(x_nd)
    if heads is None:
      q_nhe = _dot(cq_nq, self.w_uq)
    else:
      q_nhe = jnp.einsum("nq,qhe->nhe", cq_nq, _heads(self.w_uq[...], 1, heads))
    q_nope, q_rope = q_nhe[..., :self.nope_dim], q_nhe[..., self.nope_dim:]
    q_rope = apply_rope(q_rope, pos_n[:, None], self.rope_theta)
    c_nc = self.kv_norm(_dot(x_nd, self.w_dkv))
    kr_nr = apply_rope(_dot(x_nd, self.w_kr), pos_n, self.rope_theta)
    entry = self.layout.encode(jnp.concatenate([c_nc, kr_nr], axis=-1))
    return cq_nq, q_nope, q_rope, entry

  def query_latent(self, x_nd: jax.Array) -> jax.Array:
    """The q latent c_q [N, Q] of a normed hidden state [N, D] (what the indexer reads
    besides the hidden state)."""
    return self.q_norm(_dot(x_nd, self.w_dq))

  def absorb(self, q_nope_nhd: jax.Array, heads: HeadRange | None = None) -> jax.Array:
    """q_lat[h] = q_nope[h] W_uk[h]^T: [N, H, dn] -> [N, H, C] (H = heads.count when split)."""
    if (w_uk := _in_place(self.w_uk, heads)) is not None:  # [H, C, dn]: stored [N, K]
      q_hnc = w_uk.matmul(jnp.swapaxes(q_nope_nhd, 0, 1),
                          jnp.result_type(q_nope_nhd.dtype, w_uk.dtype))
      return jnp.swapaxes(q_hnc, 0, 1)
    return jnp.einsum("nhd,hcd->nhc", q_nope_nhd, _heads(self.w_uk[...], 0, heads))

  def out(self, o_lat_nhc: jax.Array, heads: HeadRange | None = None,
          dtype: jnp.dtype | None = None) -> jax.Array:
    """Attention output from latent outputs: [N, H, C] -> [N, D] (W_uv then W_o).

    heads: the heads ``o_lat_nhc`` holds (None = all H); the result is then this
           rank's share of the output, to be summed over the ranks
    dtype: accumulation and result dtype of the W_o product (None = the weights')
    """
    if (w_uv := _in_place(self.w_uv, heads)) is not None:
      v_hnv = w_uv.matmul(jnp.swapaxes(o_lat_nhc.astype(w_uv.dtype), 0, 1), w_uv.dtype)
      v_nhv = jnp.swapaxes(v_hnv, 0, 1)
    else:
      w_uv = _heads(self.w_uv[...], 0, heads)
      v_nhv = jnp.einsum("nhc,hcv->nhv", o_lat_nhc.astype(w_uv.dtype), w_uv)
    if (w_o := _in_place(self.w_o, heads)) is not None:
      return w_o.matmul(v_nhv.reshape(1, v_nhv.shape[0], -1),
                        dtype or jnp.result_type(v_nhv.dtype, w_o.dtype))[0]
    return jnp.einsum("nhv,hvd->nd", v_nhv, _heads(self.w_o[...], 0, heads),
                      preferred_element_type=dtype)

  def naive(self, q_nope_nhd: jax.Array, q_rope_nhr: jax.Array, entries_ntw: jax.Array,
            mask_nt: jax.Array, scale: float) -> jax.Array:
    """Non-absorbed MLA (per-head keys and values materialised), for checking.

    entries_ntw: [N, T, W] each row's candidate stored rows (``layout``); mask_nt: [N, T]
    returns [N, D]
    """
    ent = self.layout.decode(entries_ntw)
    c_ntc, kr_ntr = ent[..., :self.kv_lora_rank], ent[..., self.kv_lora_rank:]
    k_nthd = jnp.einsum("ntc,hcd->nthd", c_ntc, self.w_uk[...].astype(F32))
    v_nthv = jnp.einsum("ntc,hcv->nthv", c_ntc, self.w_uv[...].astype(F32))
    s_nht = (jnp.einsum("nhd,nthd->nht", q_nope_nhd.astype(F32), k_nthd)
             + jnp.einsum("nhr,ntr->nht", q_rope_nhr.astype(F32), kr_ntr)) * scale
    p_nht = masked_softmax(s_nht, mask_nt[:, None, :])
    o_nhv = jnp.einsum("nht,nthv->nhv", p_nht, v_nthv)
    w_o = self.w_o[...]
    return jnp.einsum("nhv,hvd->nd", o_nhv.astype(w_o.dtype), w_o)


# ----------------------------------------------------------------------------------
# Lightning indexer (DSA)
# ----------------------------------------------------------------------------------


class Indexer(nnx.Module):
  """Scores every past position with a few small ReLU heads and keeps the top-k.

  q_I = c_q W_q [I, K] (from the attention's q latent), k_I = RMSNorm(x W_k) [K] (one key
  per token, stored by the memory system), w = x W_w [I]; the first ``index_rope``
  dimensions of q_I and k_I rotated by RoPE at their positions;
  score_t = sum_i w_i relu(q_I[i] . k_I_t).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, Q, I, K, dt = (cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads,
                      cfg.index_head_dim, cfg.dtype)
    self.w_q = normal_param(rngs, (Q, I, K), Q, dt)
    self.w_k = normal_param(rngs, (D, K), D, dt)
    self.k_norm = RMSNorm(K, cfg.rms_norm_eps, dt)
    self.w_w = normal_param(rngs, (D, I), D, dt)
    self.key_dtype = cfg.kv_dtype
    self.rope = cfg.index_rope
    self.rope_theta = cfg.rope_theta

  def _rotate(self, x: jax.Array, pos: jax.Array) -> jax.Array:
    """The first ``rope`` dimensions of x [..., K] rotated at ``pos`` (broadcast to
    ``x.shape[:-1]``)."""
    if not self.rope:
      return x
    r = self.rope
    return jnp.concatenate([apply_rope(x[..., :r], pos, self.rope_theta), x[..., r:]], -1)

  def query(self, x_nd: jax.Array, cq_nq: jax.Array, pos_n: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """x_nd: [N, D] normed hidden; cq_nq: [N, Q]; pos_n: [N] int32 positions
    -> q_I [N, I, K], w [N, I] float32."""
    q_nik = self._rotate(_dot(cq_nq, self.w_q), pos_n[:, None])
    I = q_nik.shape[1]
    w_ni = _dot(x_nd, self.w_w).astype(F32) * I ** -0.5
    return q_nik, w_ni

  def key(self, x_nd: jax.Array, pos_n: jax.Array) -> jax.Array:
    """[N, D] normed hidden, [N] int32 positions -> [N, K] index keys in kv_dtype (the
    stored precision)."""
    return self._rotate(self.k_norm(_dot(x_nd, self.w_k)), pos_n).astype(self.key_dtype)


# ----------------------------------------------------------------------------------
# Feed-forward
# ----------------------------------------------------------------------------------


class MLP(nnx.Module):
  """SwiGLU: (silu(x W_gate) * x W_up) W_down."""

  def __init__(self, hidden: int, width: int, dtype: str, *, rngs: nnx.Rngs):
    self.w_gate = normal_param(rngs, (hidden, width), hidden, dtype)
    self.w_up = normal_param(rngs, (hidden, width), hidden, dtype)
    self.w_down = normal_param(rngs, (width, hidden), width, dtype)

  def __call__(self, x_nd: jax.Array) -> jax.Array:
    h_nf = jax.nn.silu(_dot(x_nd, self.w_gate)) * _dot(x_nd, self.w_up)
    return _dot(h_nf, self.w_down)


class MoE(nnx.Module):
  """Routed experts (softmax router, top-k gates renormalised) plus shared experts.

  Every expert runs on every token and the gates (zero for unchosen experts) combine
  them: exact and simple, at E times the routed compute.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, E, F, dt = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.dtype
    self.router = normal_param(rngs, (D, E), D, dt)
    self.w_gate = normal_param(rngs, (E, D, F), D, dt)
    self.w_up = normal_param(rngs, (E, D, F), D, dt)
    self.w_down = normal_param(rngs, (E, F, D), F, dt)
    self.shared = (MLP(D, F * cfg.num_shared_experts, dt, rngs=rngs)
                   if cfg.num_shared_experts else None)
    self.top_k = cfg.num_experts_per_tok

  def gates(self, x_nd: jax.Array) -> jax.Array:
    """[N, D] -> [N, E] float32 combine weights (top-k of the softmax, renormalised)."""
    probs_ne = jax.nn.softmax((x_nd @ self.router[...]).astype(F32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs_ne, self.top_k)
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    E = probs_ne.shape[-1]
    return jnp.einsum("nk,nke->ne", top_p, jax.nn.one_hot(top_i, E, dtype=F32))

  def __call__(self, x_nd: jax.Array) -> jax.Array:
    w_gate, w_up, w_down = (_in_place(self.w_gate), _in_place(self.w_up),
                            _in_place(self.w_down))
    if w_gate is not None and w_up is not None and w_down is not None:
      dt = jnp.result_type(x_nd.dtype, w_gate.dtype)
      h_enf = jax.nn.silu(w_gate.matmul(x_nd[None], dt)) * w_up.matmul(x_nd[None], dt)
      y_ned = jnp.swapaxes(w_down.matmul(h_enf, dt), 0, 1)
    else:
      h_nef = (jax.nn.silu(jnp.einsum("nd,edf->nef", x_nd, self.w_gate[...]))
               * jnp.einsum("nd,edf->nef", x_nd, self.w_up[...]))
      y_ned = jnp.einsum("nef,efd->ned", h_nef, self.w_down[...])
    y_nd = jnp.einsum("ned,ne->nd", y_ned.astype(F32), self.gates(x_nd)).astype(x_nd.dtype)
    if self.shared is not None:
      y_nd = y_nd + self.shared(x_nd)
    return y_nd
