"""Selection traces through ula: replay a trace under each ula policy, side by side.

The trace format and its recorder are ``ula_jax.memory.traces.format`` (re-exported here:
``SelectionTrace``, ``TraceRecorder``, ``PREFILL`` / ``DECODE`` / ``RELEASE``).

Replaying runs only ula's metadata path (``prefill_meta`` / ``resolve_meta`` /
``release_meta``: tables, owners, policy; no pools, no data) and counts hits, misses and
evictions, so policies and pool sizes can be compared on the same selections. A replay is
one compiled ``lax.scan`` over the trace's events: no host round trip per step (meant for
recorded runs; ``ula_jax.memory.traces.replay`` replays traces of any size through any
memory system). The addresses are logical, so a trace replays under any
``memory.device_pool`` / ``memory.host_pool`` whose capacity covers ``trace.num_logical``.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ula_jax.config.schema import MemoryConfig
from ula_jax.core.scatter import update_groups
from ula_jax.core.types import INVALID, MeshInfo
from ula_jax.memory.traces.format import (DECODE, EVENT_NAMES, PREFILL, RELEASE,
                                          SelectionTrace, TraceRecorder)
from ula_jax.memory.ula.dp import Ula

__all__ = ["DECODE", "EVENT_NAMES", "PREFILL", "RELEASE", "ReplayResult", "SelectionTrace",
           "TraceRecorder", "compare_policies", "compare_policies_per_rank", "replay",
           "system_for_trace"]


# ----------------------------------------------------------------------------------
# Replay
# ----------------------------------------------------------------------------------


@dataclasses.dataclass
class ReplayResult:
  """Counts of one replay: per decode step and layer group ([T, G] int64)."""

  policy: str
  hits: np.ndarray
  misses: np.ndarray
  evictions: np.ndarray
  # Wall time of the compiled replay (compile excluded): the resolves, with the prefill
  # and release updates between them, run on the device as one call.
  resolve_seconds: float

  @property
  def hit_rate(self) -> float:
    """Hits over lookups (hits + misses); NaN when nothing was looked up."""
    h, m = int(self.hits.sum()), int(self.misses.sum())
    return h / (h + m) if h + m else float("nan")

  def as_dict(self) -> dict:
    return {"policy": self.policy, "hits": int(self.hits.sum()),
            "misses": int(self.misses.sum()), "evictions": int(self.evictions.sum()),
            "hit_rate": self.hit_rate, "steps": int(self.hits.shape[0]),
            "resolve_seconds": self.resolve_seconds}


def _check_fits(trace: SelectionTrace, system: Ula) -> None:
  if trace.num_groups != system.geo.num_groups:
    raise ValueError(f"trace has {trace.num_groups} layer groups; the system has "
                     f"{system.geo.num_groups}")
  if (trace.max_batch, trace.top_k) != (system.max_batch, system.geo.top_k):
    raise ValueError(
        f"trace selections are [batch={trace.max_batch}, k={trace.top_k}]; the system "
        f"resolves [engine.max_batch={system.max_batch}, top_k={system.geo.top_k}]")
  if system.num_logical < trace.num_logical:
    raise ValueError(
        f"memory.device_pool + memory.host_pool = {system.device_slots} + "
        f"{system.host_slots} tokens hold {system.num_logical} logical addresses; the "
        f"trace needs trace.num_logical={trace.num_logical}: raise the pools")


_NOOP = 3  # a padding op of the replay program: leaves the metadata as it is


def _bucket(n: int) -> int:
  """``n`` rounded up to a power of two (at least 1): traces of similar length (the ranks
  of one run) share one compiled replay program."""
  return 1 << max(n - 1, 0).bit_length()


def _replay_ops(trace: SelectionTrace, chunk: int):
  """The trace as a padded op list: a decode event is one op, a prefill or release event
  one op per ``chunk`` of its addresses; the list is padded with no-op ops to a power of
  two.

  returns (kind [E] int32, step [E] int32: a decode op's step,
           addrs [E, chunk] int32: a prefill/release op's addresses (INVALID after),
           decode_op [T] int64: the op of each decode step)
  """
  kinds, steps, parts = [], [], []
  decode_op = np.zeros((trace.num_steps,), np.int64)
  for kind, ref, count in zip(trace.kind, trace.ref, trace.count):
    if kind == DECODE:
      decode_op[int(ref)] = len(kinds)
      kinds.append(DECODE)
      steps.append(int(ref))
      parts.append(None)
      continue
    a = trace.addrs[int(ref):int(ref) + int(count)]
    for i in range(0, a.shape[0], chunk):
      kinds.append(int(kind))
      steps.append(0)
      parts.append(a[i:i + chunk])
  E = _bucket(len(kinds))
  kind = np.full((E,), _NOOP, np.int32)
  kind[:len(kinds)] = kinds
  step = np.zeros((E,), np.int32)
  step[:len(steps)] = steps
  addrs = np.full((E, chunk), INVALID, np.int32)
  for i, part in enumerate(parts):
    if part is not None:
      addrs[i, :part.shape[0]] = part
  return kind, step, addrs, decode_op


def _replay_program(system: Ula):
  """The jitted replay of ``system``: one ``lax.scan`` over the ops, each a
  ``lax.switch`` on its kind; the layer groups' metadata stacked in one pytree and
  updated group by group (``core.scatter.update_groups``). returns stats [E, G, 3] int32:
  hits, misses and evictions of the decode ops (zeros elsewhere)."""
  prefill = lambda ms, a: update_groups(
      lambda m, _: (system.prefill_meta(m, a, a >= 0)[0], None), ms)[0]
  release = lambda ms, a: update_groups(
      lambda m, _: (system.release_meta(m, a, a >= 0), None), ms)[0]

  def resolve(ms, sel_addr, sel_valid, new_addr, active):
    def one(m, x):
      m, slots, new_slot, plan, stats = system.resolve_meta(m, *x, new_addr, active)
      return m, (slots, new_slot, plan, stats)
    ms, (slots, new_slot, plan, stats) = update_groups(one, ms, (sel_addr, sel_valid))
    return ms, slots, new_slot, plan, stats

  def program(kind, step, addrs, sel_addr, sel_valid, new_addr, active):
    metas = system.init_meta()  # every leaf [G, ...]
    none = jnp.zeros((sel_addr.shape[1], 3), jnp.int32)

    def decode(metas, t, a):
      metas, _, _, _, st = resolve(metas, sel_addr[t], sel_valid[t], new_addr[t], active[t])
      return metas, jnp.stack([st["hits"], st["misses"], st["evictions"]], axis=1)

    by_kind = {PREFILL: lambda m, t, a: (prefill(m, a), none), DECODE: decode,
               RELEASE: lambda m, t, a: (release(m, a), none),
               _NOOP: lambda m, t, a: (m, none)}
    branches = [by_kind[k] for k in range(len(by_kind))]  # lax.switch indexes by kind

    def body(metas, op):
      k, t, a = op
      return lax.switch(k, branches, metas, t, a)

    return lax.scan(body, metas, (kind, step, addrs))[1]

  return jax.jit(program)


# Compiled replay programs of each system (held while the system lives), by padded shape.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def replay(trace: SelectionTrace, system: Ula, *, chunk: int = 256) -> ReplayResult:
  """Runs ``trace`` through ``system``'s metadata path (a ``ula.Ula``; its policy and
  pool sizes decide). chunk: prefill/release addresses per op (static shape).

  The whole trace runs as one compiled call (no host round trip per step); the program
  is compiled once per system and padded shape, so the ranks of one run share it."""
  trace.validate()
  _check_fits(trace, system)
  G, T = trace.num_groups, trace.num_steps
  kind, step, addrs, decode_op = _replay_ops(trace, chunk)
  Tp = _bucket(T)
  sel_addr = np.full((Tp, *trace.sel_addr.shape[1:]), INVALID, np.int32)
  sel_valid = np.zeros(sel_addr.shape, bool)
  new_addr = np.full((Tp, trace.max_batch), INVALID, np.int32)
  active = np.zeros(new_addr.shape, bool)
  sel_addr[:T], sel_valid[:T] = trace.sel_addr, trace.sel_valid
  new_addr[:T], active[:T] = trace.new_addr, trace.active
  args = (kind, step, addrs, sel_addr, sel_valid, new_addr, active)
  programs = _PROGRAMS.setdefault(system, {})
  key = (addrs.shape, sel_addr.shape)
  if key not in programs:
    # Compiled ahead so the timed call holds only the replay itself.
    programs[key] = _replay_program(system).lower(*args).compile()
  args = jax.device_put(args)
  t0 = time.perf_counter()
  stats = jax.block_until_ready(programs[key](*args))
  seconds = time.perf_counter() - t0
  per_step = np.asarray(stats, np.int64)[decode_op] if T else np.zeros((0, G, 3), np.int64)
  return ReplayResult(policy=system.policy_name, hits=per_step[..., 0],
                      misses=per_step[..., 1], evictions=per_step[..., 2],
                      resolve_seconds=seconds)


def system_for_trace(trace: SelectionTrace, cfg: MemoryConfig, *,
                     policy: str | None = None) -> Ula:
  """A validated one-rank ``Ula`` sized by ``cfg`` (the ``memory`` section) for ``trace``;
  ``policy`` replaces ``cfg.policy`` when given."""
  if policy is not None:
    # Not validated again: Ula checks the policy (policies.policy_fields).
    cfg = cfg.model_copy(update={"policy": policy})
  per_row = -(-trace.num_logical // trace.max_batch)
  system = Ula(cfg, trace.geometry(), MeshInfo(1, 1), max_batch=trace.max_batch,
               page_size=trace.page_size, max_context=per_row)
  system.validate()
  _check_fits(trace, system)
  return system


def compare_policies(trace: SelectionTrace, cfg: MemoryConfig,
                     policies: tuple[str, ...] = ("pb_lru", "lru")) -> dict:
  """Replays ``trace`` under each policy with ``cfg``'s pool sizes.

  returns {policy: ReplayResult.as_dict(), ..., "hit_rate_gap_pp": first minus second
           policy's hit rate in percentage points}
  """
  return compare_policies_per_rank([trace], cfg, policies)[0]


def compare_policies_per_rank(traces, cfg: MemoryConfig,
                              policies: tuple[str, ...] = ("pb_lru", "lru")) -> list[dict]:
  """``compare_policies`` of each trace (the ranks of one run). Traces of the same
  geometry and size replay on one system per policy, so they share its compiled replay."""
  systems: dict = {}
  out = []
  for trace in traces:
    sizes = (trace.geometry(), trace.num_logical, trace.max_batch, trace.page_size)
    res: dict = {}
    for p in policies:
      if (p, sizes) not in systems:
        systems[p, sizes] = system_for_trace(trace, cfg, policy=p)
      res[p] = replay(trace, systems[p, sizes]).as_dict()
    if len(policies) >= 2:
      a, b = res[policies[0]]["hit_rate"], res[policies[1]]["hit_rate"]
      res["hit_rate_gap_pp"] = 100.0 * (a - b)
    out.append(res)
  return out
