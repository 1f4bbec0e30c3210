"""``far_tier`` (SAC): exact reads in both modes, traffic counters, accounting, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ula_jax.config.schema import FarTierConfig, MemoryConfig
from ula_jax.core.compat import shard_map
from ula_jax.memory import build_memory_system
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.far_tier.link_model import COUNTER_KEYS
from tests.memory_util import W, Workload, local_state, prefill_fn, put_dp, step_fn

GEO = KVGeometry(num_layers=3, group_size=2, entry_width=W, index_dim=4, top_k=4,
                 kv_dtype="float32")
MODES = ("on_demand", "full_prefetch")


def make_cfg(mode="on_demand", link="cxl", far_devices=1, far_pool=None, device_pool=None, *,
             check=True) -> MemoryConfig:
  """check=False: the far_tier values skip the schema's checks and reach FarTier as
  given, so its own checks are the ones under test."""
  far_tier = (FarTierConfig if check else FarTierConfig.model_construct)(
      mode=mode, link=link, num_far_devices=far_devices, far_pool=far_pool)
  return MemoryConfig(system="far_tier", device_pool=device_pool, host_pool=0,
                      far_tier=far_tier)


def make_system(cfg, dp=1, tp=1, max_batch=3, page_size=4, max_context=40):
  return build_memory_system(cfg, GEO, MeshInfo(dp, tp), max_batch=max_batch,
                             page_size=page_size, max_context=max_context)


def expected_stats(system, sel, sel_valid, new_addr, active):
  """Per group: rows the step must load and store (each selected entry, every layer)."""
  out = []
  for g in range(GEO.num_groups):
    layers = len(GEO.group_layers(g))
    ok = sel_valid[g] & (sel[g] >= 0) & active[:, None]
    is_new = ok & (sel[g] == new_addr[:, None]) & (new_addr >= 0)[:, None]
    loads = int((ok & ~is_new).sum()) if system.mode == "on_demand" else 0
    writes = int((active & (new_addr >= 0)).sum()) * layers
    out.append({"far_read_rows": loads * layers, "far_read_ops": loads * layers,
                "far_rounds": int(loads > 0), "far_write_rows": writes,
                "far_write_ops": writes, "far_bulk_rows": 0, "far_bulk_ops": 0})
  return out


@pytest.mark.parametrize("mode", MODES)
def test_reads_equal_writes_and_counters(mode, rng):
  """Random prefills and selections (a request leaves and its row is reused): the rows
  read at ``res.slots`` are the rows written, and the counters match the selections."""
  system = make_system(make_cfg(mode))
  state = local_state(system)
  step, prefill = jax.jit(step_fn(system)), jax.jit(prefill_fn(system))
  release = jax.jit(system.release)
  wl = Workload(system, rng)
  for row in range(system.max_batch):
    for a, v, e in wl.admit(row, int(rng.integers(1, 20))):
      state = prefill(state, a, v, e, row)
  for t in range(8):
    if t == 4:
      addrs = wl.finish(1)
      state = release(state, addrs, addrs >= 0, 1)
      for a, v, e in wl.admit(1, 9):
        state = prefill(state, a, v, e, 1)
    sel, sel_valid, new_addr, active = wl.decode_inputs(GEO.top_k)
    new_e = wl.entries(system.max_batch)
    state, slots, _, stats, reads = step(state, sel, sel_valid, new_addr, active, new_e)
    wl.commit(new_addr, active, new_e)
    wl.check_reads(sel, sel_valid, active, np.asarray(reads))
    got = [{k: int(v) for k, v in s.items()} for s in stats]
    assert got == expected_stats(system, sel, sel_valid, new_addr, active)
    assert set(got[0]) == set(COUNTER_KEYS)
  assert state.far_pools.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("mode", MODES)
def test_under_shard_map_on_8_devices(mode, rng):
  dp, tp, R = 4, 2, 2
  system = make_system(make_cfg(mode, far_devices=2), dp=dp, tp=tp, max_batch=R)
  mesh = jax.make_mesh((dp, tp), ("dp", "tp"))
  state = system.init_state(mesh)
  specs = system.state_specs(state)
  strip = lambda t: jax.tree.map(lambda x: x[0], t)
  add = lambda t: jax.tree.map(lambda x: x[None], t)

  def sm(fn, n_in, out_specs):
    f = jax.jit(shard_map(lambda s, *a: add(fn(strip(s), *strip(a))), mesh=mesh,
                          in_specs=(specs,) + (P("dp"),) * n_in, out_specs=out_specs))
    return lambda s, *args: f(s, *put_dp(mesh, args))

  prefill = sm(prefill_fn(system), 4, specs)
  step = sm(step_fn(system), 5, (specs,) + (P("dp"),) * 4)
  loads = [Workload(system, np.random.default_rng(rng.integers(2**31))) for _ in range(dp)]
  for row in range(R):
    chunks = [wl.admit(row, 10) for wl in loads]
    for c in range(len(chunks[0])):
      a, v = (np.stack([chunks[d][c][i] for d in range(dp)]) for i in range(2))
      ents = np.stack([chunks[d][c][2] for d in range(dp)])  # [dp, L, C, W]
      state = prefill(state, a, v, ents, np.full((dp,), row, np.int32))
  for _ in range(3):
    inputs = [wl.decode_inputs(GEO.top_k) for wl in loads]
    new_e = [wl.entries(R) for wl in loads]
    stacked = [np.stack([inp[i] for inp in inputs]) for i in range(4)]
    ents = np.stack(new_e)  # [dp, L, B, W]
    state, _, _, stats, reads = step(state, *stacked, ents)
    for d, wl in enumerate(loads):
      sel, sel_valid, new_addr, active = inputs[d]
      wl.commit(new_addr, active, new_e[d])
      wl.check_reads(sel, sel_valid, active, np.asarray(reads)[d])
      want = expected_stats(system, sel, sel_valid, new_addr, active)
      assert [{k: int(np.asarray(v)[d]) for k, v in s.items()} for s in stats] == want
  assert state.far_pools.sharding.memory_kind == "pinned_host"
  assert state.dev_pools.sharding.memory_kind == "device"
  L = GEO.num_layers
  assert state.far_pools.shape == (dp, L * system.num_logical, W)
  assert state.dev_pools.shape == (dp, L * system.device_slots, W)
  assert state.live.shape == (dp, GEO.num_groups, system.num_logical)


@pytest.mark.parametrize("mode", MODES)
def test_accounting_hand_case(mode):
  """A 7-token request, 2 groups, tp = 1. The far pool holds 7 x 2 = 14 distinct entries.
  full_prefetch: the local copy adds 14 device rows (14 duplicates). on_demand: the
  device holds nothing between steps; after a step selecting 2 entries while decoding
  position 7, each group staged 2 + 1 = 3 rows (6 duplicates) and the far pool has 16."""
  system = make_system(make_cfg(mode), max_batch=2)
  addrs = np.arange(8, dtype=np.int32)
  entries = np.stack([np.full((8, W), l, np.float32) for l in range(3)])
  s = jax.jit(prefill_fn(system))(local_state(system), addrs, addrs < 7, entries, 0)
  add_dp = lambda st: jax.tree.map(lambda x: np.asarray(x)[None], st)
  rep = system.report(add_dp(s))
  dev = 14 if mode == "full_prefetch" else 0
  assert (rep.distinct_total, int(rep.host_used.sum()), int(rep.device_used.sum())) == (14, 14, dev)
  assert rep.duplicates == dev
  sel = np.array([[[0, 6, 0, 0], [0, 0, 0, 0]]] * 2, np.int32)
  sel_valid = np.array([[[True, True, False, False], [False] * 4]] * 2)
  new_e = tuple(np.ones((2, W), np.float32) for _ in range(3))
  s, *_ = jax.jit(step_fn(system))(s, sel, sel_valid, np.array([7, INVALID], np.int32),
                                   np.array([True, False]), new_e)
  rep = system.report(add_dp(s))
  dev = 16 if mode == "full_prefetch" else 6
  assert (rep.distinct_total, int(rep.device_used.sum()), rep.duplicates) == (16, dev, dev)
  assert rep.extra["mode"] == mode and rep.extra["far_device_of_rank"] == [0]


def test_far_pool_is_counted_once_per_rank_under_tp():
  system = make_system(make_cfg("full_prefetch"), dp=2, tp=2, max_batch=2)
  state = system.init_state(jax.make_mesh((2, 2), ("dp", "tp")))
  live = np.asarray(state.live).copy()  # [dp, G, N]
  live[0, :, :5] = True
  state = state.replace(live=live)
  rep = system.report(state)
  assert rep.host_used.tolist() == [[10, 0], [0, 0]]
  assert rep.device_used.tolist() == [[10, 10], [0, 0]]
  assert rep.distinct.tolist() == [10, 0] and rep.duplicates == 20


@pytest.mark.parametrize("mode, bulk_rows, bulk_ops", [
    ("on_demand", [10 * 3, 0], [3 * 3, 0]),
    ("full_prefetch", [2 * 10 * 3, 0], [2 * 3 * 3, 0]),
])
def test_prefill_traffic(mode, bulk_rows, bulk_ops):
  """10 tokens with 4-token pages: 3 pages per layer, 3 layers; full prefetch reads the
  prefix back, doubling both."""
  traffic = make_system(make_cfg(mode), dp=2).prefill_traffic(np.array([10, 0]))
  assert traffic["far_bulk_rows"].tolist() == bulk_rows
  assert traffic["far_bulk_ops"].tolist() == bulk_ops
  assert set(traffic) == set(COUNTER_KEYS)


def test_sizes():
  tb = GEO.token_bytes
  assert make_system(make_cfg(), max_batch=3, max_context=40).capacity_tokens == 120
  assert make_system(make_cfg(far_pool=200), dp=2).capacity_tokens == 100
  assert make_system(make_cfg(far_pool=f"{tb * 202}B"), dp=2).capacity_tokens == 100
  full = make_system(make_cfg("full_prefetch", far_pool=400, device_pool=50))
  assert full.capacity_tokens == 48 and full.device_slots == 48
  od = make_system(make_cfg("on_demand", far_pool=400, device_pool=50))
  assert od.capacity_tokens == 400 and od.device_slots == 3 * (GEO.top_k + 1)


def test_modeled_figures_from_a_run(rng):
  """The counters a run records feed the link model: every figure is labelled modeled,
  and the on-demand steps cost more far time than the same steps without reads."""
  system = make_system(make_cfg("on_demand", link="rdma"))
  state = local_state(system)
  step, prefill = jax.jit(step_fn(system)), jax.jit(prefill_fn(system))
  wl = Workload(system, rng)
  records = []
  for row in range(system.max_batch):
    for a, v, e in wl.admit(row, 12):
      state = prefill(state, a, v, e, row)
  records.append({"step": 0, "compute_s": 0.01, "decode_tokens": 0,
                  **system.prefill_traffic(12 * system.max_batch)})
  for t in range(1, 4):
    sel, sel_valid, new_addr, active = wl.decode_inputs(GEO.top_k, p_inactive=0.0)
    new_e = wl.entries(system.max_batch)
    state, _, _, stats, _ = step(state, sel, sel_valid, new_addr, active, new_e)
    wl.commit(new_addr, active, new_e)
    counters = {k: sum(int(s[k]) for s in stats) for k in COUNTER_KEYS}
    records.append({"step": t, "compute_s": 0.01, "decode_tokens": int(active.sum()), **counters})
  out = system.modeled(records, [{"arrival_step": 0, "first_token_step": 1}])
  assert all("modeled" in k for k in out)
  no_reads = [{**r, "far_read_rows": 0, "far_read_ops": 0, "far_rounds": 0} for r in records]
  base = system.modeled(no_reads)
  assert out["modeled_tbt_s"] > base["modeled_tbt_s"] > 0.01
  assert out["modeled_step_s"][0] == base["modeled_step_s"][0]


@pytest.mark.parametrize("cfg, match", [
    (make_cfg(mode="lazy", check=False), r"memory.far_tier.mode='lazy': expected one of "
                                         r"\['on_demand', 'full_prefetch'\]"),
    (make_cfg(link="nvlink", check=False), r"memory.far_tier.link='nvlink': expected one of"),
    (make_cfg(far_devices=0, check=False), r"memory.far_tier.num_far_devices=0: must be >= 1"),
    (make_cfg(far_pool=3), r"far_tier \(on_demand\) holds 0 tokens per dp rank, fewer than "
                           r"one page \(engine.page_size=4\); raise memory.far_tier.far_pool"),
    (make_cfg("full_prefetch", far_pool=400, device_pool=3),
     r"far_tier \(full_prefetch\) holds 0 tokens per dp rank.*raise memory.device_pool"),
])
def test_config_errors(cfg, match):
  with pytest.raises(ValueError, match=match):
    make_system(cfg)


def test_call_errors():
  system = make_system(make_cfg())
  state = local_state(system)

  def resolve(g, B, k):
    return jax.eval_shape(lambda s: system.resolve(
        s, g, jnp.zeros((B, k), jnp.int32), jnp.ones((B, k), bool), jnp.zeros(B, jnp.int32),
        jnp.ones(B, bool)), state)

  with pytest.raises(ValueError, match=r"sel_addr has 2 rows; expected max_batch=3"):
    resolve(0, 2, GEO.top_k)
  with pytest.raises(ValueError, match=r"selection width k=5 exceeds the model's top_k=4"):
    resolve(0, 3, 5)
  # Eagerly, so that the plan's group is a value the layer check can read.
  _, res = system.resolve(state, 0, jnp.zeros((3, GEO.top_k), jnp.int32),
                          jnp.ones((3, GEO.top_k), bool), jnp.zeros(3, jnp.int32),
                          jnp.ones(3, bool))
  with pytest.raises(ValueError, match=r"layer=2 is not in layer group 0 \(layers \[0, 1\]\)"):
    system.move_layer(state, 2, res)


def test_modeled_from_engine_records():
  """StepMetrics / RequestResult records map onto the link model's step records: the
  step's prompt tokens become bulk traffic and its summed stats the decode counters."""
  from ula_jax.engine.types import RequestResult, StepMetrics
  system = make_system(make_cfg("full_prefetch", link="rdma"), dp=2)

  def metrics(step, decode, prefill, extra):
    return StepMetrics(step=step, kind="mixed", running=decode, prefilling=int(prefill > 0),
                       waiting=0, finished=0, decode_tokens=decode, prefill_tokens=prefill,
                       step_time_s=0.5, decode_time_s=0.0, tokens_per_s=0.0, device_used=0,
                       host_used=0, distinct=0, extra=extra)

  steps = [metrics(0, 0, 10, {}), metrics(1, 2, 0, {"far_write_rows": 6, "far_write_ops": 6,
                                                     "hits": 3}),
           metrics(2, 0, 0, {})]
  reqs = [RequestResult("a", 10, 2, "finished", [1, 2], arrival_step=0, first_token_step=1)]
  got = system.modeled_from_run(steps, reqs, compute_s=0.01)
  want = system.modeled([
      {"step": 0, "compute_s": 0.01, "decode_tokens": 0, **system.prefill_traffic(10)},
      {"step": 1, "compute_s": 0.01, "decode_tokens": 2, "far_write_rows": 6,
       "far_write_ops": 6},
      {"step": 2, "compute_s": 0.0, "decode_tokens": 0}], reqs)
  assert got == want
  measured = system.modeled_from_run(steps)
  assert measured["modeled_total_s"] > 3 * 0.5
