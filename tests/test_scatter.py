"""``core.scatter``: masked scatters whose skipped entries lie past the whole array."""

import numpy as np
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st

from ula_jax.core.scatter import masked_index, set_every_group, set_where


def _case(G, S, n, seed):
  """x [G, S]; n entries (gi, si) with values: the kept ones at distinct elements, the
  skipped ones anywhere, in range or at the edge; want: x with the kept entries set."""
  rng = np.random.default_rng(seed)
  x = rng.integers(-50, 50, (G, S)).astype(np.int32)
  flat = rng.permutation(G * S)[:n]
  gi, si = flat // S, flat % S
  keep = rng.random(len(flat)) < 0.6
  si = np.where(keep, si, rng.choice([S, 0, S - 1], len(flat)))
  values = rng.integers(100, 200, len(flat)).astype(np.int32)
  want = x.copy()
  want[gi[keep], si[keep]] = values[keep]
  return x, gi, si, keep, values, want


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 30), st.integers(0, 2**31 - 1),
       st.booleans())
def test_set_where_writes_the_kept_entries_and_nothing_else(G, S, n, seed, unique):
  x, gi, si, keep, values, want = _case(G, S, n, seed)
  got = set_where(jnp.asarray(x), (jnp.asarray(gi), jnp.asarray(si)), jnp.asarray(values),
                  jnp.asarray(keep), unique=unique)
  np.testing.assert_array_equal(np.asarray(got), want)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3), st.integers(0, 2**31 - 1))
def test_a_skipped_entry_is_past_the_end_in_every_axis(dims, seed):
  # XLA's deterministic scatter orders entries by their row-major offset without bounds
  # checks: a skipped entry must not share an offset with any element of the array.
  rng = np.random.default_rng(seed)
  n = 16
  index = [rng.integers(-3, d + 3, n) for d in dims]
  keep = rng.random(n) < 0.5
  idx = [np.asarray(i) for i in masked_index(dims, [jnp.asarray(i) for i in index],
                                             jnp.asarray(keep))]
  for i, d, orig in zip(idx, dims, index):
    np.testing.assert_array_equal(i[keep], orig[keep])
    assert np.all(i[~keep] == d)
  # The offset XLA computes: the row-major strides of the array, no bounds checks.
  strides = np.cumprod([1] + dims[::-1][:-1])[::-1]
  flat = sum(i.astype(np.int64) * s for i, s in zip(idx, strides))
  assert np.all(flat[~keep] >= np.prod(dims))


def test_a_scalar_major_index_broadcasts():
  x = jnp.zeros((2, 3), jnp.int32)
  got = set_where(x, (1, jnp.array([0, 2, 1])), jnp.array([4, 5, 6]),
                  jnp.array([True, False, True]))
  np.testing.assert_array_equal(np.asarray(got), [[0, 0, 0], [4, 6, 0]])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_unique_set_where_gives_each_skipped_entry_its_own_index_past_the_end(G, S, n, seed):
  # With unique=True the scatter is declared unique, so no two entries, kept or skipped,
  # may share an index, and every skipped one must lie past the array.
  _, gi, si, keep, _, _ = _case(G, S, n, seed)
  idx = [np.asarray(i) for i in masked_index((G, S), (jnp.asarray(gi), jnp.asarray(si)),
                                             jnp.asarray(keep), distinct=True)]
  assert len(set(zip(idx[0].tolist(), idx[1].tolist()))) == len(gi)
  assert np.all(idx[0][~keep] >= G) and np.all(idx[1][~keep] == S)
  np.testing.assert_array_equal(idx[0][keep], gi[keep])
  np.testing.assert_array_equal(idx[1][keep], si[keep])


def test_unique_set_where_broadcasts_a_scalar_major_index():
  x = jnp.zeros((2, 3), jnp.int32)
  got = set_where(x, (1, jnp.array([0, 2, 1])), jnp.array([4, 5, 6]),
                  jnp.array([True, False, True]), unique=True)
  np.testing.assert_array_equal(np.asarray(got), [[0, 0, 0], [4, 6, 0]])


def test_set_every_group_sets_the_kept_columns_of_every_group():
  x = jnp.zeros((3, 4, 2), jnp.int32)
  got = set_every_group(x, jnp.array([3, 0, 1]), 7, jnp.array([True, False, True]))
  want = np.zeros((3, 4, 2), np.int32)
  want[:, [3, 1]] = 7
  np.testing.assert_array_equal(np.asarray(got), want)
