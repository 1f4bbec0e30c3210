"""``count_last_many``: the capacity reports' counts, in one program and one transfer,
equal to ``count_last`` one array at a time and to numpy's count, for device arrays
(sharded over devices or not), host-memory arrays and numpy arrays alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.core.types import INVALID
from ula_jax.memory.base import count_last, count_last_many


def _numpy_count(v: np.ndarray, holds: str, limit: int | None) -> np.ndarray:
  v = v[..., :limit] if limit is not None else v
  kept = {"valid": v != INVALID, "true": v.astype(bool), "nonneg": v >= 0}[holds]
  return kept.sum(axis=-1, dtype=np.int64)


def test_counts_equal_one_at_a_time_and_numpy(rng):
  table = np.where(rng.random((2, 3, 40)) < 0.4, INVALID, rng.integers(0, 99, (2, 3, 40)))
  table = table.astype(np.int32)
  live = rng.random((2, 5, 33)) < 0.5
  slots = rng.integers(-3, 4, (4, 17)).astype(np.int32)
  mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
  sharded = jax.device_put(table, NamedSharding(mesh, P("dp")))
  specs = [(sharded, "valid", None), (jnp.asarray(table), "valid", 25),
           (jnp.asarray(live), "true", None), (jnp.asarray(slots), "nonneg", 9),
           (slots, "nonneg", None), (live, "true", 7)]
  got = count_last_many(*specs)
  assert len(got) == len(specs)
  for (x, holds, limit), n in zip(specs, got):
    want = _numpy_count(np.asarray(x), holds, limit)
    assert n.dtype == np.int64 and n.shape == want.shape
    np.testing.assert_array_equal(n, want)
    np.testing.assert_array_equal(n, count_last(x, holds, limit))


def test_a_host_memory_array_is_counted_on_the_host():
  device = jax.devices()[0]
  host = jax.device_put(np.array([[1, INVALID, 2, INVALID]], np.int32),
                        jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
  assert host.sharding.memory_kind == "pinned_host"
  dev = jnp.array([[INVALID, 5, 6]], jnp.int32)
  got = count_last_many((host, "valid", None), (dev, "valid", None), (host, "valid", 1))
  assert [n.tolist() for n in got] == [[2], [2], [1]]


def test_no_arrays_and_a_bad_holds():
  assert count_last_many() == []
  with pytest.raises(ValueError, match="holds='positive'"):
    count_last_many((jnp.zeros((2, 3), jnp.int32), "positive", None))
