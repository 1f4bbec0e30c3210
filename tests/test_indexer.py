"""The lightning indexer: scores and top-k selection."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ula_jax.core.types import INVALID
from ula_jax.models.config import ModelConfig
from ula_jax.kernels.indexer import index_scores, select_topk
from ula_jax.models.layers import Indexer


def test_index_scores_hand_computed():
  # I = K = 2, so q is scaled by 1/sqrt(2).
  q = jnp.asarray([[[2., 0.], [0., -2.]]])  # [1, I, K]
  w = jnp.asarray([[1., 0.5]])  # [1, I]
  keys = jnp.asarray([[1., 1.], [-1., -0.5]])  # [T, K]
  # t0: head 0 relu(2) * 1 + head 1 relu(-2) * 0.5 = 2     -> 2 / sqrt(2)
  # t1: head 0 relu(-2) * 1 + head 1 relu(1) * 0.5 = 0.5   -> 0.5 / sqrt(2)
  expected = np.asarray([[2 / math.sqrt(2), 0.5 / math.sqrt(2)]])
  np.testing.assert_allclose(np.asarray(index_scores(q, w, keys)), expected, rtol=1e-6)
  # Per-row candidate keys give the same scores as shared keys.
  np.testing.assert_allclose(np.asarray(index_scores(q, w, keys[None])), expected, rtol=1e-6)


def test_index_scores_match_formula(rng):
  N, I, K, T = 3, 4, 8, 11
  q = rng.standard_normal((N, I, K)).astype(np.float32)
  w = rng.standard_normal((N, I)).astype(np.float32)
  keys = rng.standard_normal((N, T, K)).astype(np.float32)
  expected = np.einsum("ni,nit->nt", w,
                       np.maximum(np.einsum("nik,ntk->nit", q, keys) / math.sqrt(K), 0))
  got = index_scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(keys))
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,k", [(32, 8), (5, 8)])  # T < k: fewer positions than picks
def test_select_topk_properties(rng, T, k):
  contexts = np.asarray([1, 3, k - 1, k, k + 1, T, T // 2 + 1])
  contexts = np.clip(contexts, 1, T)
  N = contexts.shape[0]
  scores = rng.standard_normal((N, T)).astype(np.float32)
  cand = np.arange(T)[None, :] < contexts[:, None]
  pos, valid = select_topk(jnp.asarray(scores), jnp.asarray(cand), k)
  pos, valid = np.asarray(pos), np.asarray(valid)
  assert pos.shape == (N, k) and pos.dtype == np.int32
  for n in range(N):
    ctx = contexts[n]
    picked = pos[n][valid[n]]
    assert valid[n].sum() == min(k, ctx)
    assert len(set(picked.tolist())) == len(picked)  # no duplicates
    assert ((picked >= 0) & (picked < ctx)).all()  # in range, never a future position
    assert (pos[n][~valid[n]] == INVALID).all()
    # The picks are the best-scoring candidates, best first.
    order = np.argsort(-scores[n, :ctx], kind="stable")[:min(k, ctx)]
    np.testing.assert_array_equal(picked, order)


def test_select_topk_ties_go_to_lower_positions():
  T, k = 20, 8
  scores = jnp.zeros((2, T))
  cand = jnp.asarray([np.arange(T) < 15, np.arange(T) >= 4])
  pos, valid = select_topk(scores, cand, k)
  np.testing.assert_array_equal(np.asarray(pos[0]), np.arange(8))
  np.testing.assert_array_equal(np.asarray(pos[1]), np.arange(4, 12))
  assert bool(valid.all())


def test_select_topk_no_candidates():
  pos, valid = select_topk(jnp.ones((1, 6)), jnp.zeros((1, 6), bool), 4)
  assert not bool(valid.any())
  np.testing.assert_array_equal(np.asarray(pos), INVALID)


def test_indexer_module_shapes_and_key_dtype(rng):
  cfg = ModelConfig(preset="tiny", kv_dtype="bfloat16")
  indexer = Indexer(cfg, rngs=nnx.Rngs(0))
  x = jnp.asarray(rng.standard_normal((5, cfg.hidden_size)), jnp.float32)
  cq = jnp.asarray(rng.standard_normal((5, cfg.q_lora_rank)), jnp.float32)
  pos = jnp.arange(5, dtype=jnp.int32)
  q, w = indexer.query(x, cq, pos)
  key = indexer.key(x, pos)
  assert q.shape == (5, cfg.index_n_heads, cfg.index_head_dim)
  assert w.shape == (5, cfg.index_n_heads) and w.dtype == jnp.float32
  assert key.shape == (5, cfg.index_head_dim) and key.dtype == jnp.bfloat16
  # Keys are RMS-normalised (before the bfloat16 rounding of storage).
  rms = np.sqrt(np.mean(np.asarray(key, np.float32) ** 2, axis=-1))
  np.testing.assert_allclose(rms, 1.0, rtol=2e-2)


def test_indexer_scores_depend_on_relative_position(rng):
  """RoPE on the first index_rope dimensions: the same query and key contents score
  alike at the same distance, differently at another; without it, alike everywhere."""
  for rope, moves in ((None, True), (0, False)):
    cfg = ModelConfig(preset="tiny", kv_dtype="float32", index_rope_dim=rope)
    assert cfg.index_rope == (cfg.index_head_dim // 2 if rope is None else 0)
    indexer = Indexer(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((1, cfg.hidden_size)), jnp.float32)
    cq = jnp.asarray(rng.standard_normal((1, cfg.q_lora_rank)), jnp.float32)

    def dot(qp, kp):
      q, _ = indexer.query(x, cq, jnp.asarray([qp], jnp.int32))
      k = indexer.key(x, jnp.asarray([kp], jnp.int32))
      return np.asarray(jnp.einsum("nik,nk->ni", q, k))

    np.testing.assert_allclose(dot(10, 3), dot(107, 100), rtol=1e-4, atol=1e-4)
    assert (not np.allclose(dot(10, 3), dot(10, 9), atol=1e-3)) == moves


def test_index_rope_dim_is_validated():
  with pytest.raises(ValueError, match="model.index_rope_dim=3"):
    ModelConfig(preset="tiny", index_rope_dim=3)
  with pytest.raises(ValueError, match="model.index_rope_dim=64"):
    ModelConfig(preset="tiny", index_rope_dim=64)
