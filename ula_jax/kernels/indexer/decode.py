"""A decode step's indexer scores over each row's own history, in blocks, and its top-k.

A decode step has ``engine.max_batch`` rows whose histories differ in length, and rows
without a request. Scoring every row over the engine's whole window (``index_scores`` of
``[B, T]`` gathered keys, ``T = max_context``) reads and multiplies ``B x T`` keys per
layer group whatever the batch holds: at GLM-5 geometry (32 rows, 160K-position window)
more than the rest of the step. ``length_scores`` scores only what some row needs: the
rows sorted longest first, in blocks of ``block_rows``, each block over column blocks of
``block_t`` up to its longest row (one loop on the device over those blocks, whose trip
count follows the number of rows with a history and their lengths). Positions it does
not score are ``-inf``; the caller's candidate mask excludes them anyway.

Each score is the same products as ``index_scores`` over the whole window; a GEMM of
another shape may round them differently (a few ulp), but every block has the same shape,
so a row's scores depend neither on the other rows nor on where the row sits in the
batch, and every memory system (``MemorySystem.select``, ula TP's aligned scoring) scores
with the same blocks and gets the same bits (``tests/test_decode_scores.py``).

``kernels.decode_scores=pages`` scores with a Pallas kernel instead
(``pallas.page_scores_pallas``): one program per row and two pages, reading the row's
keys page by page from the key table and exiting at once past the row's length, so the
work follows the lengths without the loops' trip counts (each a wait for the device on a
GPU). Its head sums run in another order than ``index_scores``'s (a few ulp); every
system without sharded keys scores with it alike. ``kernels.decode_scores=auto`` takes it
on a GPU with one tensor-parallel rank and bf16 keys (``scores_mode``).

``decode_topk`` takes the top-k of the scores by ``lax.top_k`` (a sort on a GPU) or by
the prefill's radix select (``kernels.decode_topk``): the same positions (ties to the lower
one), and both return them in ascending order, so attention sums them in the same order
and the two decode the same tokens bit for bit; only the time differs. ``auto`` takes the
radix select on a GPU (a fifth of a GLM-5-geometry decode step less than the sort) and the
sort elsewhere; a decode step's radix select counts in XLA (``DECODE_COUNTS``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ula_jax.core.types import INVALID
from ula_jax.kernels.indexer.pallas import pages_fit
from ula_jax.kernels.indexer.prefill import ascending, select_prefix
from ula_jax.kernels.indexer.reference import index_scores, select_topk

F32 = jnp.float32
BLOCK_ROWS = 8
BLOCK_T = 32768
MODES = ("auto", "lengths", "window", "pages")
TOPK_MODES = ("auto", "sort", "radix")


def scores_by_length(mode: str, window: int) -> bool:
  """Whether ``kernels.decode_scores=mode`` scores by length for a ``window``-position
  decode window: 'auto' where the window is longer than one column block (on a GPU each
  loop iteration waits for the device, which a short window does not repay)."""
  if mode not in MODES:
    raise ValueError(f"kernels.decode_scores={mode!r}: expected one of {list(MODES)}")
  return mode == "lengths" or (mode == "auto" and window > BLOCK_T)


def scores_mode(mode: str, window: int, *, platform: str, tp: int, page_size: int,
                index_dim: int, kv_layout: str = "bf16") -> str:
  """``kernels.decode_scores=mode`` resolved for a run: 'pages', 'lengths' or 'window'
  (what every system of the run scores with, and what its summary records).

  'auto' is 'pages' on a GPU with one tensor-parallel rank, pages and keys the kernel
  takes (``pages_fit``) and bf16 keys: the fastest form measured there, and no loop trip
  counts for the host to wait on. (FP8 key tables of 2-4 GiB, which some pool sizes give
  one system and not another, are beyond the kernel's 32-bit offsets.) Elsewhere, and
  under tensor parallelism (where ula shards keys over ranks and scores by length to
  keep the unsharded blocks), 'lengths' for a window longer than one column block
  (``BLOCK_T``), 'window' otherwise. The choice follows the
  mesh and the model, never the memory system, so every system of a comparison scores
  alike.
  """
  if mode not in MODES:
    raise ValueError(f"kernels.decode_scores={mode!r}: expected one of {list(MODES)}")
  if (mode == "auto" and platform == "gpu" and tp == 1 and kv_layout == "bf16"
      and pages_fit(page_size, index_dim)):
    return "pages"
  if mode == "pages":
    return mode
  return "lengths" if scores_by_length(mode, window) else "window"


def length_scores(q_nik: jax.Array, w_ni: jax.Array, cand_addr: jax.Array,
                  length: jax.Array, gather: Callable[[jax.Array], jax.Array], *,
                  block_rows: int | None = None, block_t: int | None = None) -> jax.Array:
  """Indexer scores of each row's first ``length`` positions.

  q_nik: [B, I, K] index queries; w_ni: [B, I] float32 head weights
  cand_addr: [B, T] int32 each position's logical address (INVALID: none)
  length: [B] int32 positions to score per row (0: the row is idle)
  gather: addresses [R, C] -> keys [R, C, K] (invalid addresses may read anything)
  block_rows, block_t: the blocks (None: ``BLOCK_ROWS``, ``BLOCK_T``, read when called)
  returns [B, T] float32: ``index_scores`` of the row's keys at positions < length
          (and at the rest of their column block), -inf elsewhere
  """
  block_rows = BLOCK_ROWS if block_rows is None else block_rows
  block_t = BLOCK_T if block_t is None else block_t
  if block_rows < 1 or block_t < 1:
    raise ValueError(f"block_rows={block_rows}, block_t={block_t}: must be >= 1")
  B, T = cand_addr.shape
  R, C = min(block_rows, B), min(block_t, T)
  Bp, Tp = -(-B // R) * R, -(-T // C) * C
  q = jnp.pad(q_nik, ((0, Bp - B), (0, 0), (0, 0)))
  w = jnp.pad(w_ni, ((0, Bp - B), (0, 0)))
  addr = jnp.pad(cand_addr, ((0, Bp - B), (0, Tp - T)), constant_values=INVALID)
  n = jnp.pad(jnp.clip(length, 0, T).astype(jnp.int32), (0, Bp - B))
  order = jnp.argsort(-n, stable=True)  # longest first; idle (and padding) rows last
  n_sorted = n[order]
  # Column blocks of each row block (its longest row comes first), 0 for blocks of idle
  # rows; one loop over every (row block, column block) pair: a single trip count per
  # group for the host to wait on, not one per row block.
  cols = -(-n_sorted[::R] // C)  # [Bp / R]
  ends = jnp.cumsum(cols)
  total = ends[-1]

  def block(i, out):
    rb = jnp.sum(ends <= i, dtype=jnp.int32)  # the row block of pair i
    cb = i - (ends[rb] - cols[rb])
    rows = jax.lax.dynamic_slice(order, (rb * R,), (R,))
    a = addr[rows[:, None], cb * C + jnp.arange(C, dtype=jnp.int32)[None, :]]  # [R, C]
    keys = jax.lax.optimization_barrier(gather(a))
    s = jax.lax.optimization_barrier(index_scores(q[rows], w[rows], keys))
    return jax.lax.dynamic_update_slice(out, s, (rb * R, cb * C))

  # The scores take the keys' sharding type (a mesh with explicit axes, where the keys
  # come from one): the buffer starts as -inf plus a zero of that type (only the type is
  # read: the gather is dead code).
  zero = jnp.zeros_like(gather(jnp.full((1, 1), INVALID, jnp.int32))[0, 0, 0], F32)
  out = jax.lax.fori_loop(0, total, block, jnp.full((Bp, Tp), -jnp.inf, F32) + zero)
  return out[jnp.argsort(order)][:B, :T]


def topk_mode(mode: str, platform: str) -> str:
  """``kernels.decode_topk=mode`` on ``platform``: 'auto' is 'radix' on a GPU, 'sort'
  elsewhere (on a CPU the radix select takes the sort's picks anyway)."""
  if mode not in TOPK_MODES:
    raise ValueError(f"kernels.decode_topk={mode!r}: expected one of {list(TOPK_MODES)}")
  if mode != "auto":
    return mode
  return "radix" if platform == "gpu" else "sort"


def decode_topk(scores_nt: jax.Array, cand_nt: jax.Array, length: jax.Array, k: int, *,
                mode: str = "sort", impl: str = "xla", interpret: bool | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """A decode step's top-k: ``kernels.decode_topk``.

  scores_nt: [N, T] float32; cand_nt: [N, T] bool, each row's positions t < length[n]
  length: [N] int32 (0: an idle row); k: picks per row
  mode: 'sort' (``select_topk``: ``lax.top_k``, a sort on a GPU, then its picks sorted
        by position) or 'radix' (``prefill.select_prefix``: radix select, the counting
        passes by ``impl``, the ``kernels.indexer`` implementation); 'auto' resolved
        (``topk_mode``) before it gets here
  returns positions [N, k] int32 in ascending order, valid ones first (INVALID after),
          valid [N, k] bool: the same arrays in either mode
  """
  if mode == "sort":
    return ascending(*select_topk(scores_nt, cand_nt, k))
  if mode != "radix":
    raise ValueError(f"kernels.decode_topk={mode!r}: expected 'sort' or 'radix' (resolve "
                     f"'auto' with topk_mode)")
  return select_prefix(scores_nt, length, k, impl=impl, interpret=interpret)


# The counting passes of a decode step's radix select (``decode_topk``'s impl): XLA's.
# With the Pallas counting kernel (``kernels.indexer=pallas``) after scoring by length, a
# GLM-5-geometry decode step on one H200 stopped with an unspecified launch failure in 3
# of 4 freshly compiled runs; XLA's counts (about 1.7 ms a step more there) ran clean.
DECODE_COUNTS = "xla"


__all__ = ["BLOCK_ROWS", "BLOCK_T", "DECODE_COUNTS", "MODES", "TOPK_MODES", "decode_topk",
           "length_scores", "scores_by_length", "scores_mode", "topk_mode"]
