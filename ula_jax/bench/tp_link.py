"""Benchmark: the cross-device data path of ``ula`` TP mode against the device link.

In TP mode a miss is stored on one owner rank and must reach every rank's local buffer
(``ula_tp.deliver_misses``: the owners gather the rows from their device pools, a
collective over ``tp`` hands them to every rank, each rank scatters them into its
buffer). Per entry count ``n`` (misses of one layer, ``n / P`` owned by each of the
``P`` ranks as with layout ``mod``), this measures on a ``(1, P)`` mesh:

* ``deliver``: ``deliver_misses`` itself (the per-group ``own_misses`` once, outside
  the timed loop of layers), the rows checked bit for bit on every rank;
* ``all_gather``: the collective ``deliver`` is built on, over contiguous rows: each
  rank contributes its ``n / P`` rows and receives the others' (the least traffic that
  delivers the misses), without the gather from the pools and the scatter;
* ``psum``: an integer all-reduce of all ``n`` rows (every row crosses to every rank,
  the owner's bits summed with zeros), the alternative that needs no compaction;
* ``ppermute``: every rank sends ``n`` contiguous rows to the next (a collective
  permute, jitted like the others): the link's one-way bandwidth through the same
  collectives library;
* ``d2d copy``: a contiguous copy of ``n`` rows from one device to another
  (``jax.device_put`` between devices, ping-pong, one Python call per copy).

Rates are the useful bytes a rank receives (``n x (P - 1) / P`` rows, the rows owned
elsewhere) per second, for ``ppermute`` and ``d2d copy`` the bytes copied per second;
``link_gbps`` is the faster of those two at the same ``n`` and ``fraction`` a rate over
it. The collectives run ``--loop`` times
in one jitted loop (each call depends on the previous), best of ``--reps`` interleaved
repetitions.

    ula-jax bench tp_link [--entries 1K,4K,16K,64K] [--devices P] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.core import compat
from ula_jax.bench.common import (add_timing_args, best_and_median, environment, fmt,
                                  parse_list, parse_sizes, print_table as _print_table,
                                  time_calls, write_json)
from ula_jax.core.types import INVALID
from ula_jax.memory.ula.tp import FETCH_ALIGN, deliver_misses, own_misses

IMPLS = ("deliver", "psum", "all_gather", "ppermute", "d2d copy")
LINKS = ("ppermute", "d2d copy")  # the ceilings: one-way copies of contiguous rows
AXIS = "tp"


@dataclasses.dataclass
class Row:
  entries: int
  impl: str
  useful_bytes: int  # bytes one rank receives that it does not own (LINKS: bytes copied)
  seconds: float | None = None  # per call, fastest repetition
  median_seconds: float | None = None
  reps: int = 0
  gbps: float | None = None
  link_gbps: float | None = None  # the fastest of LINKS at the same entry count
  fraction: float | None = None
  ok: bool | None = None  # deliver: every rank's buffer holds the expected rows
  error: str | None = None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench tp_link", description=__doc__.split("\n\n")[0])
  p.add_argument("--entries", default="1K,4K,16K,64K",
                 help="misses of one layer per call, comma list (K = 1024)")
  p.add_argument("--width", type=int, default=576, help="values per row (MLA: 512 + 64)")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--devices", type=int, default=None,
                 help="tp ranks P (default: every device; at least 2)")
  p.add_argument("--impls", default=",".join(IMPLS), help=f"of {list(IMPLS)}")
  p.add_argument("--loop", type=int, default=8, help="calls per jitted loop")
  add_timing_args(p, max_iters=100, target_ms=50.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench/tp_link.json", help="JSON output path")
  p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, e.g. on CPU)")
  return p


def _inputs(n: int, ranks: int, width: int, dtype: Any, seed: int):
  """Per rank pools and fetch lists for ``n`` misses owned round-robin (``mod``).

  returns (pools [P, S, W], slots [P, F] int32, dst [F] int32, expected buffer [L, W])
  """
  F = -(-n // FETCH_ALIGN) * FETCH_ALIGN
  S = -(-n // ranks) * 2  # each rank's pool: twice what it owns
  rng = np.random.default_rng(seed)
  # Finite values: XLA on CPU may rewrite NaN payloads, which no KV entry holds.
  pools = jnp.asarray(rng.standard_normal((ranks, S, width), dtype=np.float32), dtype)
  owner = np.arange(n) % ranks
  local = np.empty(n, np.int64)
  for r in range(ranks):
    mine = owner == r
    local[mine] = rng.choice(S, int(mine.sum()), replace=False)
  slots = np.full((ranks, F), INVALID, np.int32)
  for r in range(ranks):
    slots[r, :n] = np.where(owner == r, local, INVALID)
  dst = np.full((F,), INVALID, np.int32)
  dst[:n] = rng.permutation(n)
  host = np.asarray(pools)
  expected = np.zeros((n, width), host.dtype)
  expected[dst[:n]] = host[owner, local]
  return pools, jnp.asarray(slots), jnp.asarray(dst), expected


def _timed(step: Callable[[Any], Any], state: Any, args: argparse.Namespace, per_call: int
           ) -> tuple[float, Any]:
  sec, state = time_calls(step, state, min_iters=args.min_iters, max_iters=args.max_iters,
                          target_s=args.target_ms / 1e3, warmup=1)
  return sec / per_call, state


def _runner(step: Callable[[Any], Any], state: Any, args: argparse.Namespace, per_call: int
            ) -> Callable[[], float]:
  """A repeatable measurement of ``state = step(state)``: each call times a batch of
  calls and keeps the final state for the next (the steps donate their input)."""
  box = {"state": state}

  def run() -> float:
    sec, box["state"] = _timed(step, box["state"], args, per_call)
    return sec
  return run


def _deliver_fn(mesh, loop: int):
  def body(pool, slots, dst, buf):
    pool, buf = pool[0], buf[0]
    # Planned once per layer group (in resolve), delivered once per layer.
    own = own_misses(slots[0], dst, AXIS)

    def one(i, b):
      del i
      return deliver_misses(pool, *own, b, AXIS)

    return jax.lax.fori_loop(0, loop, one, buf)[None]

  spec = P(AXIS)
  fn = compat.shard_map(body, mesh=mesh, in_specs=(spec, spec, P(), spec), out_specs=spec)
  return jax.jit(fn, donate_argnums=(3,))


def _psum_fn(mesh, *, loop: int):
  def body(x):
    def one(i, v):
      return jax.lax.psum(v, AXIS) ^ (i + 1)
    return jax.lax.fori_loop(0, loop, one, x[0])[None]

  fn = compat.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
  return jax.jit(fn, donate_argnums=(0,))


def _all_gather_fn(mesh, *, loop: int):
  def body(x):
    part = x[0]
    rows = part.shape[0]

    def one(i, v):
      full = jax.lax.all_gather(v, AXIS, tiled=True)
      mine = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(AXIS) * rows, rows)
      return mine ^ (i + 1)
    return jax.lax.fori_loop(0, loop, one, part)[None]

  fn = compat.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
  return jax.jit(fn, donate_argnums=(0,))


def _ppermute_fn(mesh, *, ranks: int, loop: int):
  perm = [(r, (r + 1) % ranks) for r in range(ranks)]

  def body(x):
    def one(i, v):
      return jax.lax.ppermute(v, AXIS, perm) ^ (i + 1)
    return jax.lax.fori_loop(0, loop, one, x[0])[None]

  fn = compat.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
  return jax.jit(fn, donate_argnums=(0,))


def measure(args: argparse.Namespace, checkpoint: Callable[[dict], Any] | None = None) -> dict:
  try:  # on CPU, simulate the devices asked for (only the CPU backend reads this)
    if jax.config.jax_num_cpu_devices < (args.devices or 2):
      jax.config.update("jax_num_cpu_devices", args.devices or 2)
  except RuntimeError:
    pass  # the backend has started: the devices are what they are
  devices = jax.devices()
  ranks = args.devices or len(devices)
  if ranks < 2 or ranks > len(devices):
    raise ValueError(f"--devices={ranks}: expected 2..{len(devices)} (the devices present)")
  mesh = jax.make_mesh((ranks,), (AXIS,), devices=devices[:ranks],
                       axis_types=(jax.sharding.AxisType.Auto,))
  shard = NamedSharding(mesh, P(AXIS))
  dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
  item = jnp.dtype(dtype).itemsize
  row_bytes = args.width * item
  impls = parse_list(args.impls, IMPLS, flag="--impls")
  sizes = parse_sizes(args.entries, flag="--entries", minimum=ranks)
  result = {"benchmark": "tp_link", "environment": environment(), "ranks": ranks,
            "row_bytes": row_bytes, "loop": args.loop, "reps": args.reps, "rows": []}
  for n in sizes:
    n -= n % ranks  # the same share on every rank
    useful = n * (ranks - 1) // ranks * row_bytes
    rows = {impl: Row(entries=n, impl=impl,
                      useful_bytes=n * row_bytes if impl in LINKS else useful)
            for impl in impls}
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    pools, slots, dst, expected = _inputs(n, ranks, args.width, dtype, args.seed + n)
    pools = jax.device_put(pools, shard)
    slots = jax.device_put(slots, shard)
    dst = jax.device_put(dst, NamedSharding(mesh, P()))
    words = n * row_bytes // 4
    runs: dict[str, Callable[[], float]] = {}
    if "deliver" in impls:
      fn = _deliver_fn(mesh, args.loop)
      buf0 = lambda: jax.device_put(jnp.zeros((ranks, n, args.width), dtype), shard)
      out = jax.block_until_ready(fn(pools, slots, dst, buf0()))
      got = np.asarray(out)
      rows["deliver"].ok = bool(all(np.array_equal(got[r].view(np.uint8),
                                                    expected.view(np.uint8))
                                    for r in range(ranks)))
      runs["deliver"] = _runner(lambda b: fn(pools, slots, dst, b), buf0(), args, args.loop)
    collectives = {"psum": (_psum_fn, words), "all_gather": (_all_gather_fn, words // ranks),
                   "ppermute": (functools.partial(_ppermute_fn, ranks=ranks), words)}
    for impl, (make, per_rank) in collectives.items():
      if impl in impls:
        x0 = jax.device_put(jnp.zeros((ranks, per_rank), jnp.int32), shard)
        runs[impl] = _runner(make(mesh, loop=args.loop), x0, args, args.loop)
    if "d2d copy" in impls:
      a, b = devices[0], devices[1]

      def hop(x):
        return jax.device_put(x, b if x.devices() == {a} else a)
      runs["d2d copy"] = _runner(hop, jax.device_put(jnp.zeros((words,), jnp.int32), a),
                                 args, 1)
    for _ in range(args.reps):  # interleaved repetitions
      for impl, run in runs.items():
        try:
          times[impl].append(run())
        except Exception as e:  # noqa: BLE001 -- recorded in the row, the sweep goes on
          rows[impl].error = f"{type(e).__name__}: {e}"[:500]
    rates = [rows[i].useful_bytes / min(times[i]) / 1e9 for i in LINKS if times.get(i)]
    link = max(rates) if rates else None
    for impl, row in rows.items():
      best, med = best_and_median(times[impl])
      row.seconds, row.median_seconds, row.reps = best, med, len(times[impl])
      if best:
        row.gbps = row.useful_bytes / best / 1e9
        row.link_gbps = link
        row.fraction = row.gbps / link if link else None
      result["rows"].append(dataclasses.asdict(row))
    if checkpoint:
      checkpoint(result)
  return result


def print_table(result: dict) -> None:
  rows = [[str(r["entries"]), r["impl"], fmt(r["seconds"] and r["seconds"] * 1e6, 1),
           fmt(r["gbps"], 1), fmt(r["fraction"], 3),
           "-" if r["ok"] is None else str(r["ok"]), (r["error"] or "")[:60]]
          for r in result["rows"]]
  env = result["environment"]
  _print_table(f"TP miss delivery over {result['ranks']} {env['device']} "
               f"({result['row_bytes']}-B rows; GB/s of rows owned elsewhere, per rank)",
               ["entries", "impl", "us/call", "GB/s", "of link", "exact", "error"],
               rows, left=["impl", "error"])


def main(argv: list[str]) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.quick:
    quick = dict(entries="64,256", width=40, loop=2, reps=2, min_iters=1, max_iters=2,
                 target_ms=1.0)
    for name, value in quick.items():
      if getattr(args, name) == parser.get_default(name):
        setattr(args, name, value)
  try:
    result = measure(args, checkpoint=lambda partial: write_json(args.out, partial))
  except ValueError as e:
    parser.error(str(e))
  print_table(result)
  print(f"wrote {write_json(args.out, result)}")
  bad = [r for r in result["rows"] if r["error"] or r["ok"] is False]
  return 1 if bad else 0
