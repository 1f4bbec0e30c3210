"""The all-hit fast path of the resolve (``kernels.resolve.fastpath``) against the full
resolve (``Ula.resolve_meta``).

States are built through the system's own transitions: prefill (device first, then the
host), full resolves with misses and evictions, and releases that open free device slots.
On steps that move nothing the fast branch must return every array of ``resolve_meta``
exactly; steps that break one condition must fail ``all_hit`` and, through
``resolve_group``, still return ``resolve_meta``'s arrays; and a sequence alternating
both kinds of step must leave identical states with the fast path on and off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
from hypothesis import given, strategies as hst

from tests.test_resolve_kernel import assert_identical, random_step
from ula_jax.config.schema import MemoryConfig
from ula_jax.config.schema import KernelsConfig
from ula_jax.memory.ula.resolve import fast_path_for, resolve_group
from ula_jax.memory.ula.resolve.fastpath import all_hit, resolve_all_hit, resolve_speculative
from ula_jax.memory.ula.resolve.pallas import ResolveConfig
from ula_jax.memory import build_memory_system
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.dp import Ula
from ula_jax.memory.ula.policies import bitmap

POLICIES = ("pb_lru", "lru")
# 48 device slots, 24 host slots, 72 logical addresses; M = 3 * (5 + 1) = 18.
SIZES = dict(device=48, host=24, B=3, k=5)
PALLAS_CONFIG = ResolveConfig(block_elems=32, block_place=16)


@functools.lru_cache(maxsize=None)
def system_for(policy: str, device: int, host: int, B: int, k: int) -> Ula:
  cfg = MemoryConfig(system="ula", device_pool=device, host_pool=host,
                     policy=policy, pb_lru_buckets=2)
  geo = KVGeometry(num_layers=1, group_size=1, entry_width=4, index_dim=2, top_k=k,
                   kv_dtype="float32")
  system = Ula(cfg, geo, MeshInfo(1, 1), max_batch=B, page_size=4, max_context=8)
  system.validate()
  return system


@functools.lru_cache(maxsize=None)
def jitted(system: Ula) -> dict:
  """Jitted transitions and resolves, cached per system so tests share their compiles."""
  run = functools.partial(resolve_group, system, impl="jnp")
  return {
      "prefill": jax.jit(system.prefill_meta),
      "release": jax.jit(system.release_meta),
      "full": jax.jit(system.resolve_meta),
      "all_hit": jax.jit(functools.partial(all_hit, system)),
      "fast": jax.jit(functools.partial(resolve_all_hit, system)),
      "spec": jax.jit(functools.partial(resolve_speculative, system)),
      "on": jax.jit(functools.partial(run, fast_path=True)),
      "off": jax.jit(functools.partial(run, fast_path=False)),
  }


def padded(addrs, n: int) -> tuple[jax.Array, jax.Array]:
  out = np.full((n,), INVALID, np.int32)
  out[:len(addrs)] = addrs
  return jnp.asarray(out), jnp.asarray(out >= 0)


def build_state(system: Ula, rng: np.random.Generator, *, stored: int, released: int,
                warm_steps: int = 2):
  """``stored`` random addresses prefilled (device first, then the host), ``warm_steps``
  full resolves with misses (policy rounds, evictions), then ``released`` random
  device-resident addresses released (free slots scattered through the pool)."""
  f, N, Sd = jitted(system), system.num_logical, system.device_slots
  meta = system.init_group_meta()
  meta = f["prefill"](meta, *padded(rng.permutation(N)[:stored], N))[0]
  for _ in range(warm_steps):
    meta = f["full"](meta, *miss_step(rng, meta, system))[0]
  table = np.asarray(meta.table)
  on_dev = np.flatnonzero((table >= 0) & (table < Sd))
  return f["release"](meta, *padded(rng.choice(on_dev, released, replace=False), N))


def hit_step(rng: np.random.Generator, meta, system: Ula):
  """A step that moves nothing: distinct device-resident selections (some not valid, one
  out of range), unstored distinct new tokens, rows selecting their own new token (row 1
  also row 0's) and, with three rows or more, an inactive last row."""
  B, k, N, Sd = system.max_batch, system.geo.top_k, system.num_logical, system.device_slots
  table = np.asarray(meta.table)
  on_dev = np.flatnonzero((table >= 0) & (table < Sd))
  unstored = np.flatnonzero(table == INVALID)
  sel = rng.choice(on_dev, B * k, replace=False).astype(np.int32).reshape(B, k)
  valid = rng.random((B, k)) < 0.85
  valid[:, 0] = True
  # Not valid (any address, out of range too): not wanted.
  sel[~valid] = rng.choice(np.concatenate([[-1, N + 1], np.arange(N)]), (~valid).sum())
  sel[0, -1], valid[0, -1] = N + 2, True  # valid but out of range: not wanted either
  new = rng.choice(unstored, B, replace=False).astype(np.int32)
  active = np.ones((B,), bool)
  if B >= 3:
    active[-1] = False
    new[-1] = rng.choice(on_dev)  # inactive: its address is ignored
  sel[:, 0] = np.where(active & (rng.random(B) < 0.7), new, sel[:, 0])
  if B >= 2:
    sel[1, 1], valid[1, 1] = new[0], True
  return tuple(map(jnp.asarray, (sel, valid, new, active)))


def miss_step(rng: np.random.Generator, meta, system: Ula):
  """``random_step`` with row 0 active and selecting a host-resident entry (if any)."""
  table = np.asarray(meta.table)
  sel, valid, new, active = random_step(rng, table, system.max_batch, system.geo.top_k)
  on_host = np.flatnonzero(table >= system.device_slots)
  if on_host.size:
    sel[0, 1], valid[0, 1] = rng.choice(on_host), True
  active[0] = True
  return tuple(map(jnp.asarray, (sel, valid, new, active)))


def free_device_slots(meta) -> int:
  return int((np.asarray(meta.dev_owner) == INVALID).sum())


@pytest.mark.parametrize("policy", POLICIES)
def test_fast_branch_equals_full_resolve(policy, rng):
  system = system_for(policy, **SIZES)
  f = jitted(system)
  for released in (4, 12):
    meta = build_state(system, rng, stored=62, released=released)
    assert free_device_slots(meta) >= SIZES["B"]
    for _ in range(2):
      args = hit_step(rng, meta, system)
      want = f["full"](meta, *args)
      assert bool(f["all_hit"](meta, *args))
      assert_identical(f["fast"](meta, *args), want)
      assert_identical(f["on"](meta, *args), want)
      assert int(want[3].n_fetch) == 0 and int(want[4]["hits"]) > 0
      meta = want[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_exactly_enough_free_slots(policy, rng):
  """As many free device slots as new tokens: still all-hit; one fewer: not."""
  system = system_for(policy, **SIZES)
  f = jitted(system)
  meta = build_state(system, rng, stored=62, released=2)
  args = hit_step(rng, meta, system)  # two active new tokens
  assert free_device_slots(meta) == 2 and bool(f["all_hit"](meta, *args))
  assert_identical(f["fast"](meta, *args), f["full"](meta, *args))
  active = args[3].at[-1].set(True)
  table = np.asarray(meta.table)
  unstored = np.flatnonzero((table == INVALID)
                            & ~np.isin(np.arange(table.shape[0]), np.asarray(args[2])))
  args = (*args[:2], args[2].at[-1].set(int(unstored[0])), active)
  assert not bool(f["all_hit"](meta, *args))
  want = f["full"](meta, *args)
  assert int(want[4]["evictions"]) == 1
  assert_identical(f["on"](meta, *args), want)


def broken(name: str, rng: np.random.Generator, meta, system: Ula, args):
  """``args`` with one condition of the fast path broken."""
  sel, valid, new, active = (np.array(a) for a in args)
  table = np.asarray(meta.table)
  Sd = system.device_slots
  on_dev = np.flatnonzero((table >= 0) & (table < Sd))
  if name == "host_selection":
    sel[2, 3], valid[2, 3] = rng.choice(np.flatnonzero(table >= Sd)), True
  elif name == "unstored_selection":
    taken = np.isin(np.arange(table.shape[0]), new[active])
    sel[2, 3], valid[2, 3] = rng.choice(np.flatnonzero((table == INVALID) & ~taken)), True
  elif name == "duplicate_hit":
    sel[0, 2] = sel[2, 3] = rng.choice(np.setdiff1d(on_dev, sel[valid]))
    valid[0, 2] = valid[2, 3] = True
  elif name == "new_on_device":
    new[1] = rng.choice(np.setdiff1d(on_dev, sel[valid]))
  elif name == "new_on_host":
    new[1] = rng.choice(np.flatnonzero(table >= Sd))
  elif name == "duplicate_new":
    new[1] = new[0]
  elif name == "no_room":  # every free slot filled by other addresses
    others = np.flatnonzero((table == INVALID) & ~np.isin(np.arange(table.shape[0]), new))
    fill = others[:free_device_slots(meta)]
    meta = jitted(system)["prefill"](meta, *padded(fill, table.shape[0]))[0]
    assert free_device_slots(meta) == 0
  else:
    raise AssertionError(name)
  return meta, tuple(map(jnp.asarray, (sel, valid, new, active)))


@pytest.mark.parametrize("policy", POLICIES)
def test_each_broken_condition_takes_the_full_resolve(policy, rng):
  system = system_for(policy, **SIZES)
  f = jitted(system)
  base = build_state(system, rng, stored=62, released=4)
  names = ("host_selection", "unstored_selection", "duplicate_hit", "new_on_device",
           "new_on_host", "duplicate_new", "no_room")
  for name in names:
    args = hit_step(rng, base, system)
    assert bool(f["all_hit"](base, *args)), name
    meta, args = broken(name, rng, base, system, args)
    assert not bool(f["all_hit"](meta, *args)), name
    assert_identical(f["on"](meta, *args), f["full"](meta, *args))
    # Speculating, the step reports the failure and reads only device slots.
    *_, slots, new_slot, _, stats = f["spec"](meta, *args)
    assert int(stats["spec_fail"]) == 1, name
    sel = np.asarray(args[0])
    read = np.asarray(slots)[np.asarray(args[1]) & (sel >= 0) & (sel < system.num_logical)]
    assert np.all((read >= 0) & (read < system.device_slots)), name
    for s in np.asarray(new_slot)[np.asarray(new_slot) >= 0]:  # only slots that were free
      assert np.asarray(meta.dev_owner)[s] == INVALID, name


@pytest.mark.parametrize("policy", POLICIES)
def test_speculative_resolve_is_the_fast_branch_when_all_hit(policy, rng):
  system = system_for(policy, **SIZES)
  f = jitted(system)
  meta = build_state(system, rng, stored=62, released=4)
  args = hit_step(rng, meta, system)
  *got, stats = f["spec"](meta, *args)
  *want, want_stats = f["full"](meta, *args)
  assert int(stats.pop("spec_fail")) == 0
  assert_identical((*got, stats), (*want, want_stats))


def run_sequence(system: Ula, rng: np.random.Generator, run_on, run_off, steps: str,
                 meta, release: int) -> tuple[int, int]:
  """Steps ``h`` (moves nothing) and ``m`` (random, with misses) from ``meta``, the fast
  path on and off; before each ``h`` step ``release`` device-resident addresses are
  released so there is room. Returns (steps that were all-hit, evictions)."""
  f, Sd, N = jitted(system), system.device_slots, system.num_logical
  on = off = meta
  taken = evictions = 0
  for kind in steps:
    if kind == "h":
      table = np.asarray(on.table)
      on_dev = np.flatnonzero((table >= 0) & (table < Sd))
      freed = padded(rng.choice(on_dev, release, replace=False), N)
      on, off = f["release"](on, *freed), f["release"](off, *freed)
      args = hit_step(rng, on, system)
    else:
      args = miss_step(rng, on, system)
    fast = bool(f["all_hit"](on, *args))
    assert fast == (kind == "h"), kind
    taken += fast
    got, want = run_on(on, *args), run_off(off, *args)
    assert_identical(got, want)
    evictions += int(want[4]["evictions"])
    on, off = got[0], want[0]
  return taken, evictions


@pytest.mark.parametrize("policy", POLICIES)
def test_sequence_fast_path_on_and_off(policy, rng):
  system = system_for(policy, **SIZES)
  f = jitted(system)
  meta = build_state(system, rng, stored=66, released=0, warm_steps=1)
  taken, evictions = run_sequence(system, rng, f["on"], f["off"], "hmhhmmh", meta, release=4)
  assert taken == 4 and evictions > 0


def test_sequence_pallas_interpret(rng):
  """The fast path around the Pallas resolve (interpret mode), tiny sizes."""
  system = system_for("pb_lru", device=8, host=4, B=1, k=3)
  run = functools.partial(resolve_group, system, impl="pallas", interpret=True,
                          config=PALLAS_CONFIG)
  run_on = jax.jit(functools.partial(run, fast_path=True))
  run_off = jax.jit(functools.partial(run, fast_path=False))
  meta = jitted(system)["prefill"](system.init_group_meta(),
                                   *padded(rng.permutation(system.num_logical)[:10], 12))[0]
  taken, evictions = run_sequence(system, rng, run_on, run_off, "hmh", meta, release=2)
  assert taken == 2 and evictions > 0


def test_config_field_reaches_the_system():
  assert KernelsConfig().resolve_fast_path == "auto"
  # 'auto': the full resolve every step on a GPU with a Pallas resolve, else the fast path.
  assert fast_path_for("auto", "jnp", "cpu") is True
  assert fast_path_for("auto", "pallas", "cpu") is True  # interpreted: the fast path
  assert fast_path_for("auto", "jnp", "gpu") is True
  assert fast_path_for("auto", "pallas_fused", "gpu") is False
  assert fast_path_for("auto", "pallas", "gpu") is False
  assert fast_path_for(True, "pallas_fused", "gpu") is True
  assert fast_path_for(False, "jnp", "cpu") is False
  with pytest.raises(ValueError, match=r"kernels.resolve_fast_path='yes': expected true"):
    fast_path_for("yes", "jnp", "cpu")
  assert KernelsConfig(resolve_fast_path=False).resolve_fast_path is False
  with pytest.raises(pydantic.ValidationError, match="resolve_fast_path"):
    KernelsConfig(resolve_fast_path="sometimes")
  cfg = MemoryConfig(system="ula", device_pool=48, host_pool=24, policy="lru",
                     pb_lru_buckets=2)
  geo = KVGeometry(num_layers=1, group_size=1, entry_width=4, index_dim=2, top_k=5,
                   kv_dtype="float32")
  build = functools.partial(build_memory_system, cfg, geo, MeshInfo(1, 1), max_batch=3,
                            page_size=4, max_context=8)
  assert build().resolve_fast_path is True
  assert build(resolve_fast_path=False).resolve_fast_path is False


@given(hst.lists(hst.integers(0, 95), max_size=40),
       hst.lists(hst.sampled_from([31, 63, 95]), max_size=6))
def test_summed_bits_count_the_positions_only_when_distinct(positions, tops):
  """The fast path's distinctness check: bits of n positions summed into words (a
  scatter-add) have n set bits exactly when the positions are distinct, carries past a
  word's top bit included."""
  pos = positions + tops
  n = len(pos)
  padded = np.full(46, -1, np.int32)  # one shape for every example: one compile
  padded[:n] = pos
  ones = int(_summed_bits(jnp.asarray(padded), jnp.arange(46) < n))
  assert (ones == n) == (len(set(pos)) == n)


@jax.jit
def _summed_bits(pos, valid):
  words = bitmap.words_of(96, pos, valid, distinct=True)
  return jnp.sum(jax.lax.population_count(words))
