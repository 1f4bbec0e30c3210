"""Sparse MLA attention over the pool rows a memory system resolved.

One public entry point, ``sparse_mla_attention``, validates shapes and dispatches on
``impl`` (a config field, ``kernels.attention``):

* ``'xla'``: ``reference.sparse_mla_attention_reference`` (plain jnp; also the fallback;
  ``model.kv_layout='fp8'`` rows dequantised after the gather);
* ``'pallas'``: ``pallas.sparse_mla_attention_pallas``, same signature (fp8 rows decoded
  in the kernel);
* ``'mosaic'``: ``mosaic.sparse_mla_attention_fastest``, the Pallas Mosaic GPU kernel in
  its fastest launch (Hopper GPUs only; 64 heads, 512 + 64 bf16 columns).

Implementations are imported on first use, so a missing optional kernel costs nothing
until it is asked for. ``prefill.py`` runs a prefill chunk's rows through this entry point
(``sparse_attention_rows``) and attends densely while a prompt is no longer than top-k
(``dense_causal_attention``).
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax

from ula_jax.core import kv_layout as kv_layout_lib

# impl name -> "module:function"
IMPLS: dict[str, str] = {
    "xla": "ula_jax.kernels.sparse_attention.reference:sparse_mla_attention_reference",
    "pallas": "ula_jax.kernels.sparse_attention.pallas:sparse_mla_attention_pallas",
    "mosaic": "ula_jax.kernels.sparse_attention.mosaic:sparse_mla_attention_fastest",
}


def impl_function(impl: str) -> Callable[..., jax.Array]:
  if impl not in IMPLS:
    raise ValueError(f"kernels.attention={impl!r}: expected one of {sorted(IMPLS)}")
  module, fn = IMPLS[impl].split(":")
  return getattr(importlib.import_module(module), fn)


def layout_problem(impl: str, kv_layout: str) -> str | None:
  """Why attention implementation ``impl`` cannot read ``kv_layout`` rows (None when it
  can): 'xla' and 'pallas' read fp8 rows, 'mosaic' bf16 rows only."""
  if kv_layout != "bf16" and impl not in ("xla", "pallas"):
    return (f"kernels.attention={impl!r} reads model.kv_layout='bf16' rows only; with "
            f"model.kv_layout={kv_layout!r} use kernels.attention='pallas' or 'xla' (or "
            f"set model.kv_layout='bf16')")
  return None


def sparse_mla_attention(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                         slots: jax.Array, valid: jax.Array, *, scale: float,
                         impl: str = "xla", interpret: bool | None = None,
                         kv_layout: str = "bf16") -> jax.Array:
  """Absorbed-form MLA attention over selected pool rows.

  q_lat:  [B, H, Dl] latent queries
  q_rope: [B, H, Dr] rotary queries
  pool:   [S, Dl + Dr] entries ``concat(c, k_rope)``; with ``kv_layout='fp8'`` their
          rows [S, Dl + 4 Dl/128 + 2 Dr] uint8 (``core.kv_layout``)
  slots:  [B, k] int32 pool rows to read (ignored where not valid)
  valid:  [B, k] bool; a row with nothing valid returns zeros
  scale:  softmax scale; impl: one of ``IMPLS``
  interpret: Pallas interpret mode (None: on everywhere but on GPU); 'xla' ignores it
  kv_layout: how the pool's rows encode entries (``model.kv_layout``); 'fp8' rows are
          read by 'xla' (dequantised after the gather) and 'pallas' (in the kernel)
  returns o_lat: [B, H, Dl] float32
  """
  fn = impl_function(impl)
  kv_layout_lib.check_kind(kv_layout)
  problem = layout_problem(impl, kv_layout)
  if problem:
    raise ValueError(problem)
  if q_lat.ndim != 3 or q_rope.shape[:2] != q_lat.shape[:2] or q_rope.ndim != 3:
    raise ValueError(f"q_lat.shape={q_lat.shape}, q_rope.shape={q_rope.shape}: expected "
                     "[B, H, Dl] and [B, H, Dr] with the same B and H")
  B, _, Dl = q_lat.shape
  Dr = q_rope.shape[-1]
  if kv_layout == "bf16" and (pool.ndim != 2 or pool.shape[1] != Dl + Dr):
    raise ValueError(f"pool.shape={pool.shape}: expected [S, Dl + Dr] = [S, {Dl + Dr}]")
  if kv_layout == "fp8":
    kv_layout_lib.check_fp8_pool(pool, Dl, Dr)
  if slots.ndim != 2 or slots.shape[0] != B or valid.shape != slots.shape:
    raise ValueError(f"slots.shape={slots.shape}, valid.shape={valid.shape}: expected "
                     f"both [B, k] with B={B}")
  # One config field (kernels.interpret) serves every kernel: only Pallas' Triton kernel
  # has an interpret mode.
  kwargs = {"interpret": interpret} if impl == "pallas" else {}
  if kv_layout != "bf16":
    kwargs["kv_layout"] = kv_layout
  return fn(q_lat, q_rope, pool, slots, valid, scale=scale, **kwargs)


__all__ = ["IMPLS", "impl_function", "sparse_mla_attention"]
