"""Sparse prefill: every prompt position its own top-k over its prefix.

The radix top-k against ``select_topk`` (the same picks, ties to the lower position),
the row-blocked indexer scores (jnp and Pallas) against ``index_scores``, the prefill
selection and attention against their unblocked forms, the dense phase against the
sparse one, and a prompt's prefill and greedy tokens against the dense reference, which
decodes the prompt one position at a time. Pallas runs in interpret mode here (outputs
start as NaN, so unwritten scores would show); the ``gpu`` twins run the kernels through
Triton at larger sizes. Fresh random inputs per run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ula_jax.config import ConfigError, load_config
from ula_jax.core.types import INVALID
from ula_jax.kernels.indexer import index_scores, prefix_topk, select_topk
from ula_jax.kernels.indexer.blocked import index_scores_blocked
from ula_jax.kernels.indexer.pallas import (IndexerConfig, index_scores_pallas,
                                            prefix_kth_largest_pallas)
from ula_jax.kernels.indexer.prefill import block_rows
from ula_jax.kernels.indexer.topk import (inclusive_count, kth_largest_key, ordered_key,
                                          select_topk_radix, topk_mask)
from ula_jax.kernels.sparse_attention import sparse_mla_attention
from ula_jax.kernels.sparse_attention.prefill import (dense_causal_attention,
                                                      sparse_attention_rows)
from ula_jax.models import transformer as tfm
from ula_jax.models.config import ModelConfig

# Keyed by the operands' dtype: float32 scores are the reference's products in another
# order (its columns in tiles, the scale applied alike); bfloat16 ones multiply on the
# tensor cores with float32 accumulation and fold 1/sqrt(K) into the head weights.
TOL = {jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5),
       jnp.dtype(jnp.bfloat16): dict(rtol=1e-4, atol=1e-4)}
QUICKSTART = "experiments/quickstart/config.yaml"

radix = jax.jit(select_topk_radix, static_argnames=("k", "radix_bits"))
radix_mask = jax.jit(topk_mask, static_argnames=("k", "radix_bits"))
reference_topk = jax.jit(select_topk, static_argnames=("k",))


def picked_sets(pos, valid) -> list[list[int]]:
  pos, valid = np.asarray(pos), np.asarray(valid)
  return [sorted(pos[n][valid[n]].tolist()) for n in range(pos.shape[0])]


def assert_ascending_compact(pos, valid):
  """Valid picks first, in ascending position order, then INVALID."""
  pos, valid = np.asarray(pos), np.asarray(valid)
  for n in range(pos.shape[0]):
    c = int(valid[n].sum())
    assert valid[n, :c].all() and not valid[n, c:].any()
    assert (np.diff(pos[n, :c]) > 0).all() and (pos[n, c:] == INVALID).all()


# ----------------------------------------------------------------------------------
# Radix top-k
# ----------------------------------------------------------------------------------


def test_ordered_key_is_the_total_order():
  x = np.asarray([-np.inf, -2.0, -0.0, 0.0, 1e-30, 3.0, np.inf], np.float32)
  keys = np.asarray(ordered_key(jnp.asarray(x)))
  assert (np.diff(keys.astype(np.int64)) > 0).all()  # -0.0 below +0.0, as lax.top_k


def test_inclusive_count_by_hand():
  mask = np.zeros((2, 300), bool)
  mask[0, [0, 127, 128, 299]] = True
  mask[1] = True
  got = np.asarray(inclusive_count(jnp.asarray(mask)))
  np.testing.assert_array_equal(got, np.cumsum(mask, axis=1))


@pytest.mark.parametrize("case", ["normal", "ties", "signed_zeros", "minus_inf", "few"])
def test_radix_topk_picks_select_topk_set(rng, case):
  N, T, k = 6, 300, 37
  s = rng.standard_normal((N, T)).astype(np.float32)
  cand = rng.random((N, T)) < 0.8
  if case == "ties":  # many equal scores: the lower positions win, as in lax.top_k
    s = np.round(s).astype(np.float32)
  elif case == "signed_zeros":
    s = np.where(rng.random((N, T)) < 0.5, np.float32(0.0), np.float32(-0.0))
  elif case == "minus_inf":  # candidates scoring -inf tie with the non-candidates
    s[rng.random((N, T)) < 0.6] = -np.inf
  elif case == "few":  # fewer candidates than k; none; all
    cand[0] = np.arange(T) < 5
    cand[1] = False
    cand[2] = True
  want = reference_topk(jnp.asarray(s), jnp.asarray(cand), k=k)
  for bits in (2, 4):
    got = radix(jnp.asarray(s), jnp.asarray(cand), k=k, radix_bits=bits)
    assert picked_sets(*got) == picked_sets(*want)
    assert_ascending_compact(*got)
    mask = np.asarray(radix_mask(jnp.asarray(s), jnp.asarray(cand), k=k, radix_bits=bits))
    assert [sorted(np.flatnonzero(row).tolist()) for row in mask] == picked_sets(*want)


def test_radix_topk_with_fewer_positions_than_k(rng):
  s = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
  cand = jnp.asarray([[True] * 5, [False] * 5, [True, False, True, False, True]])
  pos, valid = radix(s, cand, k=8)
  np.testing.assert_array_equal(np.asarray(pos), [[0, 1, 2, 3, 4, -1, -1, -1], [-1] * 8,
                                                  [0, 2, 4, -1, -1, -1, -1, -1]])
  np.testing.assert_array_equal(np.asarray(valid), np.asarray(pos) >= 0)


def test_pallas_counting_passes_find_the_kth_key(rng):
  N, T, k, bits = 5, 272, 19, 4  # T a multiple of 16, not of the counting block
  s = rng.standard_normal((N, T)).astype(np.float32)
  s[0, :40] = 0.0
  s[0, 40:80] = -0.0
  limit = np.asarray([T, 0, 19, 20, 150], np.int32)
  cand = np.arange(T)[None, :] < limit[:, None]
  want = kth_largest_key(ordered_key(jnp.where(cand, s, -jnp.inf)), k, radix_bits=bits)
  # Programs of one 16-position step each: those past a row's limit read nothing.
  got = jax.jit(functools.partial(prefix_kth_largest_pallas, k=k, radix_bits=bits,
                                  interpret=True, segment=16))(jnp.asarray(s),
                                                               jnp.asarray(limit))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------------
# Indexer scores in tiles, and the prefill selection
# ----------------------------------------------------------------------------------


def _indexer_inputs(rng, N, I, K, T, dtype):
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  return normal(N, I, K), jnp.asarray(rng.standard_normal((N, I), np.float32)), normal(T, K)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blocked_and_pallas_scores_match_the_reference(rng, dtype):
  N, I, K, T = 24, 4, 16, 96
  q, w, keys = _indexer_inputs(rng, N, I, K, T, dtype)
  limit = jnp.asarray(rng.integers(0, T + 1, N).astype(np.int32)).at[0].set(T)
  want = np.asarray(index_scores(q, w, keys))
  cand = np.arange(T)[None, :] < np.asarray(limit)[:, None]
  blocked = jax.jit(functools.partial(index_scores_blocked, block_t=32))(q, w, keys, limit)
  pallas = jax.jit(functools.partial(index_scores_pallas, interpret=True,
                                     config=IndexerConfig(block_n=16, block_t=32)))(
                                         q, w, keys, limit)
  for got in (blocked, pallas):
    got = np.asarray(got)
    assert got.shape == (N, T)
    np.testing.assert_allclose(np.where(cand, got, 0), np.where(cand, want, 0),
                               **TOL[jnp.dtype(dtype)])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_prefix_topk_is_select_topk_of_the_prefix(rng, impl):
  N, I, K, T, k = 40, 4, 16, 200, 8
  q, w, keys = _indexer_inputs(rng, N, I, K, T, jnp.float32)
  # Rows of no candidate, of at most k (every one picked), of more, of all.
  limit = np.concatenate([[0, 1, k, k + 1, T], rng.integers(0, T + 1, N - 5)]).astype(np.int32)
  limit[8:16] = np.arange(8) + 1  # a whole row block of at most k candidates each
  cand = jnp.arange(T)[None, :] < jnp.asarray(limit)[:, None]
  want = reference_topk(index_scores(q, w, keys), cand, k=k)
  # 'xla': 16-row blocks (three, the last one padded); 'pallas': one block of every row.
  scratch = 16 * 24 * 256 if impl == "xla" else 1 << 30
  got = jax.jit(functools.partial(prefix_topk, k=k, impl=impl, scratch_bytes=scratch,
                                  interpret=True))(q, w, keys, jnp.asarray(limit))
  assert picked_sets(*got) == picked_sets(*want)
  assert_ascending_compact(*got)
  pos = np.asarray(got[0])
  for n in np.flatnonzero(limit <= k):  # every candidate, in order
    np.testing.assert_array_equal(pos[n, :limit[n]], np.arange(limit[n]))


def test_block_rows_fit_the_scratch():
  assert block_rows(4096, 65536, 1 << 30) == 512  # 24 bytes per row and position
  assert block_rows(4096, 1024, 1 << 30) == 4096  # never more than the chunk
  assert block_rows(100, 1 << 20, 1) == 1
  assert block_rows(4096, 65536, 1 << 20, minimum=64) == 64


# ----------------------------------------------------------------------------------
# Attention of many rows
# ----------------------------------------------------------------------------------


def test_attention_in_row_blocks_equals_one_call(rng):
  N, H, Dl, Dr, S, k = 10, 4, 32, 16, 64, 8
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  q_lat, q_rope, pool = normal(N, H, Dl), normal(N, H, Dr), normal(S, Dl + Dr)
  slots = jnp.asarray(rng.integers(0, S, (N, k)), jnp.int32)
  valid = jnp.asarray(rng.random((N, k)) < 0.7).at[3].set(False)
  want = jax.jit(functools.partial(sparse_mla_attention, scale=0.3))(q_lat, q_rope, pool,
                                                                    slots, valid)
  per_row = k * 4 * (Dl + Dr) + 3 * H * k * 4
  got = jax.jit(functools.partial(sparse_attention_rows, scale=0.3, impl="xla",
                                  scratch_bytes=3 * per_row))(q_lat, q_rope, pool, slots,
                                                              valid)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_causal_attention_is_attention_over_every_earlier_position(rng, dtype):
  N, H, Dl, Dr, Tw = 9, 4, 32, 16, 8
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  q_lat, q_rope, window = normal(N, H, Dl), normal(N, H, Dr), normal(Tw, Dl + Dr)
  limit = jnp.asarray([0, 1, 2, 3, 5, 8, 8, 4, 7], jnp.int32)
  everything = jnp.broadcast_to(jnp.arange(Tw, dtype=jnp.int32), (N, Tw))
  # The kernels' numerics for 16-bit rows (the Pallas kernel in interpret mode), the
  # reference's for float32 ones.
  impl = "pallas" if dtype == jnp.bfloat16 else "xla"
  want = jax.jit(functools.partial(sparse_mla_attention, scale=0.2, impl=impl,
                                   interpret=True))(q_lat, q_rope, window, everything,
                                                    everything < limit[:, None])
  got = jax.jit(functools.partial(dense_causal_attention, scale=0.2,
                                  scratch_bytes=2 * 3 * H * Tw * 4))(q_lat, q_rope, window,
                                                                     limit)
  tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)
  assert not np.asarray(got[0]).any()  # no position: zeros


# ----------------------------------------------------------------------------------
# A prompt end to end against the dense reference
# ----------------------------------------------------------------------------------


def test_prefill_and_tokens_match_the_dense_reference(rng):
  """Chunks of 6 at top-k 8: the first chunk is dense, the second holds rows with at
  most k and with more candidates, the last is partial. A tiny scratch puts every
  selection and attention in row blocks. The dense reference decodes the prompt one
  position at a time: its indexer scores every earlier position and ``lax.top_k``
  picks, attention is non-absorbed over the picks."""
  cfg = ModelConfig(preset="tiny", num_layers=2, num_dense_layers=0, index_share=1)
  model = tfm.Transformer(cfg)
  graphdef, params = nnx.split(model)
  T, C, new, cap = 20, 6, 6, 32
  prompt = rng.integers(0, cfg.vocab_size, T).astype(np.int32)

  ref_logits, tokens = [], []
  ws = tfm.init_workspace(cfg, cap, batch=1)
  for t in range(T + new - 1):
    tok = prompt[t] if t < T else tokens[-1]
    logits, ws = tfm.decode_dense_reference_jit(graphdef, params, ws, jnp.asarray([tok]),
                                                jnp.asarray([t], jnp.int32))
    ref_logits.append(np.asarray(logits[0]))
    if t >= T - 1:
      tokens.append(int(np.argmax(ref_logits[-1])))

  ws = tfm.init_workspace(cfg, cap)
  for s in range(0, T, C):
    n = min(C, T - s)
    piece = np.zeros(C, np.int32)
    piece[:n] = prompt[s:s + n]
    _, _, logits, ws = tfm.prefill_chunk_jit(graphdef, params, ws, jnp.asarray(piece),
                                             jnp.int32(s), jnp.int32(n), scratch_bytes=1024)
    np.testing.assert_allclose(np.asarray(logits), ref_logits[s + n - 1], rtol=1e-4,
                               atol=1e-4)
  got = [int(np.argmax(logits))]
  ws = jax.tree.map(lambda a: a[None], ws)
  for t in range(T, T + new - 1):
    logits, ws = tfm.decode_dense_reference_jit(graphdef, params, ws,
                                                jnp.asarray([got[-1]]),
                                                jnp.asarray([t], jnp.int32))
    got.append(int(np.argmax(logits[0])))
  assert got == tokens


# ----------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------


def test_prefill_config_fields():
  cfg = load_config(QUICKSTART, [])
  assert cfg.engine.prefill_scratch_bytes == 1 << 30 and cfg.kernels.indexer == "auto"
  cfg = load_config(QUICKSTART, ["engine.prefill_scratch=512MiB", "kernels.indexer=pallas"])
  assert cfg.engine.prefill_scratch_bytes == 512 << 20 and cfg.kernels.uses_pallas
  assert load_config(QUICKSTART, ["engine.prefill_scratch=2097152"]
                     ).engine.prefill_scratch_bytes == 2 << 20
  bad = [("engine.prefill_scratch=1000", r"engine.prefill_scratch=1000: must be at least 1MiB"),
         ("engine.prefill_scratch=lots", r"engine.prefill_scratch='lots': expected bytes"),
         ("engine.prefill_scratch=true", r"engine.prefill_scratch"),
         ("kernels.indexer=mosaic", r"kernels.indexer")]
  for override, match in bad:
    with pytest.raises(ConfigError, match=match):
      load_config(QUICKSTART, [override])


def test_argument_errors():
  with pytest.raises(ValueError, match=r"IndexerConfig.block_t=24: expected a power of 2"):
    IndexerConfig(block_t=24)
  with pytest.raises(ValueError, match=r"indexer config 'x64': expected e.g."):
    IndexerConfig.parse("x64")
  assert IndexerConfig.parse("n32t64") == IndexerConfig(block_n=32, block_t=64)
  with pytest.raises(ValueError, match=r"kernels.indexer='mosaic': expected one of"):
    prefix_topk(jnp.zeros((2, 1, 16)), jnp.zeros((2, 1)), jnp.zeros((4, 16)),
                jnp.zeros(2, jnp.int32), 2, impl="mosaic")
  with pytest.raises(ValueError, match=r"radix_bits=3: must divide 32"):
    kth_largest_key(jnp.zeros((1, 4), jnp.uint32), 2, radix_bits=3)


def test_bench_arguments_are_checked(capsys):
  from ula_jax.bench import prefill

  for argv, match in ((["--radix-bits", "3"], "expected divisors of 32"),
                      (["--prompt", "1K,2K"], "expected one size"),
                      (["--repeats", "0"], "expected >= 1")):
    with pytest.raises(SystemExit):
      prefill.main(argv)
    assert match in capsys.readouterr().err
  flops = prefill.layer_flops_per_token(load_config(QUICKSTART, []).model)
  assert set(flops) == {"attention projections", "MLP and experts", "indexer projections"}
  assert all(v > 0 for v in flops.values())


# ----------------------------------------------------------------------------------
# GPU twins (Triton kernels at sizes nearer the real ones)
# ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_prefix_topk_pallas_matches_reference(rng):
  N, I, K, T, k = 256, 32, 128, 8192, 2048
  q, w, keys = _indexer_inputs(rng, N, I, K, T, jnp.bfloat16)
  limit = jnp.asarray(np.sort(rng.integers(0, T + 1, N)).astype(np.int32))
  cand = jnp.arange(T)[None, :] < limit[:, None]
  blocked = jax.jit(functools.partial(index_scores_blocked, block_t=512))(q, w, keys, limit)
  pallas = jax.jit(index_scores_pallas)(q, w, keys, limit)
  np.testing.assert_allclose(np.where(cand, np.asarray(pallas), 0),
                             np.where(cand, np.asarray(blocked), 0), rtol=1e-3, atol=1e-3)
  want = reference_topk(blocked, cand, k=k)
  for impl in ("xla", "pallas"):
    got = jax.jit(functools.partial(prefix_topk, k=k, impl=impl, scratch_bytes=64 << 20))(
        q, w, keys, limit)
    # Scores of the two scorers may differ in the last bit: compare each with its own.
    if impl == "xla":
      assert picked_sets(*got) == picked_sets(*want)
    assert_ascending_compact(*got)
  s = jnp.asarray(rng.standard_normal((N, T)), jnp.float32)
  assert picked_sets(*radix(s, cand, k=k)) == picked_sets(*reference_topk(s, cand, k=k))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_gpu_attention_rows_match_reference(rng, impl):
  N, H, Dl, Dr, S, k = 512, 64, 512, 64, 8192, 2048
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(
      jnp.bfloat16)
  q_lat, q_rope, pool = normal(N, H, Dl), normal(N, H, Dr), normal(S, Dl + Dr)
  slots = jnp.asarray(rng.integers(0, S, (N, k)), jnp.int32)
  valid = jnp.asarray(rng.random((N, k)) < 0.9)
  want = sparse_attention_rows(q_lat, q_rope, pool, slots, valid, scale=0.04, impl="xla",
                               scratch_bytes=1 << 30)
  got = sparse_attention_rows(q_lat, q_rope, pool, slots, valid, scale=0.04, impl=impl,
                              scratch_bytes=1 << 30)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
