"""Sparse MLA decode attention as a Pallas kernel (Triton on GPU, interpret mode on CPU).

Same contract as ``reference.sparse_mla_attention_reference``: per request row ``b``,
every head attends over the ``k`` pool rows ``slots[b]`` (where ``valid``), in absorbed
form (scores from the 576-wide latent rows, outputs in the latent space).

Grid: (B, head blocks, k splits). A program holds ``block_h`` heads' queries, walks its
share of the selection ``block_k`` rows at a time (gathering the rows by slot straight
from the pool), and keeps an online softmax in float32. With one split it writes the
normalised output; with several (flash-decoding, so that small batches still fill the
GPU) each split writes its normalised partial output and log-sum-exp and a small jnp
epilogue merges them. Rows with no valid entry produce zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Programs the automatic split count aims for: about two per SM of an H100/H200.
TARGET_PROGRAMS = 264


def _pow2(n: int) -> bool:
  return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Tuning of the Pallas sparse attention (static and hashable).

  block_h:    heads per program (power of 2, >= 16 for the tensor cores); None: 16 for
              up to 16 heads, else 32
  block_k:    selected rows per loop step (power of 2, >= 16)
  num_splits: programs per request row and head block along k; None: enough to reach
              ``TARGET_PROGRAMS`` programs
  num_warps:  warps per program; None: 4 for block_h <= 16, else 8
  num_stages: software pipelining stages (Triton)
  """

  block_h: int | None = None
  block_k: int = 32
  num_splits: int | None = None
  num_warps: int | None = None
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_h", "block_k"):
      v = getattr(self, name)
      if v is not None and (not _pow2(v) or v < 16):
        raise ValueError(f"{name}={v}: expected a power of 2 >= 16")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"num_splits={self.num_splits}: expected >= 1 (or None)")
    if self.num_warps is not None and not _pow2(self.num_warps):
      raise ValueError(f"num_warps={self.num_warps}: expected a power of 2")

  def heads_per_program(self, H: int) -> int:
    if self.block_h is not None:
      return self.block_h
    return 16 if H <= 16 else 32

  def warps(self, H: int) -> int:
    if self.num_warps is not None:
      return self.num_warps
    return 4 if self.heads_per_program(H) <= 16 else 8

  def splits(self, B: int, H: int, k: int) -> int:
    blocks = pl.cdiv(k, self.block_k)
    if self.num_splits is not None:
      return max(1, min(self.num_splits, blocks))
    programs = B * pl.cdiv(H, self.heads_per_program(H))
    return max(1, min(blocks, pl.cdiv(TARGET_PROGRAMS, max(programs, 1))))


def _attention_kernel(q_lat_ref, q_rope_ref, pool_ref, slots_ref, *out_refs, H: int,
                      k: int, Dl: int, Dr: int, block_h: int, block_k: int,
                      blocks_per_split: int, scale: float, split_out: bool):
  # q_lat_ref: [B, H, Dl]; q_rope_ref: [B, H, Dr]; pool_ref: [S, Dl + Dr]
  # slots_ref: [B, k] int32, -1 where not valid
  # out_refs: (o [B, H, Dl] f32,) or (o [B, NS, H, Dl] f32, lse [B, NS, H] f32)
  b, hb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  h0 = hb * block_h
  head_ok = (h0 + jnp.arange(block_h, dtype=jnp.int32)) < H  # [bh]
  compute = pool_ref.dtype if jnp.dtype(pool_ref.dtype).itemsize == 2 else jnp.float32
  precision = None if compute != jnp.float32 else jax.lax.Precision.HIGHEST
  q_lat = plgpu.load(q_lat_ref.at[b, pl.ds(h0, block_h), :], mask=head_ok[:, None],
                     other=0).astype(compute)  # [bh, Dl]
  q_rope = plgpu.load(q_rope_ref.at[b, pl.ds(h0, block_h), :], mask=head_ok[:, None],
                      other=0).astype(compute)  # [bh, Dr]
  lat_cols = jnp.arange(Dl, dtype=jnp.int32)
  rope_cols = Dl + jnp.arange(Dr, dtype=jnp.int32)

  def body(i, carry):
    m, l, acc = carry  # [bh], [bh], [bh, Dl] float32
    j0 = (sp * blocks_per_split + i) * block_k
    in_k = (j0 + jnp.arange(block_k, dtype=jnp.int32)) < k
    slot = plgpu.load(slots_ref.at[b, pl.ds(j0, block_k)], mask=in_k, other=-1)  # [bk]
    ok = slot >= 0
    rows = jnp.where(ok, slot, 0)[:, None]
    # Masked rows load as 0 so that garbage (even NaN) in unused slots cannot leak in.
    c = plgpu.load(pool_ref.at[rows, lat_cols[None, :]], mask=ok[:, None], other=0)
    kr = plgpu.load(pool_ref.at[rows, rope_cols[None, :]], mask=ok[:, None], other=0)
    s = (plgpu.dot(q_lat, c.astype(compute), trans_b=True, precision=precision)
         + plgpu.dot(q_rope, kr.astype(compute), trans_b=True, precision=precision))
    s = jnp.where(ok[None, :], s * scale, -jnp.inf)  # [bh, bk]
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # While a row has seen nothing valid, m is -inf: shift by 0 so exp() gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(compute), c.astype(compute),
                                           precision=precision)
    return m_new, l, acc

  init = (jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32),
          jnp.zeros((block_h, Dl), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, blocks_per_split, body, init)
  o = acc / jnp.where(l > 0, l, 1.0)[:, None]
  if not split_out:
    (o_ref,) = out_refs
    plgpu.store(o_ref.at[b, pl.ds(h0, block_h), :], o, mask=head_ok[:, None])
  else:
    o_ref, lse_ref = out_refs
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    plgpu.store(o_ref.at[b, sp, pl.ds(h0, block_h), :], o, mask=head_ok[:, None])
    plgpu.store(lse_ref.at[b, sp, pl.ds(h0, block_h)], lse, mask=head_ok)


def merge_splits(o_bshc: jax.Array, lse_bsh: jax.Array) -> jax.Array:
  """Merges per-split normalised outputs by their log-sum-exp.

  o_bshc: [B, NS, H, Dl] float32; lse_bsh: [B, NS, H] float32 (-inf: split saw nothing)
  returns [B, H, Dl] float32 (zeros where no split saw anything)
  """
  top_bh = jnp.max(lse_bsh, axis=1)
  top_bh = jnp.where(jnp.isfinite(top_bh), top_bh, 0.0)
  w_bsh = jnp.exp(lse_bsh - top_bh[:, None])
  den_bh = jnp.sum(w_bsh, axis=1)
  o_bhc = jnp.einsum("bsh,bshc->bhc", w_bsh, o_bshc)
  return o_bhc / jnp.where(den_bh > 0, den_bh, 1.0)[..., None]


def sparse_mla_attention_pallas(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                                slots: jax.Array, valid: jax.Array, *, scale: float,
                                config: AttentionConfig | None = None,
                                interpret: bool | None = None) -> jax.Array:
  """Attention of every head over the selected pool rows (Pallas).

  q_lat:  [B, H, Dl] latent queries; q_rope: [B, H, Dr] rotary queries
  pool:   [S, Dl + Dr] entries, bf16/f16 (tensor-core dots, f32 accumulation) or f32
  slots:  [B, k] int32 pool rows (ignored where not valid; clamped into [0, S))
  valid:  [B, k] bool
  scale:  softmax scale; config: tuning (``AttentionConfig``)
  interpret: Pallas interpret mode (None: interpret everywhere but on GPU)
  Dl and Dr must be powers of 2 (Triton block shapes), >= 16 on GPU.
  returns o_lat: [B, H, Dl] float32
  """
  config = config or AttentionConfig()
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  B, H, Dl = q_lat.shape
  Dr = q_rope.shape[-1]
  S, k = pool.shape[0], slots.shape[1]
  if not (_pow2(Dl) and _pow2(Dr)):
    raise ValueError(f"q_lat.shape[-1]={Dl}, q_rope.shape[-1]={Dr}: the Pallas kernel needs "
                     "powers of 2 (use impl='xla' otherwise)")
  if pool.shape[1] != Dl + Dr:
    raise ValueError(f"pool.shape={tuple(pool.shape)}: expected [S, Dl + Dr] = [S, {Dl + Dr}]")
  if B == 0 or H == 0 or k == 0 or S == 0:
    return jnp.zeros((B, H, Dl), jnp.float32)
  # One int32 list for the kernel: -1 where not valid; valid slots are clamped into the
  # pool like the reference does.
  slots = jnp.where(valid, jnp.clip(slots, 0, S - 1), -1).astype(jnp.int32)

  block_h = config.heads_per_program(H)
  num_hb = pl.cdiv(H, block_h)
  splits = config.splits(B, H, k)
  blocks_per_split = pl.cdiv(pl.cdiv(k, config.block_k), splits)
  splits = pl.cdiv(pl.cdiv(k, config.block_k), blocks_per_split)  # drop empty splits
  split_out = splits > 1
  kernel = functools.partial(
      _attention_kernel, H=H, k=k, Dl=Dl, Dr=Dr, block_h=block_h, block_k=config.block_k,
      blocks_per_split=blocks_per_split, scale=float(scale), split_out=split_out)
  if split_out:
    out_shape = (jax.ShapeDtypeStruct((B, splits, H, Dl), jnp.float32),
                 jax.ShapeDtypeStruct((B, splits, H), jnp.float32))
  else:
    out_shape = (jax.ShapeDtypeStruct((B, H, Dl), jnp.float32),)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(B, num_hb, splits),
      in_specs=[any_spec] * 4,
      out_specs=tuple(any_spec for _ in out_shape),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.warps(H),
                                           num_stages=config.num_stages),
      name="ula_sparse_mla_attention",
  )(q_lat, q_rope, pool, slots)
  if split_out:
    return merge_splits(*outs)
  return outs[0]


def bytes_read(B: int, H: int, k: int, Dl: int, Dr: int, pool_dtype, q_dtype) -> int:
  """Bytes a sparse decode step must read: the k selected rows per request, the
  queries and the slot list (what the attention benchmark divides by time)."""
  row = (Dl + Dr) * jnp.dtype(pool_dtype).itemsize
  return B * k * row + B * H * (Dl + Dr) * jnp.dtype(q_dtype).itemsize + B * k * 4


__all__ = ["AttentionConfig", "TARGET_PROGRAMS", "bytes_read", "merge_splits",
           "sparse_mla_attention_pallas"]
