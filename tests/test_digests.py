"""``engine.record_digests``: bit-exact digests of each decode step, and ``ula-jax
compare`` naming where two runs first computed different bits."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.config import ConfigError, load_config
from ula_jax.core import digest
from ula_jax.report.compare import digest_differences, first_digest_difference, group_digests
from tests.engine_util import BASE, DENSE, ROWS, TIGHT_SYSTEMS, make_requests, run_engine


# ----------------------------------------------------------------------------------
# the digests
# ----------------------------------------------------------------------------------


def test_rows_digest_ignores_order_and_invalid_rows_but_not_a_bit(rng):
  x = jnp.asarray(rng.standard_normal((3, 16, 40)), jnp.bfloat16)
  valid = jnp.asarray(rng.random((3, 16)) < 0.7)
  d = np.asarray(digest.rows_digest(x, valid))
  perm = rng.permutation(16)
  np.testing.assert_array_equal(digest.rows_digest(x[:, perm], valid[:, perm]), d)
  # An invalid row's bits do not count.
  junk = jnp.where(valid[..., None], x, jnp.asarray(7.0, jnp.bfloat16))
  np.testing.assert_array_equal(digest.rows_digest(junk, valid), d)
  # One flipped bit of one valid value changes its row's digest.
  b, i = 1, int(np.flatnonzero(np.asarray(valid[1]))[0])
  bits = np.asarray(x).view(np.uint16).copy()
  bits[b, i, 5] ^= 1
  flipped = jnp.asarray(bits.view(jnp.bfloat16))
  got = np.asarray(digest.rows_digest(flipped, valid))
  assert got[b] != d[b] and got[0] == d[0] and got[2] == d[2]


def test_positions_and_values_digests(rng):
  pos = jnp.asarray(rng.integers(0, 1 << 20, (4, 32)), jnp.int32)
  valid = jnp.ones((4, 32), bool)
  d = np.asarray(digest.positions_digest(pos, valid))
  np.testing.assert_array_equal(digest.positions_digest(pos[:, ::-1], valid), d)
  assert np.asarray(digest.positions_digest(pos.at[2, 3].add(1), valid))[2] != d[2]
  v = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
  dv = np.asarray(digest.values_digest(v))
  assert np.asarray(digest.values_digest(v[:, ::-1]))[0] != dv[0]  # order counts
  for dtype in (jnp.float8_e4m3fn, jnp.int8, jnp.bool_, jnp.int32):
    assert digest.values_digest(v.astype(dtype)).dtype == jnp.uint32
  with pytest.raises(ValueError, match="bytes"):
    digest.bits_u32(jnp.zeros(3, jnp.complex64))


def _step(sel, new, ent, out):
  return tuple(np.asarray(x, np.uint32) for x in (sel, new, ent, out))


def test_first_difference_in_the_order_a_step_computes():
  # 2 layer groups of 2 layers; steps 0 and 1 agree, step 2 differs in several places.
  same = _step([1, 2], [11, 12, 13, 14], [3, 4, 5, 6], [7, 8, 9, 10])
  a = {0: same, 1: same, 2: same}
  assert first_digest_difference(a, {0: same, 1: same, 2: same}) is None
  b = {0: same, 1: same, 2: _step([1, 99], [11, 12, 13, 14], [3, 4, 5, 99], [7, 99, 9, 10])}
  # layer 1's output (group 0) comes before group 1's selection and layer 3's entries
  assert first_digest_difference(a, b) == "token 2: layer 1's attention output (same entries)"
  c = {0: same, 1: _step([1, 2], [11, 12, 13, 14], [3, 4, 77, 6], [7, 8, 9, 10]), 2: same}
  assert first_digest_difference(a, c) == ("token 1: layer 2's stored entries read "
                                           "(same selection)")
  e = {0: same, 1: _step([1, 2], [11, 12, 0, 14], [3, 4, 77, 6], [7, 8, 9, 10])}
  assert first_digest_difference(a, e) == "token 1: layer 2's new entry (computed by the model)"
  d = {1: _step([5, 2], [11, 12, 13, 14], [3, 4, 5, 6], [7, 8, 9, 10])}  # step 1 shared
  assert first_digest_difference(a, d) == "token 1: layer group 0's selected positions"
  assert digest_differences({"r0": a, "r1": a}, {"r0": a, "r1": c, "r2": c}) == {
      "r1": "token 1: layer 2's stored entries read (same selection)"}


# ----------------------------------------------------------------------------------
# engine runs
# ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _requests():
  return make_requests(num=3, seed=5, prompt=(20, 60), output=(3, 6))


@functools.lru_cache(maxsize=None)
def _digests(system: str):
  result = run_engine(["engine.record_digests=true", f"engine.max_batch={ROWS}",
                       "kernels.resolve_fast_path=false"] + DENSE + TIGHT_SYSTEMS[system],
                      _requests())
  return result


@pytest.mark.parametrize("system", ["ula", "hisparse"])
def test_every_step_computes_residents_bits(system):
  """A memory system under pressure (misses, evictions) computes, at every decode step,
  the same selections, reads the same entry bytes and gets the same attention output as
  ``resident``: the bit-level form of the exactness test."""
  ref, got = _digests("resident"), _digests(system)
  d_ref, d_got = ref.digests, got.digests
  # one row per decode step of a request: every token but the first (prefill's)
  n_steps = sum(len(r.output_tokens) - 1 for r in ref.requests)
  assert d_ref["request"].shape == (n_steps,)
  assert d_ref["selection"].shape[1] == 2 and d_ref["entries"].shape[1] == 4
  assert len(np.unique(d_ref["entries"])) > n_steps  # digests of real data, not constants
  order = lambda d: np.lexsort((d["token"], d["request"]))
  i, j = order(d_ref), order(d_got)
  for key in ("request", "token", "selection", "new", "entries", "output"):
    np.testing.assert_array_equal(d_got[key][j], d_ref[key][i], err_msg=key)
  assert got.summary.get("total_misses", 1) > 0


def test_digests_refused_where_no_plain_decode_step_runs():
  with pytest.raises(ConfigError, match="record_digests"):
    load_config(BASE, ["engine.record_digests=true", "engine.steps_per_dispatch=4"])
  with pytest.raises(ConfigError, match="record_digests"):
    load_config(BASE, ["engine.record_digests=true", "speculative.num_draft=2"])


def test_digests_file_read_back_and_malformed_refused(tmp_path):
  from ula_jax.report.compare import read_digests
  from ula_jax.report.output import DIGESTS_FILE, RunDirError

  arrays = {"request": np.asarray(["a", "a", "b"]), "token": np.asarray([1, 0, 0], np.int32),
            "selection": np.arange(6, dtype=np.uint32).reshape(3, 2),
            "new": np.arange(30, 42, dtype=np.uint32).reshape(3, 4),
            "entries": np.arange(12, dtype=np.uint32).reshape(3, 4),
            "output": np.arange(12, 24, dtype=np.uint32).reshape(3, 4)}
  np.savez_compressed(tmp_path / DIGESTS_FILE, **arrays)
  got = read_digests(tmp_path)
  assert sorted(got) == ["a", "b"] and sorted(got["a"]) == [0, 1]
  np.testing.assert_array_equal(got["a"][1][2], [0, 1, 2, 3])
  assert read_digests(tmp_path / "nothing_here") is None
  np.savez_compressed(tmp_path / DIGESTS_FILE, **{**arrays, "token": np.zeros(2, np.int32)})
  with pytest.raises(RunDirError, match="one row per"):
    read_digests(tmp_path)
  np.savez_compressed(tmp_path / DIGESTS_FILE, request=arrays["request"])
  with pytest.raises(RunDirError, match="not a digests file"):
    read_digests(tmp_path)


def test_digests_change_no_token():
  """The digest outputs change the compiled step (more outputs, a gather per layer), not
  what the model computes: the tokens are those of the same run without them."""
  plain = run_engine([f"engine.max_batch={ROWS}", "kernels.resolve_fast_path=false"]
                     + DENSE + TIGHT_SYSTEMS["ula"], _requests())
  with_digests = _digests("ula")
  assert [r.output_tokens for r in plain.requests] == [
      r.output_tokens for r in with_digests.requests]


def test_a_requests_bits_do_not_depend_on_its_row_or_its_neighbours():
  """The same request decoded in another batch row, next to other requests at other
  stages: every decode step computes the same bits (digests) and the same tokens. A
  model whose numerics depended on the row or the batch would part here first."""
  reqs = make_requests(num=4, seed=11, prompt=(20, 60), output=(4, 7))
  target = reqs[0].id
  one_rank = ["engine.record_digests=true", "engine.max_batch=4", "mesh.dp=1"] + DENSE
  first = run_engine(one_rank, reqs)  # admitted first: row 0
  last = run_engine(one_rank, reqs[1:] + reqs[:1])  # admitted last: row 3
  pick = lambda d: np.flatnonzero(d["request"] == target)
  a, b = first.digests, last.digests
  i, j = pick(a), pick(b)
  assert len(i) == len(j) > 0
  for key in ("token", "selection", "new", "entries", "output"):
    np.testing.assert_array_equal(a[key][i], b[key][j], err_msg=key)
  rows = {r.id: r for r in first.requests}, {r.id: r for r in last.requests}
  assert rows[0][target].output_tokens == rows[1][target].output_tokens


def test_a_stored_entry_given_the_new_tokens_slot_shows_as_a_wrong_stored_entry(monkeypatch):
  """A system that hands a step's new token a slot a selected entry still lives in makes
  attention read the new token's row in that entry's place: the digest of stored entries
  (which leaves the new token's slot out) covers other rows than ``resident``'s, so
  ``compare`` names the stored entries, not only the attention output."""
  from ula_jax.core.types import INVALID
  from ula_jax.memory.resident import Resident

  ref = _digests("resident")  # before the fault is in place
  resolve = Resident.resolve

  def faulty(self, state, group, sel_addr, sel_valid, new_addr, active):
    state, res = resolve(self, state, group, sel_addr, sel_valid, new_addr, active)
    # row 0's first selected entry that is not the new token resolves to the new slot
    other = res.valid[0] & (sel_addr[0] != new_addr[0]) & active[0]
    j = jnp.argmax(other)
    slots = res.slots.at[0, j].set(jnp.where(other[j], res.new_slot[0], res.slots[0, j]))
    return state, res.replace(slots=jnp.where(res.slots == INVALID, INVALID, slots))

  monkeypatch.setattr(Resident, "resolve", faulty)
  bad = run_engine(["engine.record_digests=true", f"engine.max_batch={ROWS}",
                    "kernels.resolve_fast_path=false"] + DENSE + TIGHT_SYSTEMS["resident"],
                   _requests())
  found = digest_differences(group_digests(ref.digests), group_digests(bad.digests))
  assert found and all("stored entries read" in why for why in found.values()), found
