"""engine.pack_state: the state's small leaves carried in few buffers, values unchanged
(an engine packing its state decodes what one that does not decodes: test_speculate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.engine_util import mesh_for
from ula_jax.engine.packing import StatePacking


def _state(mesh, rng):
  dp = mesh.shape["dp"]
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  return {
      "pool": put(rng.standard_normal((dp, 512, 64)).astype(np.float32), P("dp")),  # 128 KiB
      "table": put(rng.integers(-1, 99, (dp, 40)).astype(np.int32), P("dp")),
      "owner": put(rng.integers(-1, 99, (dp, 3, 5)).astype(np.int32), P("dp")),
      "bits": (put(rng.integers(0, 2**32, (dp, 7), dtype=np.uint32), P("dp")),
               put(rng.integers(0, 2**32, (dp, 1), dtype=np.uint32), P("dp"))),
      "live": put(rng.random((dp, 9)) < 0.5, P("dp")),
      "count": put(np.arange(dp, dtype=np.int32), P("dp")),
      "shared": put(rng.integers(0, 9, (6,)).astype(np.int32), P()),
      # Small, but in host memory: never joined (that would compute on the host).
      "zhost": jax.device_put(np.zeros((dp, 2, 4), np.float32),
                              NamedSharding(mesh, P("dp"), memory_kind="pinned_host")),
  }


def test_pack_and_unpack_round_trip_bit_for_bit():
  mesh = mesh_for(4)
  state = _state(mesh, np.random.default_rng(0))
  specs = jax.tree.map(lambda x: x.sharding.spec, state)
  packing = StatePacking.plan(state, specs, max_leaf_bytes=64 << 10)
  # One buffer per (dtype, sharding): uint32, int32 over dp, bool, int32 replicated.
  assert len(packing.buffers) == 4 and packing.num_packed == 7
  kept, packed = jax.jit(lambda s: packing.pack(s, mesh))(state)
  assert [k.shape for k in kept] == [state["pool"].shape, state["zhost"].shape]
  # Leaves in tree order (keys sorted): bits, count, live, owner, pool, shared, table, zhost.
  assert [p.shape for p in packed] == [(4, 7 + 1), (4, 1 + 15 + 40), (4, 9), (6,)]
  for p, b in zip(packed, packing.buffers):
    assert p.sharding.is_equivalent_to(NamedSharding(mesh, b.spec), p.ndim)
  # Joined on the host (no compilation), the same buffers with the same shardings.
  for h, p in zip(packing.pack_host(state, mesh), packed):
    assert h.sharding.is_equivalent_to(p.sharding, p.ndim)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(p))
  back = jax.jit(packing.unpack)(kept, packed)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert packing.merge(kept, packing.split(packed))["pool"] is kept[0]
  host = packing.split([np.asarray(p) for p in packed])  # numpy views, as reports read them
  for a, b in zip(host, packing.split(packed)):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert back["zhost"].sharding.memory_kind == "pinned_host"
