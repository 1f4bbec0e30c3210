"""``x @ w[index]`` as a Pallas kernel that reads layer ``index``'s weights in place.

Grid: batch elements (heads, experts; 1 for a plain product) x blocks of ``block_n``
output columns x splits of K. Program (b, n, s) loads the layer's [block_k, block_n]
weight blocks of its K range straight from the stacked array (``w_ref.at[index, b, k,
cols]``, or [block_n, block_k] blocks of a weight stored [N, K]; nothing copies the layer
out), multiplies them with the rows' [M, block_k] blocks and writes a float32 partial
sum; the splits' partial sums are added after. K is split until the grid has about
``programs`` programs, so a product with few output columns (the output projection:
1024) still spreads its weight reads over the GPU. The rows are padded to a power of 2 of
at least 16: Triton's smallest dot is 16 rows, and Pallas's Triton lowering takes only
arrays whose sizes are powers of 2 (36 rows padded to 48 would not lower).

Blocks are the config's, or smaller powers of 2 where they do not divide K or N.
Decode-sized products only: more than ``MAX_ROWS`` rows (a prefill chunk), or a K or N
with no power-of-2 divisor of at least 16, take the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ula_jax.kernels.fetch.pallas import default_interpret
from ula_jax.kernels.stacked_matmul.reference import stacked_matmul_reference

F32 = jnp.float32
MAX_ROWS = 256  # rows a program holds at once ([MAX_ROWS, block_k] and the accumulator)


@dataclasses.dataclass(frozen=True)
class StackedMatmulConfig:
  """Launch of the kernel (static). ``programs``: the grid size K splits aim for (two
  programs per SM of an H100 / H200). ``max_partials``: a cap on the splits, the
  float32 partial sums they write as a fraction of the weight bytes the product reads
  (None: no cap; at 64 rows a split in 16 of a 1024-deep weight writes twice the
  weight's bytes)."""

  block_k: int = 64
  block_n: int = 128
  num_warps: int = 4
  num_stages: int = 3
  programs: int = 264
  max_partials: float | None = None


def splits_for(K: int, N: int, block_k: int, block_n: int, programs: int, *,
               rows: int = 0, itemsize: int = 2, max_partials: float | None = None) -> int:
  """K splits (a power of 2) for a grid of about ``programs`` programs, each split at
  least one block of K; with ``max_partials``, no more than keep the float32 partial
  sums of ``rows`` rows (4 x splits x rows bytes a column) within that fraction of the
  weight's bytes (``itemsize`` x K a column)."""
  s = 1
  while ((N // block_n) * s * 2 <= programs and K % (block_k * s * 2) == 0
         and (max_partials is None or 4 * 2 * s * rows <= max_partials * itemsize * K)):
    s *= 2
  return s


def _kernel(i_ref, x_ref, w_ref, o_ref, *, block_k: int, block_n: int, ksteps: int,
            shared_x: bool, transposed: bool):
  b, n, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = plgpu.load(i_ref.at[jnp.int32(0)])
  bx = jnp.int32(0) if shared_x else b  # one indexer a load (Triton lowers no chained ones)
  cols = pl.ds(n * block_n, block_n)

  def body(t, acc):
    k = pl.ds((s * ksteps + t) * block_k, block_k)
    xb = plgpu.load(x_ref.at[bx, :, k])
    if transposed:  # the weight is stored [N, K]
      return acc + plgpu.dot(xb, plgpu.load(w_ref.at[layer, b, cols, k]), trans_b=True)
    return acc + plgpu.dot(xb, plgpu.load(w_ref.at[layer, b, k, cols]))

  acc = jax.lax.fori_loop(0, ksteps, body, jnp.zeros((x_ref.shape[1], block_n), F32))
  plgpu.store(o_ref.at[s, b, :, cols], acc.astype(o_ref.dtype))


def padded_rows(M: int) -> int:
  """The rows a launch computes for ``M``: the power of 2 at or above it, at least 16
  (the smallest dot Triton emits; the Triton lowering takes power-of-2 arrays only)."""
  return max(16, 1 << (max(M, 1) - 1).bit_length())


def _block(size: int, most: int) -> int:
  """The largest power of 2 up to ``most`` that divides ``size`` (0 when below 16, the
  smallest dot operand Triton emits)."""
  b = most
  while b >= 16 and size % b:
    b //= 2
  return b if b >= 16 else 0


def blocks(K: int, N: int, config: StackedMatmulConfig) -> tuple[int, int]:
  """(block_k, block_n) for a [K, N] weight: the config's, or smaller powers of 2 that
  divide K and N; 0 where none of at least 16 does."""
  return _block(K, config.block_k), _block(N, config.block_n)


def fits(M: int, K: int, N: int, config: StackedMatmulConfig) -> bool:
  """Whether the kernel takes the shape (else the reference does)."""
  return M <= MAX_ROWS and all(blocks(K, N, config))


def stacked_matmul_pallas(x: jax.Array, w: jax.Array, index: jax.Array, *,
                          transposed: bool = False, out_dtype=F32,
                          config: StackedMatmulConfig = StackedMatmulConfig(),
                          interpret: bool | None = None) -> jax.Array:
  """``x @ w[index]``, accumulated in float32 and returned in ``out_dtype``, ``w[index]``
  read in place.

  x: [M, K] with w [L, K, N], or batched: x [B, M, K] (or [1, M, K], shared by every
  batch element) with w [L, B, K, N]; transposed: w holds [..., N, K] (the product is
  then ``x @ w[index]^T`` per batch element). index: [] int32, clipped to [0, L) (as a
  dynamic slice clips it). returns [M, N] or [B, M, N] in ``out_dtype``: the float32
  sums rounded once (a grid without K splits stores them so; with splits the float32
  partial sums are added, then rounded).
  """
  if x.ndim == 2:
    return stacked_matmul_pallas(x[None], w[:, None], index, transposed=transposed,
                                 out_dtype=out_dtype, config=config, interpret=interpret)[0]
  _, M, K = x.shape
  L, B = w.shape[:2]
  N = w.shape[2] if transposed else w.shape[3]
  if not fits(M, K, N, config):
    return stacked_matmul_reference(x, w, index, transposed=transposed).astype(out_dtype)
  interpret = default_interpret() if interpret is None else interpret
  block_k, block_n = blocks(K, N, config)
  Mp = padded_rows(M)
  xp = jnp.pad(x.astype(w.dtype), ((0, 0), (0, Mp - M), (0, 0)))
  splits = splits_for(K, B * N, block_k, block_n, config.programs, rows=Mp,
                      itemsize=w.dtype.itemsize, max_partials=config.max_partials)
  ksteps = K // (block_k * splits)
  layer = jnp.clip(jnp.asarray(index, jnp.int32), 0, L - 1).reshape(1)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  parts = pl.pallas_call(
      functools.partial(_kernel, block_k=block_k, block_n=block_n, ksteps=ksteps,
                        shared_x=x.shape[0] == 1, transposed=transposed),
      out_shape=jax.ShapeDtypeStruct((splits, B, Mp, N), F32 if splits > 1 else out_dtype),
      grid=(B, N // block_n, splits),
      in_specs=[any_spec] * 3,
      out_specs=any_spec,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      name="ula_stacked_matmul",
  )(layer, xp, w)
  if splits == 1:
    return parts[0, :, :M]
  return parts.sum(axis=0)[:, :M].astype(out_dtype)
