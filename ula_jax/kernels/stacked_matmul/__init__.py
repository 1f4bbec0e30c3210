"""A decode product with one layer's weights, read in place from the stacked array.

The layer stack runs as ``lax.scan`` over parameters stacked along a layer axis. A
product of the rows with layer ``l``'s slice of such an array, as XLA compiles it, copies
the slice out first (a dynamic slice at the loop's index is materialised before a GEMM
reads it): every decode step writes and reads every layer's weights once more than it
needs to. ``stacked_matmul`` multiplies by ``w[l]`` without the slice:

* ``'xla'`` (``reference.py``): ``x @ w[l]``, the plain jax product (slice and GEMM).
* ``'pallas'`` (``pallas.py``): a Pallas kernel that loads ``w[l]``'s blocks itself
  (Triton on GPU; interpret mode elsewhere), for decode-sized row counts; other shapes
  fall back to the reference.

Both accumulate in float32 and round once to the caller's dtype (``out_dtype``; a grid
without K splits stores the rounded sums directly). The config field is
``kernels.projections``; the model uses it for every decode product with a layer's own
weights (``models.transformer.IN_PLACE``, ``models.layers.InPlaceWeight``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ula_jax.kernels.stacked_matmul.reference import stacked_matmul_reference

IMPLS = ("xla", "pallas")
MODES = ("auto",) + IMPLS


def check_impl(impl: str) -> None:
  """ValueError naming ``kernels.projections`` unless ``impl`` is one of ``IMPLS``."""
  if impl not in IMPLS:
    raise ValueError(f"kernels.projections={impl!r}: expected one of {list(IMPLS)}")


def projections_impl(mode: str, platform: str, interpret: bool) -> str:
  """``kernels.projections=mode`` on ``platform``: 'auto' is 'pallas' on a GPU that runs
  Pallas compiled (measured faster there: the slices XLA copies are gone), 'xla'
  elsewhere (interpret mode would only be slower)."""
  if mode not in MODES:
    raise ValueError(f"kernels.projections={mode!r}: expected one of {list(MODES)}")
  if mode != "auto":
    return mode
  return "pallas" if platform == "gpu" and not interpret else "xla"


def stacked_matmul(x: jax.Array, w: jax.Array, index: jax.Array, *, transposed: bool = False,
                   out_dtype=jnp.float32, impl: str = "xla",
                   interpret: bool | None = None) -> jax.Array:
  """``x @ w[index]``, accumulated in float32, rounded once to ``out_dtype``.

  x: [M, K] with w [L, K, N] (layers stacked on the first axis), or batched (heads,
     experts): x [B, M, K] or [1, M, K] (shared) with w [L, B, K, N]
  transposed: w holds [..., N, K]; the product is ``x @ w[index]^T`` per batch element
  index: [] int32 in [0, L)
  returns [M, N] or [B, M, N] in ``out_dtype`` (the same values as the float32 product
  cast to it)
  """
  check_impl(impl)
  k_axis = -1 if transposed else -2
  if (x.ndim, w.ndim) not in ((2, 3), (3, 4)) or x.shape[-1] != w.shape[k_axis] or (
      x.ndim == 3 and x.shape[0] not in (1, w.shape[1])):
    raise ValueError(f"stacked_matmul: x {x.shape} and w {w.shape}: expected [M, K] and "
                     "[L, K, N], or [B | 1, M, K] and [L, B, K, N] ([..., N, K] when "
                     "transposed)")
  index = jnp.asarray(index, jnp.int32)
  if impl == "pallas":
    from ula_jax.kernels.stacked_matmul.pallas import stacked_matmul_pallas
    return stacked_matmul_pallas(x, w, index, transposed=transposed, out_dtype=out_dtype,
                                 interpret=interpret)
  return stacked_matmul_reference(x, w, index, transposed=transposed).astype(out_dtype)
