"""A churn soak of ``ula`` (PB-LRU, with a host pool): 10,000 engine steps (200,000 with
``ULA_HYPOTHESIS_PROFILE=long``) of short requests admitted, prefilled, decoded and
released, at small scale.

Each step releases the requests that finished, admits one new request into a free row
(its whole prompt prefilled in one chunk) and decodes every row that has a prompt. The
schedule is page bookkeeping only, so it is laid out on the host first and the device
runs it ``CHUNK`` steps per call of one jitted ``scan`` (one compile). Every row written
encodes (request, layer, address), so every row attention reads can be checked. Along
the way the system must hold exactly the entries of the live requests (nothing lost,
nothing leaked), and at the end nothing at all: zero slots used on device and host.
Neither the process's memory nor the number of live jax arrays may grow from the first
half of the soak to the second.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.core.addressing import PageAllocator
from ula_jax.core.types import INVALID
from ula_jax.memory.ula.dp import Ula
from tests.test_ula_properties import empty_local_state, make_system, soak_factor

STEPS = 10_000 * soak_factor()  # 200,000 under the ``long`` hypothesis profile
CHUNK = 1_000  # steps per device call
PROMPT = 4  # the longest prompt: one prefill chunk
RSS_TOLERANCE = 32 << 20  # bytes the process may grow by from the first half to the end


def soak_system() -> Ula:
  # 4 rows x (top-k 3 + 1) = 16 device slots: one step's entries; 12 more on the host.
  return make_system(policy="pb_lru", buckets=2, device=16, host=12, max_batch=4, top_k=3,
                     page_size=4, num_layers=2, group_size=1, width=2)  # N = 28


def row_value(req: np.ndarray, layer: int, addr: np.ndarray) -> np.ndarray:
  """The row written for (request, layer, address): exact small integers in float32."""
  return np.stack(np.broadcast_arrays(np.float32(req), np.float32(addr * 4 + layer)), -1)


def row_value_jnp(req: jax.Array, layer: int, addr: jax.Array) -> jax.Array:
  """``row_value`` inside the program."""
  return jnp.stack(jnp.broadcast_arrays(req.astype(jnp.float32),
                                        (addr * 4 + layer).astype(jnp.float32)), -1)


@dataclasses.dataclass
class Live:
  req: int
  pages: np.ndarray
  prompt: int
  total: int
  written: int = 0

  def addr(self, pos: int, page: int) -> int:
    return int(self.pages[pos // page]) * page + pos % page


def schedule(system: Ula, steps: int, seed: int) -> tuple[dict, np.ndarray]:
  """The soak's inputs, ``[steps, ...]`` each, and the entries stored after each step
  (per group: the tokens written by live requests)."""
  rng = np.random.default_rng(seed)
  B, k, page, N = system.max_batch, system.geo.top_k, system.page_size, system.num_logical
  G = system.geo.num_groups
  x = dict(r_addr=np.full((steps, N), INVALID, np.int32), r_valid=np.zeros((steps, N), bool),
           p_addr=np.full((steps, PROMPT), INVALID, np.int32),
           p_valid=np.zeros((steps, PROMPT), bool), p_req=np.zeros((steps,), np.float32),
           sel=np.full((steps, G, B, k), INVALID, np.int32),
           sel_valid=np.zeros((steps, G, B, k), bool),
           new=np.full((steps, B), INVALID, np.int32), active=np.zeros((steps, B), bool),
           row_req=np.zeros((steps, B), np.float32))
  alloc, rows, stored = PageAllocator(N // page), [None] * B, np.zeros((steps,), np.int64)
  next_req = 1
  for t in range(steps):
    # Release what finished (one call frees every finished request's addresses).
    n = 0
    for b, r in enumerate(rows):
      if r is not None and r.written == r.total:
        own = np.concatenate([p * page + np.arange(page) for p in r.pages])[:r.written]
        x["r_addr"][t, n:n + own.shape[0]], x["r_valid"][t, n:n + own.shape[0]] = own, True
        n += own.shape[0]
        alloc.free(r.pages)
        rows[b] = None
    # Admit one request and prefill its prompt.
    total = int(rng.integers(2, 9))
    if None in rows and -(-total // page) <= alloc.free_pages:
      b = rows.index(None)
      r = rows[b] = Live(next_req, alloc.allocate(-(-total // page)),
                         int(rng.integers(1, min(PROMPT, total - 1) + 1)), total)
      next_req += 1
      x["p_addr"][t, :r.prompt] = [r.addr(p, page) for p in range(r.prompt)]
      x["p_valid"][t, :r.prompt] = True
      x["p_req"][t] = r.req
      r.written = r.prompt
    # Decode every row with a prompt; each selects from its history (the new token too).
    for b, r in enumerate(rows):
      if r is not None and r.written < r.total:
        x["active"][t, b], x["new"][t, b] = True, r.addr(r.written, page)
        x["row_req"][t, b] = r.req
        for g in range(G):
          pos = rng.integers(0, r.written + 1, size=k)
          x["sel"][t, g, b] = [r.addr(int(p), page) for p in pos]
          x["sel_valid"][t, g, b] = rng.random(k) < 0.9
        r.written += 1
    stored[t] = sum(r.written for r in rows if r is not None)
  return x, stored


@functools.lru_cache(maxsize=None)
def soak_program(system: Ula):
  """``CHUNK`` engine steps per call (one compile): release, prefill, decode per step.
  Per step: the summed stats [3], the entries stored per tier [G, 3] (device, host,
  table), and the rows attention read ``[G, B, k, W]``."""
  geo, L = system.geo, system.geo.num_layers
  gs = geo.group_size

  def step(state, x):
    state = system.release(state, x["r_addr"], x["r_valid"], jnp.int32(0))
    entries = jnp.stack([row_value_jnp(x["p_req"], l, x["p_addr"])
                         for l in range(L)])  # [L, C, W]
    state = system.write_prefill(state, x["p_addr"], x["p_valid"], entries, jnp.int32(0))
    stats, reads = jnp.zeros((3,), jnp.int32), []
    for g in range(geo.num_groups):
      state, res = system.resolve(state, g, x["sel"][g], x["sel_valid"][g], x["new"],
                                  x["active"])
      for l in geo.group_layers(g):
        state = system.move_layer(state, l, res)
      for l in geo.group_layers(g):
        state = system.write_token(state, l, res, row_value_jnp(x["row_req"], l, x["new"]),
                                   x["active"])
      pool, base = system.read_pool(state, g * gs)
      reads.append(pool[base + jnp.clip(res.slots, 0, None)])
      stats = stats + jnp.stack([res.stats[n] for n in ("hits", "misses", "evictions")])
    m = state.meta
    used = jnp.stack([(m.dev_owner != INVALID).sum(1), (m.host_owner != INVALID).sum(1),
                      (m.table != INVALID).sum(1)], -1)  # [G, 3]
    return state, (stats, used, jnp.stack(reads))

  return jax.jit(lambda state, xs: jax.lax.scan(step, state, xs))


def rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096


def run_soak(steps: int = STEPS, seed: int = 0) -> dict:
  """Runs the soak and checks it; returns its figures."""
  system = soak_system()
  assert steps % CHUNK == 0
  t0 = time.perf_counter()
  x, stored = schedule(system, steps, seed)
  t_schedule = time.perf_counter() - t0
  run = soak_program(system)
  state = jax.jit(lambda: empty_local_state(system))()
  totals, samples = np.zeros((3,), np.int64), []
  t0 = time.perf_counter()
  for c in range(steps // CHUNK):
    xs = {n: v[c * CHUNK:(c + 1) * CHUNK] for n, v in x.items()}
    state, (stats, used, reads) = run(state, xs)
    stats, used, reads = np.asarray(stats), np.asarray(used), np.asarray(reads)
    totals += stats.sum(0)
    # Nothing lost, nothing leaked: every group holds exactly the live tokens, each in
    # one slot of one tier.
    want = stored[c * CHUNK:(c + 1) * CHUNK]
    for g in range(system.geo.num_groups):
      np.testing.assert_array_equal(used[:, g, 2], want, err_msg=f"chunk {c} group {g}")
      np.testing.assert_array_equal(used[:, g, 0] + used[:, g, 1], want)
    assert (used[:, :, 0] <= system.device_slots).all()
    assert (used[:, :, 1] <= system.host_slots).all()
    # Every row read is the one its request wrote at that address.
    sel, ok = xs["sel"], xs["sel_valid"]
    for g in range(system.geo.num_groups):
      want_rows = row_value(xs["row_req"][:, :, None], g * system.geo.group_size, sel[:, g])
      np.testing.assert_array_equal(reads[:, g][ok[:, g]], want_rows[ok[:, g]],
                                    err_msg=f"chunk {c} group {g}: rows read")
    if c in (steps // CHUNK // 2 - 1, steps // CHUNK - 1):
      samples.append((rss_bytes(), len(jax.live_arrays())))
  t_run = time.perf_counter() - t0
  # The accounting with the last requests still live (the test then drains them).
  rep_live = system.report(jax.tree.map(lambda a: a[None], state))
  return {"system": system, "state": state, "totals": totals, "samples": samples,
          "stored_end": int(stored[-1]), "report_before_drain": rep_live,
          "seconds_schedule": t_schedule, "seconds_run": t_run}


def drain(system: Ula, state):
  """Releases every address: the requests still live at the end, whatever their length."""
  N = system.num_logical
  addrs = jnp.arange(N, dtype=jnp.int32)
  return jax.jit(system.release)(state, addrs, jnp.ones((N,), bool), jnp.int32(0))


def test_churn_soak_leaves_nothing_behind(seed):
  out = run_soak(seed=seed)
  system, state = out["system"], out["state"]
  hits, misses, evictions = out["totals"].tolist()
  print(f"\nsoak: {STEPS} steps, {hits} hits, {misses} misses, {evictions} evictions, "
        f"schedule {out['seconds_schedule']:.1f} s, run {out['seconds_run']:.1f} s, "
        f"(rss, live arrays) at half and end {out['samples']}")
  # The soak moved data both ways many times.
  assert misses > STEPS // 10 and evictions > STEPS // 10
  assert out["report_before_drain"].distinct_total == out["stored_end"] * system.geo.num_groups
  state = drain(system, state)
  rep = system.report(jax.tree.map(lambda a: a[None], state))
  assert rep.device_used.sum() == 0 and rep.host_used.sum() == 0 and rep.distinct_total == 0
  assert (np.asarray(state.meta.table) == INVALID).all()
  (rss_half, arrays_half), (rss_end, arrays_end) = out["samples"]
  assert arrays_end <= arrays_half, out["samples"]
  assert rss_end - rss_half <= RSS_TOLERANCE, out["samples"]
