"""Tensor-parallel attention: heads split over the ``tp`` mesh axis.

Splitting heads changes only the order of a sum (each rank's heads' share of the output
projection, then the sum over ranks), so split and unsplit outputs agree to float32
rounding, and every rank of the axis holds the same bits. End to end the engine decodes
with tp = 8 and dp x tp = 2 x 4 meshes, deterministically.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.core import compat
from ula_jax.config import MemoryConfig, load_config
from ula_jax.engine import Engine
from ula_jax.memory import MeshInfo
from ula_jax.memory.resident import Resident
from ula_jax.models import transformer as tfm
from ula_jax.models.config import ModelConfig
from ula_jax.models.layers import HeadRange
from tests.engine_util import BASE, DENSE, make_requests, mesh_for, run_engine

# The tiny preset with 8 heads, so that tp = 8 leaves one head per rank.
CFG = ModelConfig(preset="tiny", num_heads=8)
B, PAGE, T_MAX = 4, 8, 32
TOL = dict(rtol=2e-5, atol=2e-5)  # float32, sums regrouped


@functools.lru_cache(maxsize=None)
def _model() -> tfm.Transformer:
  return tfm.Transformer(CFG)


def _replicate(tree, mesh):
  return jax.device_put(tree, NamedSharding(mesh, P()))


def _per_rank(x: jax.Array) -> jax.Array:
  """Inside shard_map: a leading axis to stack each rank's value along (out_specs P('tp'))."""
  return x[None]


# ----------------------------------------------------------------------------------
# One attention layer
# ----------------------------------------------------------------------------------


def _attention_inputs(rng):
  S, k = 40, CFG.index_topk
  x = rng.standard_normal((B, CFG.hidden_size)).astype(np.float32)
  pos = rng.integers(0, 100, B).astype(np.int32)
  pool = rng.standard_normal((S, CFG.entry_width)).astype(np.float32)
  slots = rng.integers(0, S, (B, k)).astype(np.int32)
  valid = rng.random((B, k)) < 0.8
  valid[0] = False  # a row with nothing to attend over
  return x, pos, pool, slots, valid


@pytest.mark.parametrize("tp", [2, 8])
def test_split_heads_attention_equals_unsplit(rng, tp):
  graphdef, params = nnx.split(_model())
  layer_index = 1
  inputs = _attention_inputs(rng)

  def attention(params, x, pos, pool, slots, valid, tp_axis):
    layer = nnx.merge(graphdef, params).layer(layer_index)
    heads = None if tp_axis is None else tfm.tp_heads(CFG.num_heads, tp_axis)
    proj = layer.pre_attention(x, pos, heads)
    return tfm._absorbed_attention(layer, proj, pool, slots, valid, CFG.softmax_scale,
                                   "xla", heads, tp_axis)

  whole = jax.jit(functools.partial(attention, tp_axis=None))(params, *inputs)
  mesh = mesh_for(1, tp)
  split = jax.jit(compat.shard_map(
      lambda *a: _per_rank(attention(*a, tp_axis="tp")), mesh=mesh,
      in_specs=(P(),) * 6, out_specs=P("tp")))(*_replicate((params, *inputs), mesh))
  split = np.asarray(split)
  assert split.shape == (tp, B, CFG.hidden_size)
  for r in range(1, tp):
    np.testing.assert_array_equal(split[r], split[0])  # the same bits on every rank
  np.testing.assert_allclose(split[0], np.asarray(whole), **TOL)
  np.testing.assert_array_equal(split[0][0], 0.0)  # nothing valid, nothing attended
  assert np.abs(split[0][1:]).max() > 1e-3  # the comparison compares something


def test_rank_heads_cover_every_head_once():
  mesh = mesh_for(1, 8)

  def starts(_):
    h = tfm.tp_heads(CFG.num_heads, "tp")
    return jnp.asarray([h.start, h.count], jnp.int32)[None]

  got = jax.jit(compat.shard_map(starts, mesh=mesh, in_specs=P(), out_specs=P("tp")))(
      jnp.zeros(()))
  np.testing.assert_array_equal(np.asarray(got), [[r, 1] for r in range(8)])


def test_head_range_slices_the_query_weights(rng):
  attn = _model().layer(0).attn
  x = jnp.asarray(rng.standard_normal((3, CFG.hidden_size)), jnp.float32)
  pos = jnp.arange(3, dtype=jnp.int32)
  _, q_nope, q_rope, entry = attn.project(x, pos)
  _, q_nope2, q_rope2, entry2 = attn.project(x, pos, HeadRange(jnp.int32(2), 3))
  np.testing.assert_allclose(q_nope2, q_nope[:, 2:5], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(q_rope2, q_rope[:, 2:5], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(entry2, entry)  # the entry has no heads


def test_heads_not_divisible_by_the_axis_are_rejected():
  mesh = mesh_for(1, 4)
  with pytest.raises(ValueError, match=r"model.num_heads=6 is not divisible by the 'tp' "
                     r"mesh axis size 4"):
    jax.jit(compat.shard_map(lambda x: x + tfm.tp_heads(6, "tp").start, mesh=mesh,
                             in_specs=P(), out_specs=P()))(jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------------
# A decode step through a memory system
# ----------------------------------------------------------------------------------


def _decode_inputs(rng, mem: Resident, mesh):
  """A local Resident state with random entries and keys, and one step's inputs."""
  state = jax.tree.map(lambda x: x[0], mem.init_state(mesh))
  S = mem.num_logical
  state = state.replace(
      pools=jnp.asarray(rng.standard_normal(state.pools.shape), jnp.float32),
      index_keys=jnp.asarray(rng.standard_normal(state.index_keys.shape), jnp.float32))
  pages = T_MAX // PAGE
  page_table = rng.permutation(S // PAGE)[:B * pages].reshape(B, pages).astype(np.int32)
  positions = np.asarray([0, 5, 17, 30], np.int32)  # below, at and past top-k
  tokens = rng.integers(0, CFG.vocab_size, B).astype(np.int32)
  active = np.asarray([True, True, False, True])
  return state, tokens, positions, page_table, active


def test_decode_step_with_split_heads_matches_unsplit(rng):
  graphdef, params = nnx.split(_model())
  mem = Resident(MemoryConfig(), CFG.kv_geometry(), MeshInfo(dp=1, tp=1), max_batch=B,
                 page_size=PAGE, max_context=T_MAX)
  state, *step = _decode_inputs(rng, mem, mesh_for(1, 1))

  def decode(params, state, tokens, positions, page_table, active, tp_axis):
    return tfm.decode_step(nnx.merge(graphdef, params), mem, state, tokens, positions,
                           page_table, active, tp_axis=tp_axis)

  logits, new_state, _ = jax.jit(functools.partial(decode, tp_axis=None))(
      params, state, *step)

  mesh = mesh_for(1, 8)
  split = jax.jit(compat.shard_map(
      lambda *a: jax.tree.map(_per_rank, decode(*a, tp_axis="tp")[:2]), mesh=mesh,
      in_specs=(P(),) * 6, out_specs=P("tp")))
  tp_logits, tp_state = split(*_replicate((params, state, *step), mesh))
  tp_logits = np.asarray(tp_logits)
  for r in range(1, 8):
    np.testing.assert_array_equal(tp_logits[r], tp_logits[0])
  active = step[-1]
  np.testing.assert_allclose(tp_logits[0][active], np.asarray(logits)[active], **TOL)
  # The entries written (layers after the first see the attention output) agree too,
  # and every rank wrote the same ones.
  pool_tp = np.asarray(tp_state.pools)  # [tp, L * S, W]
  np.testing.assert_array_equal(pool_tp[7], pool_tp[0])
  np.testing.assert_allclose(pool_tp[0], np.asarray(new_state.pools), **TOL)


# ----------------------------------------------------------------------------------
# The engine on tp meshes
# ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _requests():
  return make_requests(num=4, seed=7, prompt=(9, 40), output=(3, 7))


@pytest.mark.parametrize("dp,tp", [(1, 8), (2, 4)])
def test_engine_decodes_on_tp_meshes_deterministically(dp, tp):
  # Dense MLPs (``DENSE``): tp splits the attention heads only; every rank runs the whole
  # MLP, whose MoE code is about a quarter of each step's compile time.
  overrides = DENSE + [f"mesh.dp={dp}", f"mesh.tp={tp}", "model.num_heads=8",
                       "engine.max_batch=2"]
  first, second = run_engine(overrides, _requests()), run_engine(overrides, _requests())
  assert [r.status for r in first.requests] == ["finished"] * len(_requests())
  tokens = [r.output_tokens for r in first.requests]
  assert tokens == [r.output_tokens for r in second.requests]
  assert [len(t) for t in tokens] == [r.max_new_tokens for r in _requests()]
  assert len({t for ts in tokens for t in ts}) > 3  # not a degenerate model
  assert (first.summary["dp"], first.summary["tp"]) == (dp, tp)
  # The resident baseline stores a full copy per tp rank.
  assert first.capacity["distinct_fraction"] == pytest.approx(1 / tp)


def test_engine_rejects_heads_the_tp_ranks_cannot_split():
  cfg = load_config(BASE, ["engine.progress=false"])  # tiny: 4 heads
  with pytest.raises(ValueError, match=r"model.num_heads=4 is not divisible by mesh.tp=8: "
                     r"attention heads are split evenly over the tp ranks; use mesh.tp in "
                     r"\[1, 2, 4\]"):
    Engine(cfg, mesh_for(1, 8))
