"""Sparse prefill's selection: every row's own top-k over its prefix, within a budget.

``prefix_topk`` is what a prefill chunk's layer group selects: row n (a prompt
position) picks the k best-scoring positions among ``t < limit_n[n]`` (its prefix, the
position itself included), as DeepSeek-V3.2's sparse prefill does. The chunk's rows run
in blocks of R rows (``block_rows``) so that a block's scores ``[R, T]`` float32 and the
selection's scratch fit ``scratch_bytes``; a block is scored by ``kernels.indexer``
(``IMPLS``: ``blocked.index_scores_blocked`` or ``pallas.index_scores_pallas``, both
skipping positions past the block's rows) and selected by ``topk.select_topk_radix``.

A block whose rows all have at most k candidates (a prompt's first k positions) picks
every candidate without scoring anything: the result is the one top-k gives, so prefill
can attend densely there (``sparse_attention.prefill.dense_causal_attention``).

Picks are in ascending position order, valid ones first (``select_topk`` orders them
best first); the set is ``select_topk``'s exactly, for the same scores.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from ula_jax.core.types import INVALID
from ula_jax.kernels.indexer.reference import select_topk
from ula_jax.kernels.indexer.topk import RADIX_BITS, select_topk_radix

SCRATCH_BYTES = 1 << 30
"""Default scratch of a prefill chunk's selection and attention (``engine.prefill_scratch``)."""
SELECT_BYTES = 24
"""Scratch per (row, position) of a block's selection: the scores (4 bytes), the picks'
ranks (4 + 4), their masks as matmul operands (2 + 2), the scatter's indices (4) and
slack for what XLA keeps alive between them."""
XLA_TILE_MAX = 4096  # columns per step of ``index_scores_blocked`` at most (loop trips)

# kernels.indexer -> "module:function" (imported on first use)
IMPLS: dict[str, str] = {
    "xla": "ula_jax.kernels.indexer.blocked:index_scores_blocked",
    "pallas": "ula_jax.kernels.indexer.pallas:index_scores_pallas",
}


def _pow2_floor(n: int) -> int:
  return 1 << max(0, int(n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def block_rows(N: int, T: int, scratch_bytes: int, *, minimum: int = 1) -> int:
  """Rows per block: the largest power of 2 whose selection scratch (``SELECT_BYTES``
  per row and position of ``T``) fits ``scratch_bytes``, at least ``minimum`` (a
  kernel's row block), at most N rounded up to a power of 2."""
  rows = _pow2_floor(max(1, scratch_bytes // max(1, SELECT_BYTES * T)))
  return max(minimum, min(rows, _pow2_ceil(max(N, 1))))


def column_tile(impl: str, T: int, rows: int, heads: int, scratch_bytes: int,
                 config) -> int:
  """Positions per scoring step: the kernel's ``block_t``; for 'xla' the widest power of
  2 whose per-head products [rows, heads, tile] float32 take at most a quarter of the
  scratch (few loop trips), within [16, XLA_TILE_MAX] and no wider than T needs."""
  if impl == "pallas":
    return config.block_t
  tile = _pow2_floor(max(1, scratch_bytes // 4 // (4 * rows * heads)))
  return max(16, min(tile, XLA_TILE_MAX, _pow2_ceil(T)))


def scores_fn(impl: str):
  """The scores function of ``kernels.indexer`` implementation ``impl`` (``IMPLS``)."""
  if impl not in IMPLS:
    raise ValueError(f"kernels.indexer={impl!r}: expected one of {sorted(IMPLS)}")
  module, fn = IMPLS[impl].split(":")
  return getattr(importlib.import_module(module), fn)


def select_prefix(scores_nt: jax.Array, limit_n: jax.Array, k: int, *, impl: str = "xla",
                  radix_bits: int = RADIX_BITS, interpret: bool | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """``select_topk_radix`` of rows whose candidates are the positions ``t < limit_n[n]``;
  with ``impl='pallas'`` its counting passes are ``pallas.prefix_kth_largest_pallas``.

  scores_nt: [N, T] float32 (read only below each row's limit); limit_n: [N] int32
  returns positions [N, k] int32 ascending, valid [N, k] bool
  """
  T = scores_nt.shape[1]
  cand = jnp.arange(T, dtype=jnp.int32)[None, :] < limit_n[:, None]
  kth = None
  if impl == "pallas" and T > k and radix_bits <= 4:
    from ula_jax.kernels.indexer.pallas import prefix_kth_largest_pallas
    kth = prefix_kth_largest_pallas(scores_nt, limit_n, k, radix_bits=radix_bits,
                                    interpret=interpret)
  if kth is not None:
    return select_topk_radix(scores_nt, cand, k, radix_bits=radix_bits, kth=kth)
  # The radix select replaces the sort a GPU's top-k of 2048 would be; a CPU's top-k is
  # no sort and many times faster than the counting passes there. Same set either way.
  return jax.lax.platform_dependent(
      scores_nt, cand, cpu=lambda s, c: ascending(*select_topk(s, c, k)),
      default=lambda s, c: select_topk_radix(s, c, k, radix_bits=radix_bits))


def ascending(pos_nk: jax.Array, valid_nk: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``select_topk``'s picks (best first) in ascending position order, valid ones first
  (the order ``select_topk_radix`` returns)."""
  big = jnp.iinfo(jnp.int32).max
  pos = jnp.sort(jnp.where(valid_nk, pos_nk, big), axis=-1)
  valid = pos != big
  return jnp.where(valid, pos, INVALID).astype(jnp.int32), valid


def prefix_topk(q_nik: jax.Array, w_ni: jax.Array, keys_tk: jax.Array, limit_n: jax.Array,
                k: int, *, impl: str = "xla", scratch_bytes: int = SCRATCH_BYTES,
                interpret: bool | None = None, config=None,
                radix_bits: int = RADIX_BITS) -> tuple[jax.Array, jax.Array]:
  """Each row's top-k positions among ``t < limit_n[n]`` by indexer score.

  q_nik: [N, I, K] indexer queries; w_ni: [N, I] head weights; keys_tk: [T, K] the keys
          of every position (those at or past a row's limit are never read into its picks)
  limit_n: [N] int32 in [0, T]: row n's candidates are t < limit_n[n] (0: none)
  k: picks per row; impl: ``kernels.indexer`` ('xla' | 'pallas')
  scratch_bytes: what a row block's scores and selection may take (``block_rows``)
  interpret, config: the Pallas kernel's interpret mode and launch (``IndexerConfig``)
  radix_bits: bits per pass of the radix select
  returns positions [N, k] int32 ascending (INVALID after the valid ones), valid [N, k]
          bool; ``select_topk(index_scores(...), t < limit_n[n], k)``'s set
  """
  N, I, K = q_nik.shape
  T = keys_tk.shape[0]
  if k < 1:
    raise ValueError(f"k={k}: must be >= 1")
  if keys_tk.shape != (T, K) or w_ni.shape != (N, I) or limit_n.shape != (N,):
    raise ValueError(f"q_nik {tuple(q_nik.shape)}, w_ni {tuple(w_ni.shape)}, keys_tk "
                     f"{tuple(keys_tk.shape)}, limit_n {tuple(limit_n.shape)}: expected "
                     "[N, I, K], [N, I], [T, K] and [N]")
  if scratch_bytes < 1:
    raise ValueError(f"scratch_bytes={scratch_bytes}: must be >= 1")
  scores = scores_fn(impl)
  if impl == "pallas":
    from ula_jax.kernels.indexer.pallas import IndexerConfig
    config = config or IndexerConfig()
    scores = functools.partial(scores, config=config, interpret=interpret)
  limit_n = jnp.clip(limit_n.astype(jnp.int32), 0, T)
  R = block_rows(N, T, scratch_bytes, minimum=config.block_n if impl == "pallas" else 1)
  tile = column_tile(impl, T, R, I, scratch_bytes, config)
  if impl == "xla":
    scores = functools.partial(scores, block_t=tile)
  Tp = -(-T // tile) * tile
  keys = jnp.pad(keys_tk, ((0, Tp - T), (0, 0)))  # padded positions are never candidates
  everything = jnp.arange(k, dtype=jnp.int32)

  def block(q_b, w_b, lim_b):
    def all_candidates():  # at most k candidates, a prefix: top-k picks every one
      valid = everything[None, :] < lim_b[:, None]
      return jnp.where(valid, everything[None, :], INVALID), valid

    def top_k():
      return select_prefix(scores(q_b, w_b, keys, lim_b), lim_b, k, impl=impl,
                           radix_bits=radix_bits, interpret=interpret)

    return jax.lax.cond(jnp.max(lim_b, initial=0) <= k, all_candidates, top_k)

  nb = -(-N // R)
  if nb == 1:
    return block(q_nik, w_ni, limit_n)
  pad = nb * R - N
  q_b = jnp.pad(q_nik, ((0, pad), (0, 0), (0, 0))).reshape(nb, R, I, K)
  w_b = jnp.pad(w_ni, ((0, pad), (0, 0))).reshape(nb, R, I)
  lim_b = jnp.pad(limit_n, (0, pad)).reshape(nb, R)  # padded rows: no candidates
  pos, valid = jax.lax.map(lambda a: block(*a), (q_b, w_b, lim_b))
  return pos.reshape(nb * R, k)[:N], valid.reshape(nb * R, k)[:N]


__all__ = ["IMPLS", "SCRATCH_BYTES", "SELECT_BYTES", "ascending", "block_rows", "column_tile",
           "prefix_topk", "scores_fn", "select_prefix"]
