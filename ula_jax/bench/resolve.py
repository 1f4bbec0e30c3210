"""Benchmark: resolve of one layer group (dedupe, hits, victims, table update).

For each device pool size, batch size, policy (PB-LRU, exact LRU) and implementation
(the jnp resolve; the Pallas kernels as four launches, ``kernels.resolve=pallas``, or as
one, ``pallas_fused``: ``--pallas-fuse off,on``), a synthetic selection stream is resolved in
segments of ``--steps`` resolves, each one jitted call, and the time per resolve is
reported in microseconds (compile and warm-up excluded; the median of several timed
segments). A segment's resolves run as a device loop (``--loop unrolled``: as
straight-line code, as a decode step runs its layer groups' resolves). On an H200 both
times are above the device's work by tens of microseconds of launch and loop overhead:
``--profile DIR`` adds, from a trace, each kernel's launches and time per resolve and
their sum (``device_us``), the device's work alone, and each of the resolve's own
kernels launch by launch (``launches``). The profiled resolves are new steps of the
stream after the timed ones (counted in ``profiled``), after one more untimed segment:
a kernel's first launch under the profiler takes several times its usual time.
``--flush-mb MB`` clears the device's cache between resolves (a pass over MB MiB
ordered after each resolve and before the next), as a decode step's other kernels do.

The stream: request ``b`` owns logical addresses ``[b * L, (b + 1) * L)``. Before the
loop every request's first ``L0`` positions are stored in random order, twice what the
device pool holds (``L0 = 2 * Sd / B``): the device pool is full and half the entries are
on the host, so every miss needs a victim. Each step every request decodes one new token
(placed on the device, and selected by its own row) and keeps its top-k selection except
a fraction ``--churn`` of it, redrawn uniformly over its history: temporal locality as in
decoding, where consecutive steps select mostly the same entries.

Each row also reports what one resolve touches (``work``, a model from the sizes and the
measured counts: table lookups, bitmap words, pyramid reads, sorted keys, bytes, kernel
launches), so a time can be explained. ``ula-jax bench resolve --help`` lists the flags.

    ula-jax bench resolve [--batch 1,8,32,64,128] [--pools 64K,1M] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.config.schema import PB_LRU_BUCKETS, MemoryConfig
from ula_jax.bench import common
from ula_jax.bench.common import environment, fmt, parse_list, parse_sizes, write_json
from ula_jax.memory.ula.resolve import resolve_group
from ula_jax.memory.ula.resolve.pallas import FUSED_CONFIG, ResolveConfig, default_interpret
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.policies import bitmap
from ula_jax.memory.ula.dp import Ula

IMPLS = ("jnp", "pallas")
POLICIES = ("pb_lru", "lru")
PAGE = 64
# Targets (H200): PB-LRU this much faster than exact LRU at batch >= SPEEDUP_BATCH, and
# the fused resolve within this many microseconds at batch TARGET_BATCH, top-k 2048.
SPEEDUP, SPEEDUP_BATCH = 1.5, 32
TARGET_US, TARGET_BATCH, TARGET_K = 50.0, 64, 2048


@dataclasses.dataclass
class Row:
  pool: int
  batch: int
  policy: str
  impl: str
  k: int
  us: float | None = None  # microseconds per resolve (one layer group)
  segments_us: list | None = None
  resolves: int = 0  # timed
  hits: float | None = None  # per resolve, averaged over the timed resolves
  misses: float | None = None
  evictions: float | None = None
  fetches: float | None = None  # misses moved in (placed)
  placed: float | None = None  # misses + fresh new tokens per resolve
  work: dict | None = None
  kernels: list | None = None  # --profile: [name, launches, us] per resolve, slowest first
  device_us: float | None = None  # --profile: the device's operations per resolve, summed
  fused: bool = False  # Pallas PB-LRU in one launch
  config: dict | None = None  # Pallas: the ResolveConfig launched
  kernel_us: float | None = None  # --profile: the resolve's own kernels per resolve
  # --profile: per kernel of the resolve's own, its launches' time and the device's idle
  # time before each, in launch order: {name: {"us": [...], "idle_before_us": [...],
  # "before": {op before it: launches}}}
  launches: dict | None = None
  # --profile: the profiled resolves (new steps of the stream after the timed ones):
  # {"resolves", "hits", "misses", "evictions", "fetches"} per resolve
  profiled: dict | None = None
  error: str | None = None


def parse_pools(text: str) -> list[int]:
  """'64K,1M' -> [65536, 1048576] device-pool slots (K = 1024, M = 1024 * 1024)."""
  return parse_sizes(text, flag="--pools", minimum=1, unit=" slot")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench resolve", description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", default="1,8,32,64,128", help="requests per resolve, comma list")
  p.add_argument("--k", type=int, default=2048, help="selected entries per request (top-k)")
  p.add_argument("--pools", default="64K,1M",
                 help="device pool slots, comma list (K = 1024, M = 1024 * 1024)")
  p.add_argument("--policies", default=",".join(POLICIES), help=f"of {list(POLICIES)}")
  p.add_argument("--impls", default=",".join(IMPLS), help=f"of {list(IMPLS)}")
  p.add_argument("--buckets", type=int, default=PB_LRU_BUCKETS,
                 help="PB-LRU recent buckets (default: memory.pb_lru_buckets's)")
  p.add_argument("--churn", type=float, default=0.1,
                 help="fraction of each request's selection redrawn per step")
  p.add_argument("--steps", type=int, default=32, help="resolves per timed segment")
  p.add_argument("--loop", choices=("while", "unrolled"), default="while",
                 help="a segment's resolves as a device loop or as straight-line code (as "
                 "in a decode step)")
  p.add_argument("--flush-mb", type=int, default=0, metavar="MB",
                 help="between resolves, a read-and-write pass over a buffer of MB MiB "
                 "(0: none), so that no resolve finds the previous one's data in the "
                 "device's cache, as in a decode step; the times include the pass, the "
                 "profiled kernel times do not")
  p.add_argument("--segments", type=int, default=3, help="timed segments (median reported)")
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed segments first (the pool reaches its steady state)")
  p.add_argument("--pallas-fuse", default="off",
                 help="Pallas launch forms, comma list: four launches (off, "
                 "kernels.resolve=pallas: ResolveConfig()) or PB-LRU's in one (on, "
                 "kernels.resolve=pallas_fused: FUSED_CONFIG); exact LRU always takes four")
  p.add_argument("--pallas-block-elems", default=None,
                 help="Pallas sweep: entries per program (mark, publish), comma list "
                 "(default: the launch form's)")
  p.add_argument("--pallas-block-place", default=None,
                 help="Pallas sweep: entries per program (place), comma list (default: the "
                 "launch form's)")
  p.add_argument("--pallas-warps", default=None,
                 help="Pallas sweep: warps per program, comma list (default: the launch "
                 "form's)")
  p.add_argument("--pallas-per-sm", type=int, default=None,
                 help="programs of the fused launch resident per SM (default: "
                 "FUSED_CONFIG's with its own blocks and warps, else 8 / warps; more only "
                 "where the compiled registers allow it, see ResolveConfig)")
  p.add_argument("--interpret", choices=("auto", "on", "off"), default="auto",
                 help="Pallas interpret mode (auto: on everywhere but on GPU)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--profile", default=None, metavar="DIR",
                 help="also run segments per row under jax.profiler (traces under DIR; "
                 "new steps after the timed ones) and report the device kernels of a "
                 "resolve: launches and time of each")
  p.add_argument("--profile-resolves", type=int, default=8,
                 help="with --profile: resolves counted under the profiler (at least; "
                 "whole segments, after one untimed segment)")
  p.add_argument("--out", default="runs/bench/resolve.json", help="JSON output path")
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes and few steps (smoke test, e.g. on CPU)")
  return p


# ----------------------------------------------------------------------------------
# The system and the stream
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
  """Sizes of one measurement (per request: ``L0`` stored positions, ``L`` addresses)."""

  pool: int  # device slots
  batch: int
  k: int
  buckets: int
  steps_total: int  # decode steps the stream runs (warm-up and timed)

  @property
  def L0(self) -> int:
    return max(-(-2 * self.pool // self.batch), self.k)

  @property
  def L(self) -> int:
    return self.L0 + self.steps_total

  @property
  def host(self) -> int:
    """Host slots: every address not on the device, rounded up to whole pages."""
    total = -(-(self.batch * self.L) // PAGE) * PAGE
    return total - self.pool + PAGE


def build_system(setup: Setup, policy: str) -> Ula:
  """A one-rank ``Ula`` for the benchmark's sizes."""
  cfg = MemoryConfig(system="ula", device_pool=setup.pool, host_pool=setup.host,
                     policy=policy, pb_lru_buckets=setup.buckets)
  geo = KVGeometry(num_layers=1, group_size=1, entry_width=576, index_dim=128,
                   top_k=setup.k, kv_dtype="bfloat16")
  system = Ula(cfg, geo, MeshInfo(1, 1), max_batch=setup.batch, page_size=PAGE,
               max_context=setup.L)
  system.validate()
  return system


def filler(system: Ula, setup: Setup) -> Callable[[int], Any]:
  """``seed -> meta``: every request's first ``L0`` positions stored, in random order
  (free device slots first, then the host), so the device pool is full."""
  B, L, L0 = setup.batch, setup.L, setup.L0
  addrs = (np.arange(B)[:, None] * L + np.arange(L0)[None, :]).reshape(-1)
  chunk = min(1 << 16, 1 << (addrs.shape[0] - 1).bit_length())
  prefill = jax.jit(lambda m, a: system.prefill_meta(m, a, a >= 0)[0], donate_argnums=0)
  init = jax.jit(system.init_group_meta)

  def fill(seed: int):
    order = np.random.default_rng(seed).permutation(addrs).astype(np.int32)
    meta = init()
    for i in range(0, order.shape[0], chunk):
      part = np.full((chunk,), INVALID, np.int32)
      part[:order[i:i + chunk].shape[0]] = order[i:i + chunk]
      meta = prefill(meta, jnp.asarray(part))
    return meta

  return fill


def make_stream(setup: Setup, churn: float, seed: int) -> tuple[jax.Array, jax.Array]:
  """(sel [T, B, k] int32, new [T, B] int32) for ``T = steps_total`` decode steps.

  Step t: request b decodes position ``L0 + t``; its selection is the previous one with
  each entry redrawn with probability ``churn`` (uniformly over positions ``< L0 + t``),
  and entry 0 is the new token itself.
  """
  B, k, L, L0, T = setup.batch, setup.k, setup.L, setup.L0, setup.steps_total
  base = (jnp.arange(B, dtype=jnp.int32) * L)[:, None]

  def step(carry, t):
    pos, key = carry
    key, k_redraw, k_pos = jax.random.split(key, 3)
    redraw = jax.random.bernoulli(k_redraw, churn, (B, k))
    fresh_pos = jax.random.randint(k_pos, (B, k), 0, L0 + t, dtype=jnp.int32)
    pos = jnp.where(redraw, fresh_pos, pos)
    new = L0 + t
    sel = (base + pos).at[:, 0].set(base[:, 0] + new)
    return (pos, key), (sel, base[:, 0] + new)

  key = jax.random.key(seed)
  key, k0 = jax.random.split(key)
  pos0 = jax.random.randint(k0, (B, k), 0, L0, dtype=jnp.int32)
  _, (sel, new) = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(T, dtype=jnp.int32)))(
      (pos0, key))
  return sel, new


def resolve_loop(system: Ula, impl: str, *, config: ResolveConfig | None,
                 interpret: bool, unroll: bool = False, flush_mb: int = 0) -> Callable:
  """``(meta, sel [T, B, k], new [T, B]) -> (meta, totals [4] int32)``: T resolves in one
  jitted call (totals: hits, misses, evictions, fetches). ``unroll``: as straight-line
  code, the way a decode step runs its groups' resolves; otherwise a device loop.
  ``flush_mb``: between consecutive resolves, one read-and-write pass over a buffer of
  that many MiB (ordered after the one resolve and before the next), which leaves in the
  device's cache what a decode step's attention and projections would: none of the
  previous resolve's data."""
  words = flush_mb * 2**20 // 4

  def run(meta, sel, new):
    T, B, _ = sel.shape
    valid = jnp.ones(sel.shape[1:], jnp.bool_)
    active = jnp.ones((B,), jnp.bool_)

    def body(t, carry):
      meta, totals, junk = carry
      meta, _, _, plan, stats = resolve_group(system, meta, sel[t], valid, new[t], active,
                                              impl=impl, interpret=interpret, config=config,
                                              fast_path=False)
      counts = jnp.stack([stats["hits"], stats["misses"], stats["evictions"],
                          plan.n_fetch]).astype(jnp.int32)
      if words:
        junk = junk + counts[0].astype(junk.dtype)
        meta, junk = jax.lax.optimization_barrier((meta, junk))
      return meta, totals + counts, junk

    junk = jnp.zeros((words,), jnp.float32)
    meta, totals, _ = jax.lax.fori_loop(0, T, body,
                                        (meta, jnp.zeros((4,), jnp.int32), junk),
                                        unroll=T if unroll else 1)
    return meta, totals

  return jax.jit(run, donate_argnums=0)


# ----------------------------------------------------------------------------------
# What one resolve touches (a model from the sizes and the measured counts)
# ----------------------------------------------------------------------------------


def work_model(impl: str, policy: str, system: Ula, B: int, k: int,
               placed: float, fused: bool = False) -> dict[str, Any]:
  """Counts per resolve: ``table_lookups`` (reads and writes of the mapping table and
  owner arrays), ``bitmap_words`` (32-bit words of every bitmap read or written),
  ``pyramid_reads`` (Pallas: count-pyramid entries read by the placed entries),
  ``ranked`` (keys sorted or ranked: jnp's argsort of the M addresses; exact LRU's
  top-k over every slot), ``bytes`` (4 bytes per counted item plus the selection),
  ``launches`` (Pallas kernels and the scratch fill; the jnp path is XLA's to fuse;
  ``fused``: PB-LRU's one-launch resolve).
  """
  M = B * k + B
  Sd, Hr, N = system.device_slots, system.host_rows, system.num_logical
  R = system.buckets if policy == "pb_lru" else 1
  lv_d, lv_h, lv_n = (bitmap.level_sizes(x) for x in (Sd, Hr, N))
  dev_words, host_words, addr_words = sum(lv_d), sum(lv_h), sum(lv_n)
  n_bitmaps = R + 2 if policy == "pb_lru" else 0
  sel_bytes = M * 5  # int32 address + bool valid
  out = {"M": M, "device_slots": Sd, "host_rows": Hr, "num_logical": N}
  if impl == "pallas":
    table = 2 * M + 4 * placed  # mark and publish lookups; place: loc, table, owners
    words = (2 * 2 * n_bitmaps * dev_words  # round and publish read and write every bucket
             + 2 * lv_d[0] + 4 * host_words + addr_words  # hit/placed bits, host, address
             + M)  # hit / miss atomics of mark
    # per placed entry: its rank (address pyramid), its slot (device pyramid, PB-LRU)
    # and its victim's host slot (host pyramid; a full pool evicts for every entry)
    pyramid = placed * 32 * ((len(lv_n) - 1) + (len(lv_d) - 1 if policy == "pb_lru" else 0)
                             + (len(lv_h) - 1))
    scratch = 8 + n_bitmaps + lv_d[0] + lv_h[0] + lv_n[0] + n_bitmaps * sum(lv_d[1:]) + sum(
        lv_h[1:]) + sum(lv_n[1:])
    ranked = Sd if policy == "lru" else 0
    out.update(table_lookups=int(table), bitmap_words=int(words), pyramid_reads=int(pyramid),
               ranked=ranked, scratch_words=int(scratch),
               launches=("1 + fill" if fused else 5) if policy == "pb_lru"
               else "5 + XLA top_k")
  else:
    table = 2 * M + 4 * placed
    if policy == "pb_lru":
      # begin_round (every level), two touches (summarize every bucket), the pick
      # (select_first of M over R + 1 lists), host: or, summarize twice, select_first.
      words = (3 * R * dev_words + 2 * n_bitmaps * (2 * lv_d[0] + dev_words)
               + (R + 1) * sum(min(M, w) for w in lv_d)
               + 6 * host_words + sum(min(M, w) for w in lv_h))
      ranked = M
    else:
      words = 6 * host_words + sum(min(M, w) for w in lv_h)
      ranked = M + Sd  # the argsort of the selection, and top_k over every stamp
    out.update(table_lookups=int(table), bitmap_words=int(words), pyramid_reads=0,
               ranked=int(ranked), scratch_words=0, launches="XLA")
  out["bytes"] = int(4 * (out["table_lookups"] + out["bitmap_words"] + out["pyramid_reads"]
                          + out["ranked"] + out["scratch_words"]) + sel_bytes)
  return out


# ----------------------------------------------------------------------------------
# The measurement
# ----------------------------------------------------------------------------------


def _pallas_configs(args) -> list[tuple[str, ResolveConfig]]:
  """(label, config) per Pallas launch of the sweep: each launch form's production config
  (``ResolveConfig()``, ``FUSED_CONFIG``) with the swept fields replaced."""
  fuse = [x == "on" for x in parse_list(args.pallas_fuse, ("on", "off"),
                                        flag="--pallas-fuse")]
  sizes = lambda text, default: parse_sizes(text) if text else [default]
  out = []
  for f in fuse:
    base = FUSED_CONFIG if f else ResolveConfig()
    blocks = list(itertools.product(sizes(args.pallas_block_elems, base.block_elems),
                                    sizes(args.pallas_block_place, base.block_place),
                                    sizes(args.pallas_warps, base.num_warps)))
    for e, p, w in blocks:
      per_sm = args.pallas_per_sm
      if per_sm is None and (e, p, w) == (base.block_elems, base.block_place, base.num_warps):
        # FUSED_CONFIG's residency per SM goes with its own blocks; other blocks keep
        # None, the residency that holds at any register count.
        per_sm = base.per_sm
      tags = ([f"e{e},p{p},w{w}"] if len(blocks) > 1 else []) + (["fused"] if f else [])
      label = f"pallas[{','.join(tags)}]" if tags else "pallas"
      out.append((label, ResolveConfig(block_elems=e, block_place=p, num_warps=w, fuse=f,
                                       per_sm=per_sm)))
  return out


def _impls(names: list[str], args) -> list[tuple[str, str, ResolveConfig | None]]:
  out = []
  for name in names:
    if name == "pallas":
      out += [(label, "pallas", config) for label, config in _pallas_configs(args)]
    else:
      out.append((name, name, None))
  return out


def measure(row: Row, setup: Setup, system: Ula, fill: Callable, stream: tuple, impl: str,
            config: ResolveConfig | None, args, interpret: bool) -> None:
  T = args.steps
  sel, new = stream
  meta = fill(args.seed)
  loop = resolve_loop(system, impl, config=config, interpret=interpret,
                      unroll=args.loop == "unrolled", flush_mb=args.flush_mb)
  compiled = loop.lower(meta, sel[:T], new[:T]).compile()
  for s in range(args.warmup):
    meta, _ = compiled(meta, sel[s * T:(s + 1) * T], new[s * T:(s + 1) * T])
  jax.block_until_ready(meta)
  times, totals = [], np.zeros((4,), np.int64)
  for s in range(args.warmup, args.warmup + args.segments):
    t0 = time.perf_counter()
    meta, counts = compiled(meta, sel[s * T:(s + 1) * T], new[s * T:(s + 1) * T])
    counts = np.asarray(jax.block_until_ready(counts))
    times.append((time.perf_counter() - t0) / T)
    totals += counts
  n = args.segments * T
  row.segments_us = [t * 1e6 for t in times]
  row.us = statistics.median(times) * 1e6
  row.resolves = n
  row.hits, row.misses, row.evictions, row.fetches = (float(x) / n for x in totals)
  row.placed = row.misses + setup.batch  # each step places one new token per request
  row.fused = (impl == "pallas" and row.policy == "pb_lru"
               and (config or ResolveConfig()).fuse)
  row.config = dataclasses.asdict(config) if config is not None else None
  row.work = work_model(impl, row.policy, system, setup.batch, setup.k, row.placed,
                        fused=row.fused)
  if args.profile:
    trace_dir = f"{args.profile}/pool{row.pool}_b{row.batch}_{row.policy}_{row.impl}"
    ops, row.launches, row.profiled = profile_kernels(
        compiled, meta, stream, T, (args.warmup + args.segments) * T, trace_dir,
        args.profile_resolves)
    row.kernels = ops[:16]
    row.device_us = sum(us for _, _, us in ops) if ops else None
    own = [us for name, _, us in ops if name.startswith("ula_resolve")]
    row.kernel_us = sum(own) if own else None


PROFILED_MARK = "ula_bench_profiled"


def profiled_segments(T: int, resolves: int) -> int:
  """Segments of ``T`` resolves that ``--profile`` runs after the timed ones: one
  untimed (a kernel's first launch under the profiler is slow) and enough to count at
  least ``resolves`` (``--profile-resolves``)."""
  return 1 + max(1, -(-resolves // T))


def profile_kernels(compiled: Callable, meta: Any, stream: tuple, T: int, first: int,
                    trace_dir: str, resolves: int) -> tuple[list, dict, dict]:
  """``profiled_segments(T, resolves)`` more segments of ``T`` resolves under the
  profiler, on the stream's steps from ``first`` on (new steps, as the timed ones
  were), each waited for as the timed ones are; the first is not counted. ->
  (``[name, launches, us]`` per counted resolve for every device operation, slowest
  first; ``Row.launches``; ``Row.profiled``). The first two are empty on a backend
  without device lines (CPU)."""
  from ula_jax.bench.profile import device_op_events, launches_of, totals_by_name
  sel, new = stream
  segments = profiled_segments(T, resolves)
  totals = np.zeros((4,), np.int64)
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for s in range(segments):
      at = slice(first + s * T, first + (s + 1) * T)
      if s == 0:
        meta, _ = compiled(meta, sel[at], new[at])
        jax.block_until_ready(meta)
        continue
      with jax.profiler.TraceAnnotation(PROFILED_MARK):
        meta, counts = compiled(meta, sel[at], new[at])
        totals += np.asarray(jax.block_until_ready(counts))
  n = T * (segments - 1)
  events = device_op_events(trace_dir, PROFILED_MARK)
  ops = [[name, c / n, us / n] for name, c, us in totals_by_name(events, top=10**6)]
  # The resolve's own kernels, launch by launch: whether a kernel is slow in every
  # launch or in some, and what ran just before.
  launches: dict = {}
  for l in launches_of(events, "ula_resolve"):
    d = launches.setdefault(l["name"], {"us": [], "idle_before_us": [], "before": {}})
    d["us"].append(l["us"])
    d["idle_before_us"].append(l["idle_before_us"])
    d["before"][str(l["before"])] = d["before"].get(str(l["before"]), 0) + 1
  profiled = {"resolves": n, **{key: float(x) / n for key, x in zip(
      ("hits", "misses", "evictions", "fetches"), totals)}}
  return ops, launches, profiled


def run(args, checkpoint: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Measures everything ``args`` asks for; ``checkpoint`` gets the partial result after
  every row."""
  batches = parse_sizes(args.batch)
  pools = parse_pools(args.pools)
  policies = parse_list(args.policies, POLICIES, flag="--policies")
  impls = _impls(parse_list(args.impls, IMPLS, flag="--impls"), args)
  interpret = {"auto": default_interpret(), "on": True, "off": False}[args.interpret]
  if args.flush_mb < 0:
    raise ValueError(f"--flush-mb={args.flush_mb}: expected 0 (no pass) or a positive "
                     "number of MiB")
  steps_total = (args.warmup + args.segments
                 + (profiled_segments(args.steps, args.profile_resolves)
                    if args.profile else 0)) * args.steps
  rows: list[Row] = []

  def result() -> dict[str, Any]:
    return {"benchmark": "resolve", "environment": environment(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "stream": {"k": args.k, "churn": args.churn, "steps": args.steps,
                       "loop": args.loop, "flush_mb": args.flush_mb,
                       "segments": args.segments, "warmup": args.warmup,
                       "buckets": args.buckets, "interpret": interpret},
            "rows": [dataclasses.asdict(r) for r in rows],
            "targets": targets(rows, args.k)}

  for pool, batch in itertools.product(pools, batches):
    setup = Setup(pool=pool, batch=batch, k=args.k, buckets=args.buckets,
                  steps_total=steps_total)
    need = batch * (args.k + 1)
    stream = None
    for policy in policies:
      system = fill = None
      for label, impl, config in impls:
        row = Row(pool=pool, batch=batch, policy=policy, impl=label, k=args.k)
        rows.append(row)
        if pool < need:
          row.error = f"skipped: a {pool}-slot pool holds less than one step ({need} entries)"
          continue
        try:
          # One stream per size and one system per policy: every row replays the same.
          stream = stream or make_stream(setup, args.churn, args.seed)
          if system is None:
            system = build_system(setup, policy)
            fill = filler(system, setup)
          measure(row, setup, system, fill, stream, impl, config, args, interpret)
        except Exception as e:  # keep measuring the others; the table shows the error
          row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if checkpoint is not None:
          checkpoint(result())
  return result()


def targets(rows: list[Row], k: int) -> list[dict]:
  """The issue's targets, checked on the rows measured: PB-LRU vs exact LRU speedup at
  batch >= 32 (per pool and implementation), the fused resolve's time at batch 64."""
  out = []
  by = {(r.pool, r.batch, r.policy, r.impl): r for r in rows if r.us is not None}
  for (pool, batch, policy, impl), r in sorted(by.items()):
    if policy != "pb_lru" or batch < SPEEDUP_BATCH:
      continue
    lru = by.get((pool, batch, "lru", impl))
    if lru is not None:
      ratio = lru.us / r.us
      out.append({"target": f"pb_lru >= {SPEEDUP}x faster than lru", "pool": pool,
                  "batch": batch, "impl": impl, "value": ratio, "met": ratio >= SPEEDUP})
  for (pool, batch, policy, impl), r in sorted(by.items()):
    if r.fused and batch == TARGET_BATCH and k == TARGET_K:
      # The kernel's device time when profiled (the wall time of a resolve in the
      # benchmark's loop also holds the loop's host round trip), else the wall time.
      value, measure = (r.kernel_us, "kernel") if r.kernel_us is not None else (r.us, "wall")
      out.append({"target": f"fused resolve <= {TARGET_US:g} us", "pool": pool,
                  "batch": batch, "impl": impl, "policy": policy, "value": value,
                  "measure": measure, "met": value <= TARGET_US})
  return out


def print_table(result: dict) -> None:
  env = result["environment"]
  cells = []
  for r in result["rows"]:
    w = r["work"] or {}
    cells.append([str(r["pool"]), str(r["batch"]), r["policy"], r["impl"],
                  "ERROR" if r["error"] and not r["error"].startswith("skipped") else
                  ("-" if r["us"] is None else fmt(r["us"], 1)),
                  fmt(r["hits"], 0), fmt(r["misses"], 0), fmt(r["evictions"], 0),
                  str(w.get("table_lookups", "-")), str(w.get("bitmap_words", "-")),
                  str(w.get("ranked", "-")), fmt(w["bytes"] / 1e6, 2) if w else "-"])
  s = result["stream"]
  common.print_table(
      f"resolve of one layer group on {env['device']} ({env['backend']}, jax {env['jax']}); "
      f"k={s['k']}, churn {s['churn']}, PB-LRU buckets {s['buckets']}",
      ("pool", "batch", "policy", "impl", "us/resolve", "hits", "misses", "evict",
       "table ops", "bitmap words", "ranked", "MB touched"), cells,
      left=("policy", "impl"))
  for r in result["rows"]:
    if r["error"]:
      print(f"{r['error'].split(':')[0]}: pool {r['pool']} batch {r['batch']} {r['policy']} "
            f"{r['impl']}: {r['error']}")
  for r in result["rows"]:
    if r.get("device_us") is not None:
      print(f"device pool {r['pool']} batch {r['batch']} {r['policy']} {r['impl']}: "
            f"{r['device_us']:9.1f} us of device operations per resolve")
    for name, n, us in (r.get("kernels") or [])[:8]:
      print(f"kernel pool {r['pool']} batch {r['batch']} {r['policy']} {r['impl']}: "
            f"{us:9.1f} us {n:5.1f}x  {name[:90]}")
  for t in result["targets"]:
    print(f"target {t['target']}: pool {t['pool']} batch {t['batch']} {t['impl']}"
          f"{' ' + t['policy'] if 'policy' in t else ''}: {fmt(t['value'])}"
          f"{' (' + t['measure'] + ')' if 'measure' in t else ''} "
          f"{'met' if t['met'] else 'MISSED'}")


def _form(label: str) -> str:
  """A row's implementation as ``kernels.resolve`` names it ('pallas[e128,...,fused]' ->
  'pallas_fused')."""
  base, _, tags = label.partition("[")
  return base + ("_fused" if "fused" in tags.rstrip("]").split(",") else "")


def print_summary(result: dict) -> None:
  """A short table from a result (the JSON): per pool and batch, each policy's time under
  each implementation (jnp, pallas, pallas_fused: the best configuration of each) and the
  PB-LRU speedup over exact LRU; then the targets."""
  best: dict[tuple, float] = {}
  for r in result["rows"]:
    if r["us"] is not None:
      key = (r["pool"], r["batch"], r["policy"], _form(r["impl"]))
      best[key] = min(best.get(key, math.inf), r["us"])
  forms = [f for f in ("jnp", "pallas", "pallas_fused") if any(k[3] == f for k in best)]
  cells = []
  for pool, batch in sorted({k[:2] for k in best}):
    line = [str(pool), str(batch)]
    for form in forms:
      pb, lru = best.get((pool, batch, "pb_lru", form)), best.get((pool, batch, "lru", form))
      line += [fmt(pb, 1), fmt(lru, 1), fmt(lru / pb if pb and lru else None)]
    cells.append(line)
  columns = [f"{form} {c}" for form in forms for c in ("pb_lru", "lru", "x")]
  common.print_table(f"resolve: us per layer group (k={result['stream']['k']}; Pallas: best "
                     "configuration)", ("pool", "batch", *columns), cells)
  for t in result["targets"]:
    print(f"{'met   ' if t['met'] else 'MISSED'} {t['target']}: pool {t['pool']} batch "
          f"{t['batch']} {t['impl']}{' ' + t['policy'] if 'policy' in t else ''}"
          f"{' (' + t['measure'] + ')' if 'measure' in t else ''}: "
          f"{fmt(t['value'])}")


def main(argv: list[str]) -> int:
  """Runs the resolve benchmark; returns 0, or 1 when a measurement failed."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.quick:  # smaller defaults; explicit flags still win
    quick = dict(batch="1,3", k=16, pools="64,256", steps=2, segments=1, warmup=1,
                 pallas_block_elems="32", pallas_block_place="16", profile_resolves=2)
    for name, value in quick.items():
      if getattr(args, name) == parser.get_default(name):
        setattr(args, name, value)
  result = run(args, checkpoint=lambda partial: write_json(args.out, partial))
  print_table(result)
  path = write_json(args.out, result)
  print(f"wrote {path}")
  bad = [r for r in result["rows"] if r["error"] and not r["error"].startswith("skipped")]
  return 1 if bad else 0
