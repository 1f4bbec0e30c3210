"""Replaying a selection trace through a memory system, without the model.

Two engines count the same things (each memory system's ``Resolution.stats`` per decode
step and layer group, and its ``CapacityReport``):

* ``system``: the memory system's own jax transitions (``write_prefill``, ``resolve`` per
  group, ``release``; ``move_layer`` / ``write_token`` only move data and are skipped)
  on a state whose KV rows and indexer keys are one column wide: the system is built
  with the trace's geometry, so its slot counts are the live run's, and a twin of it
  with one-column rows holds the state (no entry bytes are stored or moved). Any
  system, any mesh (ula TP runs over ``mesh.tp`` devices in ``shard_map``). Events run
  in batches of one kind, each a ``lax.scan`` in one jitted call with the state donated
  (a scan over mixed events would need a conditional, and XLA on the CPU copies a
  conditional's operands: the whole metadata per event).
* ``fast``: the NumPy models of ``traces.fast`` (ula DP, hisparse, resident), which make
  the same choices as the jax code (tests compare them) at a fraction of the time on a
  CPU. The default where a model exists.

A replay is per dp rank (``SelectionTrace`` is one rank's stream).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Literal

import numpy as np

from ula_jax.config.schema import MemoryConfig
from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.base import CapacityReport, MemorySystem
from ula_jax.memory.registry import system_class
from ula_jax.memory.traces.format import DECODE, PREFILL, RELEASE, SelectionTrace

Engine = Literal["fast", "system"]
ENGINES: tuple[str, ...] = ("fast", "system")


@dataclasses.dataclass
class Replay:
  """What one rank's replay counted.

  counts:  [T, G, K] int64 per decode step and layer group, K = ``stat_keys`` (the
           system's ``Resolution.stats``: ``hits`` / ``misses`` / ``evictions`` for
           ula and hisparse, ``far_*`` for far_tier, none for resident)
  reports: ``(decode steps done, CapacityReport)`` taken as the replay went
  """

  system: str
  engine: str
  stat_keys: tuple[str, ...]
  counts: np.ndarray
  reports: list[tuple[int, CapacityReport]]
  seconds: float  # the replay itself (compiles excluded)
  compile_seconds: float = 0.0

  def totals(self) -> dict[str, int]:
    return {k: int(self.counts[..., i].sum()) for i, k in enumerate(self.stat_keys)}

  def per_group(self, key: str) -> np.ndarray:
    """[G] int64 one counter summed over the steps."""
    return self.counts[..., self.stat_keys.index(key)].sum(axis=0)

  def peak_report(self) -> CapacityReport | None:
    """The report with the most device slots in use (a live run's ``capacity``)."""
    if not self.reports:
      return None
    return max(self.reports, key=lambda r: int(r[1].device_used.sum()))[1]


# ----------------------------------------------------------------------------------
# The system a trace replays through
# ----------------------------------------------------------------------------------


def rank_memory_config(cfg: MemoryConfig, geometry: KVGeometry, *, dp: int = 1) -> MemoryConfig:
  """``cfg`` with its pool sizes in tokens of ``geometry`` and sized for one dp rank
  (``memory.far_tier.far_pool`` is shared by the ``dp`` ranks): a system built from it
  on any geometry has the same slots as one built from ``cfg`` on ``geometry``."""
  tb = geometry.token_bytes
  tokens = lambda v, field: v if v is None else parse_size(v, field=field, token_bytes=tb)
  far = tokens(cfg.far_tier.far_pool, "memory.far_tier.far_pool")
  return cfg.model_copy(update={
      "device_pool": tokens(cfg.device_pool, "memory.device_pool"),
      "host_pool": tokens(cfg.host_pool, "memory.host_pool"),
      "far_tier": cfg.far_tier.model_copy(update={
          "far_pool": None if far is None else far // dp}),
  })


def build_rank_system(cfg: MemoryConfig, geometry: KVGeometry, *, tp: int = 1, dp: int = 1,
                      max_batch: int, page_size: int, max_context: int) -> MemorySystem:
  """The memory system one dp rank of a run ran (``mesh.dp = dp``, ``mesh.tp = tp``),
  validated: its sizes are the run's, its state has no dp axis beyond 1."""
  cls = system_class(cfg.system, tp)
  system = cls(rank_memory_config(cfg, geometry, dp=dp), geometry, MeshInfo(1, tp),
               max_batch=max_batch, page_size=page_size, max_context=max_context)
  system.validate()
  return system


def check_fits(trace: SelectionTrace, system: MemorySystem) -> None:
  """ValueError naming the field when ``trace`` cannot replay through ``system``."""
  geo = system.geo
  if trace.num_groups != geo.num_groups:
    raise ValueError(f"trace has {trace.num_groups} layer groups ({trace.num_layers} layers "
                     f"in groups of {trace.group_size}); the memory system has "
                     f"{geo.num_groups} (model.num_layers={geo.num_layers}, "
                     f"model.index_share={geo.group_size})")
  if trace.top_k != geo.top_k:
    raise ValueError(f"trace selects top-k={trace.top_k} per row and group; the memory "
                     f"system resolves model.index_topk={geo.top_k}")
  if trace.max_batch != system.max_batch:
    raise ValueError(f"trace has {trace.max_batch} batch rows; the memory system has "
                     f"engine.max_batch={system.max_batch}: set engine.max_batch="
                     f"{trace.max_batch}")
  if system.num_logical < trace.num_logical:
    raise ValueError(
        f"memory.system={system.name!r} holds {system.num_logical} logical addresses per "
        f"rank with this memory section; the trace uses {trace.num_logical} "
        f"(trace.num_logical): raise the pools ({_pool_fields(system.name)})")


def _pool_fields(name: str) -> str:
  return {"ula": "memory.device_pool, memory.host_pool",
          "hisparse": "memory.host_pool or memory.hisparse.host_to_device_ratio",
          "far_tier": "memory.far_tier.far_pool",
          }.get(name, "memory.device_pool")


# ----------------------------------------------------------------------------------
# Replay
# ----------------------------------------------------------------------------------


def replay(trace: SelectionTrace, system: MemorySystem, *, engine: Engine = "fast",
           report_every: int = 1, mesh: Any = None, steps_per_call: int = 16,
           on_progress: Callable[[int], None] | None = None, validate: bool = True) -> Replay:
  """Replays ``trace`` (one rank's) through ``system`` (built for one rank, e.g. by
  ``build_rank_system``) and counts.

  engine: 'fast' (the NumPy model, where ``traces.fast`` has one; else 'system') or
    'system' (the system's jax transitions)
  report_every: decode steps between capacity reports (one after the last step too)
  mesh: 'system' only: a mesh with axes ('dp', 'tp') of shape (1, tp); None = the first
    ``tp`` devices
  steps_per_call: 'system' only: decode steps per jitted call
  on_progress: called with the decode steps done so far
  validate: check the trace first (``SelectionTrace.validate``: a pass over all of it)
  """
  if engine not in ENGINES:
    raise ValueError(f"engine={engine!r}: expected one of {list(ENGINES)}")
  if validate:
    trace.validate()
  check_fits(trace, system)
  if engine == "fast":
    from ula_jax.memory.traces.fast import fast_model

    model = fast_model(system)
    if model is not None:
      return _replay_fast(trace, system, model, report_every, on_progress)
  return SystemReplay(system, mesh).run(trace, report_every=report_every,
                                        steps_per_call=steps_per_call,
                                        on_progress=on_progress)


def _replay_fast(trace, system, model, report_every, on_progress) -> Replay:
  T, G, K = trace.num_steps, trace.num_groups, len(model.stat_keys)
  counts = np.zeros((T, G, K), np.int64)
  reports: list[tuple[int, CapacityReport]] = []
  kind, ref = np.asarray(trace.kind), np.asarray(trace.ref)
  done, since = 0, 0
  t0 = time.perf_counter()
  for e in range(kind.shape[0]):
    if kind[e] == DECODE:
      t = int(ref[e])
      if since >= report_every:  # after the previous step's releases, as the engine does
        reports.append((done, model.report()))
        since = 0
      counts[t] = model.decode(np.asarray(trace.sel_addr[t]), np.asarray(trace.sel_valid[t]),
                               np.asarray(trace.new_addr[t]), np.asarray(trace.active[t]))
      done, since = done + 1, since + 1
      if on_progress is not None:
        on_progress(done)
    elif kind[e] == PREFILL:
      model.prefill(trace.event_addrs(e), int(trace.row[e]))
    else:
      model.release(trace.event_addrs(e), int(trace.row[e]))
  reports.append((done, model.report()))
  return Replay(system=system.name, engine="fast", stat_keys=tuple(model.stat_keys),
                counts=counts, reports=reports, seconds=time.perf_counter() - t0)


# ----------------------------------------------------------------------------------
# Through the system's jax transitions
# ----------------------------------------------------------------------------------


def thin_twin(system: MemorySystem) -> MemorySystem:
  """A copy of ``system`` with the same slots whose KV rows and indexer keys are one
  column wide (its state stores no entry bytes). Pool sizes given in bytes are turned
  into the system's tokens first, so both have the same slots (checked)."""
  geo = system.geo
  thin = dataclasses.replace(geo, entry_width=1, index_dim=1, layout=None,
                             index_layout=None)
  cfg = rank_memory_config(system.cfg, geo)
  twin = type(system)(cfg, thin, system.mesh_info, max_batch=system.max_batch,
                      page_size=system.page_size, max_context=system.max_context)
  twin.fetch_impl, twin.fetch_interpret = "xla", None
  twin.resolve_impl, twin.resolve_interpret = "jnp", None
  # The all-hit fast path gives the same results through a lax.cond per group: on the
  # CPU the conditional copies the group's metadata (see the module docstring).
  twin.resolve_fast_path = False
  twin.validate()
  for attr in ("num_logical", "capacity_tokens", "device_slots", "host_slots"):
    a, b = getattr(system, attr, None), getattr(twin, attr, None)
    if a != b:
      raise AssertionError(f"thin twin of {system.name}: {attr}={b}, the system has {a}")
  return twin


def _bucket(n: int) -> int:
  """``n`` rounded up to a power of two (at least 1)."""
  return 1 << max(n - 1, 0).bit_length()


class SystemReplay:
  """A memory system's jax transitions over a thin state (``thin_twin``) on a mesh of
  one dp rank and ``system.mesh_info.tp`` tp ranks."""

  def __init__(self, system: MemorySystem, mesh: Any = None):
    import jax
    from jax.sharding import PartitionSpec as P

    from ula_jax.core import compat

    self.system, self.twin = system, thin_twin(system)
    tp = system.mesh_info.tp
    if mesh is None:
      devices = jax.devices()
      if len(devices) < tp:
        raise ValueError(f"replaying memory.system={system.name!r} with mesh.tp={tp} needs "
                         f"{tp} devices; this process has {len(devices)}")
      mesh = jax.sharding.Mesh(np.asarray(devices[:tp]).reshape(1, tp), ("dp", "tp"))
    self.mesh = mesh
    self.state = self.twin.init_state(mesh)
    self.specs = self.twin.state_specs(self.state)
    self._programs: dict = {}
    self._P, self._jax, self._compat = P, jax, compat

  # -- programs ---------------------------------------------------------------------

  def _mapped(self, local, n_in: int):
    P = self._P
    return self._compat.shard_map(local, mesh=self.mesh, in_specs=(self.specs,) + (P(),) * n_in,
                                  out_specs=(self.specs, P()))

  def _program(self, kind: int, length: int, width: int):
    key = (kind, length, width)
    if key in self._programs:
      return self._programs[key]
    import jax.numpy as jnp
    from jax import lax

    twin, geo = self.twin, self.twin.geo
    G, L = geo.num_groups, geo.num_layers

    if kind == DECODE:
      def local(state, sel_addr, sel_valid, new_addr, active):
        st = twin.to_local(state)

        def step(st, x):
          sa, sv, na, ac = x

          def group(st, y):
            g, a, v = y
            st, res = twin.resolve(st, g, a, v, na, ac)
            return st, {k: jnp.asarray(s, jnp.int32) for k, s in res.stats.items()}

          return lax.scan(group, st, (jnp.arange(G, dtype=jnp.int32), sa, sv))

        st, stats = lax.scan(step, st, (sel_addr, sel_valid, new_addr, active))
        return twin.from_local(st), stats
      n_in = 4
    else:
      def local(state, addrs, rows):
        st = twin.to_local(state)

        def event(st, x):
          a, r = x
          if kind == PREFILL:
            entries = jnp.zeros((L, a.shape[0], 1), geo.kv_dtype)
            st = twin.write_prefill(st, a, a >= 0, entries, r)
          else:
            st = twin.release(st, a, a >= 0, r)
          return st, jnp.zeros((), jnp.int32)

        st, _ = lax.scan(event, st, (addrs, rows))
        return twin.from_local(st), {}
      n_in = 2
    fn = self._jax.jit(self._mapped(local, n_in), donate_argnums=0)
    self._programs[key] = fn
    return fn

  # -- running ----------------------------------------------------------------------

  def _calls(self, trace: SelectionTrace, steps_per_call: int, events_per_call: int):
    """The trace as jitted calls: runs of one event kind, cut into calls of
    ``steps_per_call`` (decode) or ``events_per_call`` events, or 1 (the rest), so
    only a few programs are compiled. yields (kind, [events])."""
    kind = np.asarray(trace.kind)
    e, E = 0, kind.shape[0]
    while e < E:
      k = int(kind[e])
      end = e
      while end < E and kind[end] == k:
        end += 1
      per = steps_per_call if k == DECODE else events_per_call
      while e < end:
        n = per if end - e >= per else 1
        yield k, list(range(e, e + n))
        e += n

  def run(self, trace: SelectionTrace, *, report_every: int = 1, steps_per_call: int = 16,
          events_per_call: int = 16,
          on_progress: Callable[[int], None] | None = None) -> Replay:
    jax = self._jax
    T, G = trace.num_steps, trace.num_groups
    kind, ref, count = (np.asarray(trace.kind), np.asarray(trace.ref),
                        np.asarray(trace.count))
    widths = {k: _bucket(int(count[kind == k].max(initial=1))) for k in (PREFILL, RELEASE)}
    calls = list(self._calls(trace, steps_per_call, events_per_call))

    def inputs(k, events):
      if k == DECODE:
        ts = [int(ref[e]) for e in events]
        t0, t1 = ts[0], ts[-1] + 1
        return (np.asarray(trace.sel_addr[t0:t1]), np.asarray(trace.sel_valid[t0:t1]),
                np.asarray(trace.new_addr[t0:t1]), np.asarray(trace.active[t0:t1]))
      w = widths[k]
      addrs = np.full((len(events), w), INVALID, np.int32)
      for i, e in enumerate(events):
        a = trace.event_addrs(e)
        addrs[i, :a.shape[0]] = a
      return addrs, np.maximum(np.asarray(trace.row)[events], 0).astype(np.int32)

    # Compile every program the calls need before the timed run.
    t_compile = time.perf_counter()
    seen = {}
    for k, events in calls:
      key = (k, len(events))
      if key not in seen:
        seen[key] = events
    for (k, n), events in seen.items():
      fn = self._program(k, n, widths.get(k, 0))
      args = inputs(k, events)
      self._programs[(k, n, widths.get(k, 0))] = fn.lower(self.state, *args).compile()
    compile_s = time.perf_counter() - t_compile

    stat_keys: tuple[str, ...] | None = None
    counts = None
    reports: list[tuple[int, CapacityReport]] = []
    done, since = 0, 0
    t0 = time.perf_counter()
    for k, events in calls:
      if k == DECODE and since >= report_every:
        reports.append((done, self.system.report(self.state)))
        since = 0
      fn = self._programs[(k, len(events), widths.get(k, 0))]
      self.state, stats = fn(self.state, *inputs(k, events))
      if k != DECODE:
        continue
      if stat_keys is None:
        stat_keys = tuple(sorted(stats))
        counts = np.zeros((T, G, len(stat_keys)), np.int64)
      ts = [int(ref[e]) for e in events]
      got = jax.device_get(stats)
      for i, key in enumerate(stat_keys):
        counts[ts, :, i] = np.asarray(got[key])
      done, since = done + len(events), since + len(events)
      if on_progress is not None:
        on_progress(done)
    jax.block_until_ready(self.state)
    reports.append((done, self.system.report(self.state)))
    seconds = time.perf_counter() - t0
    if stat_keys is None:  # no decode step
      stat_keys = ()
      counts = np.zeros((T, G, 0), np.int64)
    return Replay(system=self.system.name, engine="system", stat_keys=stat_keys,
                  counts=counts, reports=reports, seconds=seconds, compile_seconds=compile_s)
