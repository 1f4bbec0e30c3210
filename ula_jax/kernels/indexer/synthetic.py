"""Decode selections with stated locality (``workload.selections: synthetic``).

A random-weight model's indexer, and every model over synthetic prompt keys
(``workload.prefill: synthetic``), selects nearly new entries at every decode step,
where a trained model's selections repeat from step to step (consecutive steps share
about 87% of the trained small model's top-2048, RESULTS.md "Selections"). Hit rates,
miss traffic and the throughput that depends on them then say little about serving.
This module replaces the ranking a decode step's top-k is taken over with a seeded
one whose locality is set by three numbers (``SyntheticSelection``; the window's default
is top-k / 32); the model, the memory systems, the top-k and attention run unchanged.

The score of history position ``p`` for the row whose new token sits at position
``L`` (its history is ``[0, L]``), in layer group ``g``:

* ``p > L - window``: 2.0, above every other score: the newest ``window`` positions,
  the new token's own among them, are always selected;
* otherwise ``salience * u(p) + (1 - salience) * u(p, g, epoch)``, where ``u(p)`` is a
  uniform draw fixed per position (shared by the groups: a position that matters to one
  group tends to matter to the others) and ``u(p, g, epoch)`` one redrawn every
  ``period`` positions of ``L``, the epochs staggered per position and group
  (``epoch = (L + phase(p, g)) // period``).

Every draw is a 32-bit integer hash of (seed, p, g, epoch): no state is carried from
step to step, each row's selection depends only on its own length, and every memory
system, rank and process computes the same bits. The top-k of these scores changes by
about ``1/period`` of its entries a step, less the ones whose salience keeps them in;
dropped entries come back at a rate the salience sets. At GLM-5 geometry (top-k 2048,
64K-token histories, 32 steps) the defaults (period 4, salience 0.9, window 64) give
consecutive-step overlap 0.874 and exact-LRU miss rates of 0.126 / 0.050 / 0.042 for
per-request buffers of k / 2k / 4k entries, against the trained small model's 0.874 and
0.126 / 0.055 / 0.009 (``tests/test_synthetic_selection.py`` checks them;
``engine.record_trace`` and ``ula-jax trace stats`` measure any setting). Two rows of
the same length select the same positions of their own histories.

``override`` adds the indexer's scores scaled by 2**-60 to the synthetic ones: the
indexer's work stays in the compiled step (its cost is part of a step's time), while
the ranking is the synthetic one (the added term is below half a unit in the last
place of any score that can reach a top-k).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NOTE = ("workload.selections='synthetic': decode steps select by seeded scores of stated "
        "locality (workload.selection_period, selection_salience, selection_window), not by "
        "the indexer's scores; hit rates follow that locality, not a trained model's "
        "selections")

# A scale that keeps the indexer's scores in the program without changing the ranking.
_KEEP = 2.0 ** -60
_ALWAYS = 2.0  # above every drawn score (those are < 1)


@dataclasses.dataclass(frozen=True)
class SyntheticSelection:
  """``workload.selections: synthetic``: what the decode selections keep from step to
  step (period: positions of history between redraws of a position's per-group score;
  salience: the weight of its fixed score, 0 to 1; window: the newest positions always
  selected, the new token's own among them; seed: the draws' seed)."""

  period: int = 4
  salience: float = 0.9
  window: int = 64
  seed: int = 0

  def __post_init__(self):
    if self.period < 1:
      raise ValueError(f"workload.selection_period={self.period}: must be >= 1")
    if not 0.0 <= self.salience <= 1.0:
      raise ValueError(f"workload.selection_salience={self.salience}: must be in [0, 1]")
    if self.window < 1:
      raise ValueError(f"workload.selection_window={self.window}: must be >= 1 (the new "
                       f"token's own position is always selected)")

  def describe(self) -> dict:
    """The run summary's record of the selections."""
    return {"kind": "synthetic", **dataclasses.asdict(self)}


def mix32(x: jax.Array) -> jax.Array:
  """A 32-bit integer hash (two multiply-xorshift rounds; bijective on uint32)."""
  x = jnp.asarray(x).astype(jnp.uint32)
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _unit(h: jax.Array) -> jax.Array:
  """The top 24 bits of ``h`` as a float32 in [0, 1) (exactly representable)."""
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def selection_scores(spec: SyntheticSelection, group: int | jax.Array, col_pos: jax.Array,
                     positions: jax.Array) -> jax.Array:
  """[B, T] float32 synthetic scores of history positions ``col_pos`` ([B, T] or
  [1, T] int32) for rows whose new tokens sit at ``positions`` ([B] int32), in layer
  group ``group``. Positions after a row's new token get scores too; the caller's
  candidate mask leaves them out."""
  p = jnp.asarray(col_pos).astype(jnp.uint32)
  L = jnp.asarray(positions, jnp.int32)[:, None]
  h_p = mix32(p ^ mix32(jnp.uint32(spec.seed & 0xFFFFFFFF)))
  g = jnp.asarray(group).astype(jnp.uint32)
  h_pg = mix32(h_p ^ mix32(g + jnp.uint32(0x9E3779B9)))
  phase = (h_pg % jnp.uint32(spec.period)).astype(jnp.int32)
  epoch = ((jnp.maximum(L, 0) + phase) // spec.period).astype(jnp.uint32)
  drawn = (jnp.float32(spec.salience) * _unit(h_p)
           + jnp.float32(1.0 - spec.salience) * _unit(mix32(h_pg ^ mix32(epoch))))
  recent = jnp.asarray(col_pos, jnp.int32) > L - spec.window
  return jnp.where(recent, jnp.float32(_ALWAYS), drawn)


def override(spec: SyntheticSelection | None, scores: jax.Array, group: int | jax.Array,
             col_pos: jax.Array, positions: jax.Array) -> jax.Array:
  """``scores`` ([B, T] float32 indexer scores of positions ``col_pos``) ranked by the
  synthetic selection ``spec``; ``scores`` itself where ``spec`` is None."""
  if spec is None:
    return scores
  synth = selection_scores(spec, group, col_pos, positions)
  return synth + scores.astype(jnp.float32) * jnp.float32(_KEEP)
