"""kernels.stacked_matmul: the Pallas product reading layer ``index``'s weights in place
against the reference (slice, then product), in interpret mode on fresh random inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.kernels.stacked_matmul import projections_impl, stacked_matmul
from ula_jax.models.config import ModelConfig
from ula_jax.models.layers import HeadRange
from ula_jax.models.transformer import Transformer, _run_layers, group_segments
from ula_jax.kernels.stacked_matmul.pallas import (MAX_ROWS, StackedMatmulConfig, blocks,
                                                   fits, padded_rows, splits_for,
                                                   stacked_matmul_pallas)

SMALL = StackedMatmulConfig(block_k=32, block_n=64, programs=8)


@pytest.mark.parametrize("M, K, N, dtype", [
    (1, 64, 64, jnp.float32),     # one row, one block: no split
    (7, 256, 128, jnp.float32),   # rows padded to 16; K split in 4
    (33, 512, 64, jnp.bfloat16),  # bf16 operands, float32 sums; K split in 8
])
def test_pallas_reads_each_layers_weights(M, K, N, dtype, rng):
  L = 4
  x = jnp.asarray(rng.standard_normal((M, K)), dtype)
  w = jnp.asarray(rng.standard_normal((L, K, N)) / np.sqrt(K), dtype)
  f = jax.jit(lambda x, w, i: stacked_matmul_pallas(x, w, i, config=SMALL, interpret=True))
  for i in rng.permutation(L):
    got = np.asarray(f(x, w, jnp.int32(i)))
    want = np.asarray(x, np.float32) @ np.asarray(w[i], np.float32)
    assert got.dtype == np.float32 and got.shape == (M, N)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"layer {i}")
    np.testing.assert_allclose(got, np.asarray(stacked_matmul(x, w, jnp.int32(i))),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("B, shared, transposed", [
    (4, False, False),  # per-head products (the value up-projection)
    (4, False, True),   # weights stored [N, K] (the key up-projection)
    (3, True, False),   # rows shared by every batch element (the experts' first products)
])
def test_pallas_batched_products(B, shared, transposed, rng):
  L, M, K, N = 3, 5, 64, 128
  x = jnp.asarray(rng.standard_normal((1 if shared else B, M, K)), jnp.float32)
  wshape = (L, B, N, K) if transposed else (L, B, K, N)
  w = jnp.asarray(rng.standard_normal(wshape) / np.sqrt(K), jnp.float32)
  f = jax.jit(lambda x, w, i: stacked_matmul_pallas(x, w, i, transposed=transposed,
                                                    config=SMALL, interpret=True))
  for i in rng.permutation(L):
    wl = np.asarray(w[i])
    wl = np.swapaxes(wl, -1, -2) if transposed else wl
    want = np.broadcast_to(np.asarray(x), (B, M, K)) @ wl
    got = np.asarray(f(x, w, jnp.int32(i)))
    assert got.shape == (B, M, N)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"layer {i}")
    np.testing.assert_allclose(np.asarray(stacked_matmul(x, w, jnp.int32(i),
                                                         transposed=transposed)),
                               want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("K", [32, 256])  # one program over K; K split in 8
def test_out_dtype_rounds_the_float32_sums_once(K, rng):
  """A bfloat16 result is the float32 product rounded: the same bits whether the grid
  stores the rounded sums itself (no K split) or adds partial sums first, and whatever
  the implementation."""
  L, M, N = 3, 9, 64
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((L, K, N)) / np.sqrt(K), jnp.bfloat16)
  assert splits_for(K, N, 32, 64, SMALL.programs) == (1 if K == 32 else 8)
  poison = jnp.full((M, N), jnp.nan, jnp.bfloat16)
  f = jax.jit(lambda x, w, i, out: out.at[:].set(stacked_matmul_pallas(
      x, w, i, out_dtype=jnp.bfloat16, config=SMALL, interpret=True)))
  for i in rng.permutation(L):
    f32 = stacked_matmul_pallas(x, w, jnp.int32(i), config=SMALL, interpret=True)
    got = f(x, w, jnp.int32(i), poison)
    assert got.dtype == jnp.bfloat16 and got.shape == (M, N)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(f32.astype(jnp.bfloat16), np.float32))
    ref = stacked_matmul(x, w, jnp.int32(i), out_dtype=jnp.bfloat16)
    assert ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(got, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_blocks_shrink_to_divide_the_weight():
  assert blocks(2048, 16384, StackedMatmulConfig()) == (64, 128)
  assert blocks(32, 96, StackedMatmulConfig()) == (32, 32)  # the tiny model's sizes
  assert blocks(40, 64, StackedMatmulConfig()) == (0, 64)  # 8 divides 40: too small


def test_splits_give_about_the_programs_asked_for():
  assert splits_for(2048, 16384, 64, 128, 264) == 2  # 128 column blocks x 2
  assert splits_for(16384, 1024, 64, 128, 264) == 32  # 8 column blocks x 32
  assert splits_for(128, 64, 64, 64, 264) == 2  # never below one K block a split
  assert splits_for(64, 64, 64, 64, 264) == 1
  # A cap on the float32 partial sums: at 64 rows a 1024-deep weight in 16 splits
  # writes 4 x 16 x 64 bytes a column, twice its 2 x 1024; a quarter allows 2 splits.
  assert splits_for(1024, 2048, 64, 128, 264) == 16
  assert splits_for(1024, 2048, 64, 128, 264, rows=64, max_partials=2.0) == 16
  assert splits_for(1024, 2048, 64, 128, 264, rows=64, max_partials=0.25) == 2
  assert splits_for(256, 1024, 64, 128, 264, rows=64, max_partials=0.25) == 1


@pytest.mark.parametrize("M", [1, 17, 33, 36, 48, 63, 65, 100, 129, 200, MAX_ROWS])
def test_every_decode_row_count_lowers_for_a_gpu(M):
  """Pallas's Triton lowering takes power-of-2 arrays only: any row count up to MAX_ROWS
  (a decode batch of 36 rows too, which padding to a multiple of 16 made 48) lowers for
  CUDA, here on a CPU, plain, batched per head and with weights stored [N, K]."""
  from ula_jax.kernels.triton_ir import lowered_kernels

  assert padded_rows(M) >= max(M, 16) and padded_rows(M) & (padded_rows(M) - 1) == 0
  S = jax.ShapeDtypeStruct
  for x, w, transposed in [(S((M, 512), jnp.bfloat16), S((4, 512, 1024), jnp.bfloat16), False),
                           (S((8, M, 128), jnp.bfloat16), S((4, 8, 128, 512), jnp.bfloat16), False),
                           (S((8, M, 128), jnp.bfloat16), S((4, 8, 512, 128), jnp.bfloat16), True)]:
    f = functools.partial(stacked_matmul_pallas, transposed=transposed, interpret=False)
    assert list(lowered_kernels(f, x, w, S((), jnp.int32))) == ["ula_stacked_matmul"]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [36, 100, 200])
def test_gpu_rows_that_are_not_a_power_of_2(M, rng):
  """On the GPU (compiled by Triton, not interpreted): row counts whose padding to a
  multiple of 16 was not a power of 2, plain and per head, against the reference."""
  L, K, N, B = 3, 512, 256, 4
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((L, K, N)) / np.sqrt(K), jnp.bfloat16)
  xb = jnp.asarray(rng.standard_normal((B, M, 128)), jnp.bfloat16)
  wb = jnp.asarray(rng.standard_normal((L, B, 128, N)) / np.sqrt(128), jnp.bfloat16)
  for i in rng.permutation(L):
    got = np.asarray(stacked_matmul_pallas(x, w, jnp.int32(i), interpret=False))
    want = np.asarray(x, np.float32) @ np.asarray(w[i], np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"layer {i}")
    got = np.asarray(stacked_matmul_pallas(xb, wb, jnp.int32(i), interpret=False))
    want = np.asarray(xb, np.float32) @ np.asarray(wb[i], np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"layer {i}")


def test_shapes_the_kernel_does_not_take_use_the_reference(rng):
  """A prefill chunk's rows (more than MAX_ROWS) and blocks that do not divide K or N
  take the reference's product: the same result, no kernel."""
  x, w = jnp.zeros((4, 64)), jnp.zeros((2, 64, 64))  # a shape it takes
  assert "pallas_call" in str(jax.make_jaxpr(
      lambda x, w: stacked_matmul_pallas(x, w, jnp.int32(1), config=SMALL))(x, w))
  for M, K, N in [(MAX_ROWS + 1, 64, 64), (4, 40, 64), (4, 64, 72)]:
    assert not fits(M, K, N, SMALL)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, K, N)), jnp.float32)
    f = lambda x, w: stacked_matmul_pallas(x, w, jnp.int32(1), config=SMALL)
    assert "pallas_call" not in str(jax.make_jaxpr(f)(x, w))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x, w)), np.asarray(x) @ np.asarray(w[1]),
                               rtol=1e-5, atol=1e-4)


def test_bad_arguments_are_named():
  x, w = jnp.zeros((2, 64)), jnp.zeros((3, 64, 64))
  with pytest.raises(ValueError, match=r"kernels.projections='mosaic': expected one of "
                     r"\['xla', 'pallas'\]"):
    stacked_matmul(x, w, 0, impl="mosaic")
  with pytest.raises(ValueError, match=r"x \(2, 32\) and w \(3, 64, 64\): expected"):
    stacked_matmul(x[:, :32], w, 0)


def _layer_stack(model, x, pos, heads=None):
  """The model's layer stack (``transformer._run_layers``) with each layer's products
  around attention; the absorbed query stands in for attention's latent output."""

  def select(g, layers, first, indexer, c):
    q_i, w = indexer.query(first.h, first.c_q, pos)
    key = indexer.key(first.h, pos)
    return None, c + sum(jnp.sum(a.astype(jnp.float32)) for a in (q_i, w, key))

  def attend(l, layer, proj, sel, c):
    out = layer.attn.out(layer.attn.absorb(proj.q_nope, heads), heads)
    return out, c + jnp.sum(proj.q_rope.astype(jnp.float32))

  return _run_layers(model, x, pos, jnp.float32(0), select=select, attend=attend,
                     heads=heads)


def _traced(f, x):
  """``f`` traced once: the text of its jaxpr, and what the program compiled from that
  trace returns for ``x``."""
  traced = jax.jit(f).trace(x)
  return str(traced.jaxpr), traced.lower().compile()(x)


def test_the_layer_stack_reads_its_projections_in_place(rng):
  """kernels.projections=pallas: every layer's products with its own weights (MLA's
  seven, the experts', the MLPs') and the indexers' go through the kernel, with the
  stacked weights out of the scans (placeholders), and the stack computes what the
  sliced weights compute; with a head range (tensor parallelism) the per-head products
  slice their weights."""
  cfg = ModelConfig(preset="tiny", num_layers=6)  # a mixed first group, then MoE groups
  model = Transformer(cfg)
  x = jnp.asarray(rng.standard_normal((3, cfg.hidden_size)), jnp.float32)
  pos = jnp.asarray([5, 9, 40], jnp.int32)
  text, want = _traced(lambda x: _layer_stack(model, x, pos), x)
  assert "pallas_call" not in text

  model.use_projections("pallas", interpret=True)
  jaxpr, got = _traced(lambda x: _layer_stack(model, x, pos), x)
  # One traced body per run: MLA's seven products, then a dense layer's MLP (three) or
  # the experts' and the shared expert's (six). Per segment, the group's first layer's
  # query down-projection (the indexer's input) and the indexer's query and key
  # products; its head weights (64 x 4: no block of 16 divides 4) take the reference.
  segments = group_segments(cfg)
  runs = [dense for seg in segments for dense, _ in seg.runs]
  assert jaxpr.count("pallas_call") == (sum(10 if dense else 13 for dense in runs)
                                        + 3 * len(segments)) == 42
  assert float(jnp.abs(want[0] - x).max()) > 1e-3
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4, atol=1e-4)

  # A head range (tensor parallelism): the four per-head products slice their weights
  # (on the rank's heads), the rest read in place; the results are the same.
  heads = HeadRange(0, cfg.num_heads)
  jaxpr, got = _traced(lambda x: _layer_stack(model, x, pos, heads), x)
  assert jaxpr.count("pallas_call") == 42 - 4 * len(runs)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match=r"kernels.projections='triton': expected one of"):
    model.use_projections("triton")


def test_in_place_rows_with_one_layer_groups(rng):
  """Groups of one layer (DeepSeek-V3.2's index sharing) in segments of several groups,
  the first two dense: each group's indexer and first layer read their own rows."""
  cfg = ModelConfig(preset="tiny", num_layers=5, index_share=1, num_dense_layers=2)
  model = Transformer(cfg)
  x = jnp.asarray(rng.standard_normal((2, cfg.hidden_size)), jnp.float32)
  pos = jnp.asarray([3, 17], jnp.int32)
  want = jax.jit(lambda x: _layer_stack(model, x, pos))(x)
  model.use_projections("pallas", interpret=True)
  got = jax.jit(lambda x: _layer_stack(model, x, pos))(x)
  assert [(s.num_groups, s.dense) for s in group_segments(cfg)] == [(2, (True,)),
                                                                    (3, (False,))]
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
  # A sum of many terms of both signs (about 0.1): its float32 rounding, summed in
  # another order, is absolute (seeds 26 and 265 differed by 1e-5, 1.1-1.6e-4 relative).
  np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4, atol=1e-4)


def test_auto_takes_the_kernel_on_a_gpu_only():
  assert projections_impl("auto", "gpu", interpret=False) == "pallas"
  assert projections_impl("auto", "gpu", interpret=True) == "xla"
  assert projections_impl("auto", "cpu", interpret=True) == "xla"
  assert projections_impl("pallas", "cpu", interpret=True) == "pallas"
  with pytest.raises(ValueError, match=r"kernels.projections='fast': expected one of "
                     r"\['auto', 'xla', 'pallas'\]"):
    projections_impl("fast", "gpu", interpret=False)
