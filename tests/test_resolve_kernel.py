"""The fused Pallas resolve against the jnp resolve (``Ula.resolve_meta``).

Every case builds a ula address space with a nearly full device pool (prefill), then
runs several decode-step resolves on fresh random selections: duplicates within and
across rows, invalid and out-of-range entries, addresses that are neither stored nor
new, new tokens that are selected, repeated or already stored. Both implementations
start each step from the same state and must return identical arrays: table, owners,
host free bitmap, policy state (every summary level), slots, plan and stats. The
kernels' fresh outputs are poisoned first (``resolve_group_pallas(poison=...)``), so an
element they fail to write shows up.

``TestResolvePallasGpu`` runs the kernels through Triton (a GPU); its interpret-mode
twin reruns every case on CPU. The reference itself is checked on a hand-computed step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.config.schema import MemoryConfig
from ula_jax.memory.ula.resolve import IMPLS, resolve_group
from ula_jax.memory.ula.resolve import pallas as pallas_module
from ula_jax.memory.ula.resolve.pallas import (FUSED_CONFIG, ResolveConfig, fused_programs,
                                               resolve_group_pallas,
                                               resolve_group_pallas_fused)
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.policies import bitmap
from ula_jax.memory.ula.dp import Ula, UlaState

POISON = 1_234_567_891  # no slot, address, count or INVALID has this value


@dataclasses.dataclass(frozen=True)
class Case:
  """One geometry: sizes, policy and kernel blocks (small blocks: several programs);
  ``programs``: the fused launch's (None: every SM's resident share)."""

  policy: str
  device: int
  host: int
  B: int
  k: int
  buckets: int = 2
  fill: float = 0.9  # fraction of the logical addresses stored before the steps
  config: ResolveConfig = ResolveConfig(block_elems=32, block_place=16)
  programs: int | None = None


@functools.lru_cache(maxsize=None)
def system_for(case: Case) -> Ula:
  cfg = MemoryConfig(system="ula", device_pool=case.device, host_pool=case.host,
                     policy=case.policy, pb_lru_buckets=case.buckets)
  geo = KVGeometry(num_layers=1, group_size=1, entry_width=4, index_dim=2, top_k=case.k,
                   kv_dtype="float32")
  system = Ula(cfg, geo, MeshInfo(1, 1), max_batch=case.B, page_size=4, max_context=8)
  system.validate()
  return system


@functools.lru_cache(maxsize=None)
def jitted(system: Ula) -> dict:
  """Jitted transitions, cached per system so cases share their compiles."""
  return {"prefill": jax.jit(system.prefill_meta), "resolve": jax.jit(system.resolve_meta)}


def filled_meta(system: Ula, rng: np.random.Generator, fill: float):
  """A group's address space with ``fill`` of its addresses stored, in random order
  (free device slots first, then the host), then every device slot touched once."""
  N = system.num_logical
  addrs = rng.permutation(N)[:int(N * fill)].astype(np.int32)
  meta = system.init_group_meta()
  chunk = 4096
  for i in range(0, addrs.shape[0], chunk):
    part = np.full((chunk,), INVALID, np.int32)
    part[:addrs[i:i + chunk].shape[0]] = addrs[i:i + chunk]
    meta = jitted(system)["prefill"](meta, jnp.asarray(part), jnp.asarray(part >= 0))[0]
  return meta


def random_step(rng: np.random.Generator, table: np.ndarray, B: int, k: int):
  """One decode step's selection: mostly stored addresses (with repeats), some invalid,
  out of range or neither stored nor new; new tokens unstored, selected by their own
  row, one repeated by a second row and one already stored."""
  N = table.shape[0]
  stored = np.flatnonzero(table != INVALID)
  unstored = np.flatnonzero(table == INVALID)
  sel = rng.choice(stored, (B, k)).astype(np.int32)
  valid = rng.random((B, k)) < 0.8
  junk = rng.random((B, k)) < 0.06
  pool = np.concatenate([[-1, -5, N, N + 3], unstored[:4]]).astype(np.int32)
  sel[junk] = rng.choice(pool, junk.sum())
  if unstored.size >= B:
    new = rng.choice(unstored, B, replace=False).astype(np.int32)
  else:  # everything stored: nothing new to decode
    new = np.full((B,), INVALID, np.int32)
  active = rng.random(B) < 0.9
  if B >= 2:
    new[1] = new[0]
  if B >= 3:
    new[2] = rng.choice(stored)
  sel[:, 0] = np.where(rng.random(B) < 0.7, new, sel[:, 0])
  return sel, valid, new, active


def assert_identical(got, want) -> None:
  """Every leaf of the two results equal: shape, dtype and values."""
  got_leaves, got_tree = jax.tree.flatten(got)
  want_paths, want_tree = jax.tree_util.tree_flatten_with_path(want)
  assert got_tree == want_tree
  for (path, w), g in zip(want_paths, got_leaves):
    name = jax.tree_util.keystr(path)
    g, w = np.asarray(g), np.asarray(w)
    assert (g.shape, g.dtype) == (w.shape, w.dtype), name
    bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
    assert not bad.size, (f"{name}: {bad.size} elements differ, first at {bad[0]}: "
                          f"got {g.reshape(-1)[bad[:8]]}, want {w.reshape(-1)[bad[:8]]}")


CASES = {
    # full device pool, duplicates, invalid entries: evictions every step; 3 buckets;
    # 40000 slots: 2 programs per bitmap pass, 4 summary levels (the top one assembled
    # across programs)
    "pb_lru": Case("pb_lru", device=40000, host=3000, B=3, k=37, buckets=3, fill=0.95),
    # the same in one launch (kernels.resolve=pallas_fused), with a longer ring: 9 victim
    # lists (free, cold, the 7 older buckets), padded to 16 in the place launch (3
    # buckets make 4, no padding); the default ring of 32 runs at full size on the GPU
    "pb_lru_fused": Case("pb_lru", device=40000, host=3000, B=3, k=37, buckets=8,
                         fill=0.95, config=ResolveConfig(block_elems=32, block_place=16,
                                                         fuse=True)),
    "lru": Case("lru", device=150, host=250, B=3, k=37),
    # batch 1, k far from the block, a 4-slot device pool
    "batch1": Case("pb_lru", device=4, host=4, B=1, k=3, fill=0.75),
}


class ResolvePallasCases:
  """Every case runs the Pallas resolve with ``interpret=self.INTERPRET``."""

  INTERPRET = False

  def resolve(self, case: Case, system: Ula, *args):
    return resolve_group_pallas(system, *args, config=case.config, interpret=self.INTERPRET,
                                programs=case.programs, poison=POISON)

  def check_steps(self, case: Case, rng: np.random.Generator, steps: int, step_fn=None):
    system = system_for(case)
    meta = filled_meta(system, rng, case.fill)
    evictions = 0
    for _ in range(steps):
      args = (step_fn or random_step)(rng, np.asarray(meta.table), case.B, case.k)
      args = tuple(map(jnp.asarray, args))
      want = jitted(system)["resolve"](meta, *args)
      got = self.resolve(case, system, meta, *args)
      assert_identical(got, want)
      evictions += int(want[4]["evictions"])
      meta = want[0]
    return evictions

  @pytest.mark.parametrize("name", sorted(CASES))
  def test_matches_reference(self, name, rng):
    case = CASES[name]
    if name.startswith("pb_lru"):
      assert bitmap.level_sizes(case.device) == (1250, 40, 2, 1)
    evictions = self.check_steps(case, rng, steps=3)
    assert evictions > 0  # the pool was full: victims were needed

  def test_empty_selection(self, rng):
    """Nothing selected, no row active: only the round advances."""
    case = CASES["pb_lru"]

    def empty(rng, table, B, k):
      sel, valid, new, active = random_step(rng, table, B, k)
      return sel, np.zeros_like(valid), new, np.zeros_like(active)

    assert self.check_steps(case, rng, steps=2, step_fn=empty) == 0

  @pytest.mark.parametrize("name", ["pb_lru", "pb_lru_fused", "lru"])
  def test_stacked_groups_in_place(self, name, rng):
    """With ``group`` set the kernels take every group's metadata, stacked, and resolve
    the group's part in place: its arrays equal the reference's on that group alone,
    and the other groups' are untouched."""
    case = CASES[name]
    system = system_for(case)
    metas = [filled_meta(system, rng, fill) for fill in (0.5, case.fill)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *metas)
    for group in (1, 0):
      args = random_step(rng, np.asarray(metas[group].table), case.B, case.k)
      args = tuple(map(jnp.asarray, args))
      want = jitted(system)["resolve"](metas[group], *args)
      got_meta, *got = resolve_group_pallas(
          system, stacked, *args, config=case.config, interpret=self.INTERPRET,
          programs=case.programs, poison=POISON, group=jnp.int32(group))
      metas[group] = want[0]
      assert_identical((got_meta, *got), (jax.tree.map(lambda *x: jnp.stack(x), *metas),
                                          *want[1:]))
      stacked = got_meta

  def test_hand_checked_step(self):
    """The worked example of ``test_reference_hand_checked`` through this implementation."""
    system, meta, args = hand_example()
    assert_identical(self.resolve(CASES["batch1"], system, meta, *args),
                     jitted(system)["resolve"](meta, *args))


@pytest.mark.gpu
class TestResolvePallasGpu(ResolvePallasCases):
  INTERPRET = False

  @pytest.mark.parametrize("policy,config", [
      ("pb_lru", FUSED_CONFIG),  # kernels.resolve=pallas_fused
      ("pb_lru", ResolveConfig(fuse=True)),  # one launch, the blocks of four, two per SM
      ("pb_lru", ResolveConfig()),  # kernels.resolve=pallas
      ("lru", ResolveConfig())], ids=["fused", "fused_default_blocks", "pb_lru", "lru"])
  def test_full_size(self, policy, config, rng):
    """Batch 64, k = 2048, a 256K-slot device pool, the launches ``kernels.resolve``
    runs (the one launch also with the four launches' blocks), PB-LRU with the default
    ring of 32 buckets."""
    case = Case(policy, device=1 << 18, host=1 << 18, B=64, k=2048, buckets=32, fill=0.9,
                config=config)
    assert self.check_steps(case, rng, steps=2) > 0

  @pytest.mark.parametrize("programs", [1, 3])
  def test_fused_few_programs(self, programs, rng):
    """The fused launch with fewer programs than virtual ones: every program loops
    over several blocks of each stage (one program: no barrier at all)."""
    case = dataclasses.replace(CASES["pb_lru_fused"], programs=programs)
    assert self.check_steps(case, rng, steps=2) > 0

  def test_fused_programs_must_be_resident(self):
    case = CASES["pb_lru_fused"]
    system = system_for(case)
    meta = system.init_group_meta()
    sel = jnp.zeros((case.B, case.k), jnp.int32)
    with pytest.raises(ValueError, match="programs=100000.*resident"):
      resolve_group_pallas(system, meta, sel, sel >= 0, sel[:, 0], sel[:, 0] >= 0,
                           config=case.config, interpret=False, programs=100_000)


class TestResolvePallasInterpret(ResolvePallasCases):
  INTERPRET = True


# ----------------------------------------------------------------------------------
# The reference, the dispatch and the errors
# ----------------------------------------------------------------------------------


def hand_example():
  """4 device slots, 4 host slots, PB-LRU with 2 buckets; addresses 0..5 stored (0..3
  on the device in slots 0..3, 4 and 5 in host slots 0 and 1)."""
  system = system_for(CASES["batch1"])
  meta = system.init_group_meta()
  addrs = jnp.asarray([0, 1, 2, 3, 4, 5, INVALID, INVALID], jnp.int32)
  meta = jitted(system)["prefill"](meta, addrs, addrs >= 0)[0]
  # Row 0 selects 5 (on the host), 1 (on the device) and 5 again, and decodes address 6.
  args = (jnp.asarray([[5, 1, 5]], jnp.int32), jnp.ones((1, 3), jnp.bool_),
          jnp.asarray([6], jnp.int32), jnp.ones((1,), jnp.bool_))
  return system, meta, args


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_reference_hand_checked(impl):
  system, meta, args = hand_example()
  Sd = 4
  config = CASES["batch1"].config if impl == "pallas" else None
  run = functools.partial(resolve_group, system, impl=impl, interpret=True, config=config)
  # The Pallas wrapper is jitted already (sharing the compile of the "batch1" case).
  run = jax.jit(run) if impl == "jnp" else run
  meta, slots, new_slot, plan, stats = run(meta, *args)
  # Needed, by address: 1 (hit, slot 1), 5 (miss, host 1), 6 (new). The round moved to
  # bucket 1; the hit joined it, so the victims are bucket 0's slots 0 and 2 (lowest
  # first): 5 -> slot 0, 6 -> slot 2. Their owners 0 and 2 go to host slots 1 (which 5
  # vacated) and 2.
  assert slots.tolist() == [[0, 1, 0]] and new_slot.tolist() == [2]
  table = np.asarray(meta.table)
  assert table[:7].tolist() == [Sd + 1, 1, Sd + 2, 3, Sd + 0, 0, 2]
  assert np.asarray(meta.dev_owner).tolist() == [5, 1, 6, 3]
  assert np.asarray(meta.host_owner).tolist() == [4, 0, 2, INVALID]
  assert (plan.fetch_src[:1].tolist(), plan.fetch_dst[:1].tolist()) == ([1], [0])
  assert (plan.evict_src[:2].tolist(), plan.evict_dst[:2].tolist()) == ([0, 2], [1, 2])
  assert (int(plan.n_fetch), int(plan.n_evict)) == (1, 2)
  assert all(int(x) == INVALID for x in np.asarray(plan.fetch_src)[1:])
  assert {k: int(v) for k, v in stats.items()} == {"hits": 1, "misses": 1, "evictions": 2}
  bucket = system.policy.describe(meta.policy)["bucket"]
  assert int(meta.policy.cur) == 1 and bucket.tolist() == [1, 1, 1, 0]


def test_ula_resolve_dispatches_on_resolve_impl(rng, monkeypatch):
  """``Ula.resolve`` runs the kernels when ``resolve_impl == 'pallas'``."""
  case = CASES["batch1"]
  system = system_for(case)
  meta = filled_meta(system, rng, case.fill)
  args = tuple(map(jnp.asarray, random_step(rng, np.asarray(meta.table), case.B, case.k)))
  # Only the metadata is read: one group's, stacked ([1, ...] leaves), and empty pools.
  W = system.geo.entry_width
  state = UlaState(dev_pool=jnp.zeros((0, W)), host_pool=jnp.zeros((0, W)),
                   meta=jax.tree.map(lambda x: x[None], meta),
                   index_keys=jnp.zeros((1, 0, system.geo.index_dim)))
  want_state, want = jax.jit(system.resolve, static_argnums=1)(state, 0, *args)
  pallas = Ula(system.cfg, system.geo, system.mesh_info, max_batch=case.B, page_size=4,
               max_context=8)
  pallas.resolve_impl, pallas.resolve_interpret = "pallas", True
  # The case's blocks instead of the defaults: the compile is shared with the batch1 case.
  monkeypatch.setattr(pallas_module, "ResolveConfig", lambda: case.config)
  got_state, got = pallas.resolve(state, 0, *args)
  assert_identical((got_state.meta, got), (want_state.meta, want))
  # kernels.resolve=pallas_fused: PB-LRU's resolve in one launch, the same arrays.
  fused = resolve_group(system, meta, *args, impl="pallas_fused", interpret=True,
                        config=case.config, fast_path=False)
  assert_identical(fused, jitted(system)["resolve"](meta, *args))


def test_unknown_impl_is_rejected():
  with pytest.raises(ValueError, match=r"kernels.resolve='triton': expected one of \['jnp', "
                     r"'pallas', 'pallas_fused'\]"):
    resolve_group(None, None, None, None, None, None, impl="triton")
  assert sorted(IMPLS) == ["jnp", "pallas", "pallas_fused"]


@pytest.mark.parametrize("field, value", [("block_elems", 48), ("block_place", 0),
                                          ("num_warps", 3)])
def test_config_requires_powers_of_two(field, value):
  with pytest.raises(ValueError, match=rf"ResolveConfig.{field}={value}: expected a power "
                     "of 2"):
    ResolveConfig(**{field: value})


@pytest.mark.parametrize("shapes, match", [
    (((2, 3), (2, 4), (2,), (2,)), r"sel_addr.shape=\(2, 3\), sel_valid.shape=\(2, 4\): "
                                   r"expected the same \[B, k\]"),
    (((0, 3), (0, 3), (0,), (0,)), r"sel_addr.shape=\(0, 3\): the Pallas resolve needs "
                                   r"B >= 1 and k >= 1"),
    (((2, 3), (2, 3), (3,), (2,)), r"new_addr.shape=\(3,\), active.shape=\(2,\): "
                                   r"expected \[B\] = \[2\]"),
])
def test_pallas_rejects_bad_shapes(shapes, match):
  system = system_for(CASES["pb_lru"])
  sel, valid, new, active = (jnp.zeros(s, d) for s, d in zip(
      shapes, (jnp.int32, jnp.bool_, jnp.int32, jnp.bool_)))
  with pytest.raises(ValueError, match=match):
    resolve_group_pallas(system, system.init_group_meta(), sel, valid, new, active)


@pytest.mark.parametrize("kwargs, match", [
    (dict(fuse="yes"), r"ResolveConfig.fuse='yes': expected true or false"),
    (dict(per_sm=0), r"ResolveConfig.per_sm=0: expected None or an integer in \[1, 16\]"),
    (dict(per_sm=2.5), r"ResolveConfig.per_sm=2.5: expected None"),
])
def test_config_rejects_bad_fused_launch(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ResolveConfig(**kwargs)


def test_fused_launch_programs_per_sm():
  """Two programs of 4 warps per SM fit at any register count, which the one launch's
  preset keeps (its registers follow the shapes); ``per_sm`` raises the residency limit."""
  assert ResolveConfig().resident_per_sm() == 2
  assert ResolveConfig(num_warps=2).resident_per_sm() == 4
  assert ResolveConfig(fuse=True, per_sm=3).resident_per_sm() == 3
  assert FUSED_CONFIG.fuse and FUSED_CONFIG.resident_per_sm() == 2
  assert (FUSED_CONFIG.block_elems, FUSED_CONFIG.block_place) == (128, 8)


def test_fused_programs():
  """Interpreted programs run one after another: a grid barrier between two of them
  could never complete, so interpret mode takes one program and rejects more. A device
  that does not report its SMs (this CPU) needs the count given."""
  assert fused_programs(FUSED_CONFIG, interpret=True) == 1
  assert fused_programs(FUSED_CONFIG, interpret=True, programs=1) == 1
  with pytest.raises(ValueError, match=r"programs=4: interpret mode"):
    fused_programs(FUSED_CONFIG, interpret=True, programs=4)
  with pytest.raises(ValueError, match=r"programs=0: expected a positive integer"):
    fused_programs(FUSED_CONFIG, interpret=True, programs=0)
  if getattr(jax.local_devices()[0], "core_count", None) is None:
    assert fused_programs(FUSED_CONFIG, interpret=False, programs=8) == 8
    with pytest.raises(ValueError, match=r"programs=None: the device does not report"):
      fused_programs(FUSED_CONFIG, interpret=False)


def test_stacked_resolve_checks_its_group():
  case = CASES["batch1"]
  system = system_for(case)
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), system.init_group_meta())
  sel = jnp.zeros((case.B, case.k), jnp.int32)
  args = (sel, sel >= 0, sel[:, 0], sel[:, 0] >= 0)
  with pytest.raises(ValueError, match=r"group=2: expected a group of the stacked "
                                       r"metadata, 0 <= group < 2"):
    resolve_group_pallas(system, stacked, *args, config=case.config, interpret=True,
                         group=2)
  # A traced group past the stack is clipped to its last group.
  run = lambda g: resolve_group_pallas(system, stacked, *args, config=case.config,
                                       interpret=True, group=g)
  assert_identical(jax.jit(run)(jnp.int32(7)), run(jnp.int32(1)))


def test_fused_entry_passes_programs_and_checks_poison():
  """``kernels.resolve=pallas_fused``'s entry takes ``FUSED_CONFIG`` and hands its
  ``programs`` to the launch (interpreted: one, checked before anything is traced)."""
  case = CASES["pb_lru_fused"]
  system = system_for(case)
  sel = jnp.zeros((case.B, case.k), jnp.int32)
  args = (system.init_group_meta(), sel, sel >= 0, sel[:, 0], sel[:, 0] >= 0)
  with pytest.raises(ValueError, match=r"programs=4: interpret mode"):
    resolve_group_pallas_fused(system, *args, interpret=True, programs=4)
  with pytest.raises(ValueError, match=r"poison=True: expected None or an int32 value"):
    resolve_group_pallas(system, *args, config=case.config, interpret=True, poison=True)
