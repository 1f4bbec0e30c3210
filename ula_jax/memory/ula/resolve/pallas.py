"""Fused resolve of one layer group as Pallas (Triton) kernels: four launches, or one.

The result is identical, array for array, to ``Ula.resolve_meta`` (the jnp resolve):
the same table, owners, host free bitmap, policy state, slots, plan and stats. Only
the way it is computed differs. The jnp resolve sorts the step's ``M = B * k + B``
addresses to deduplicate them and order the entries to place; here nothing is sorted:

* **dedupe by location.** Every stored address has one location, so entries are
  deduplicated by setting bits in a bitmap over device slots (hits) and one over host
  slots (misses) with atomic OR; the lane that finds its bit clear is the entry's one
  representative. New tokens (``B`` of them) are deduplicated by comparing all pairs.
* **order by counting.** The jnp resolve gives the j-th entry to place (ascending
  address) the policy's j-th candidate. Misses set their bit in a bitmap over logical
  addresses; a *count pyramid* above it (entries per 32 words, per 32 of those, ...)
  gives every miss its rank with one 32-wide read per level, in parallel. Candidates
  are found the other way round: the j-th set bit of the policy's victim lists
  (free, cold, recent buckets oldest first) by descending the lists' count pyramids,
  again one 32-wide read per level. The host slot of the i-th victim likewise.

So every stage is data-parallel and no stage scans more than the bitmaps' words. The
launches (grid-wide results need a launch boundary; Triton has no grid barrier):

1. ``ula_resolve_mark`` (one lane per selected entry): table lookup, hit/miss bits,
   miss addresses, new-token dedupe, cleared host owners of misses, counts.
2. ``ula_resolve_round`` (one program per 1024 words of each bitmap; every PB-LRU ring
   bucket has its own programs): PB-LRU ``begin_round`` and the hits' touch on every
   bucket, ``host_free | missed host slots``, and the count pyramids of the victim
   lists, the host free slots and the miss addresses.
3. ``ula_resolve_place`` (one lane per entry to place, from a list launch 1 builds, so
   its work follows the misses, not ``M``): rank, candidate, victim and its host slot,
   table / owner updates, fetch and evict lists.
4. ``ula_resolve_publish`` (both kinds of programs; again one per list and block of
   words): the placed slots' touch, summary levels of every bitmap, each selected
   entry's slot, the unused tails of the plan.

Plus one XLA fill that zeroes the kernels' scratch buffer. With ``memory.policy=lru``
the pick (the ``n`` oldest of all slots, an ``O(S)`` ranking) is XLA's ``top_k``
between launches 2 and 3, as in the jnp resolve; every other stage is the same.

``kernels.resolve=pallas_fused`` runs PB-LRU's four stages in one launch,
``ula_resolve_fused``, with ``FUSED_CONFIG``: a grid of persistent programs, all resident
at once (two of 4 warps per SM, which fit at any register count), takes each stage's
blocks in turn (block ``v`` by program ``v mod programs``) and meets at a grid barrier
between stages: every program counts its arrival in a zeroed scratch word and polls it
until all have arrived. The stages' code is the launches' code; only who runs which
block differs. ``docs/kernels/resolve.md`` has the measurements behind both forms and the
variants that lost to them.

Triton arrays must have power-of-2 sizes: lanes are padded to the block, bitmaps are
read as ``[32, 32]`` word tiles. The bitmap and counter atomics are Triton's, relaxed
(``ula_jax.memory.ula.atomics``: each orders nothing but itself; launch boundaries and
grid barriers order the stages), a grid barrier's are acquire-release; in interpret
mode (CPU) they are emulated with lanes serialized in lane order, which has the same
results (the kernels only use an atomic's old value to name the first lane to set a bit).

Global state lives in the arrays of ``GroupMeta`` (updated in place when donated) and
in one int32 scratch buffer, zero-filled per call, laid out by ``_Geometry``. The
kernels always take the metadata of a stack of groups (``UlaState.meta``'s ``[G, ...]``
leaves, flattened) and the group to resolve, and read and write that group's part of
each stacked array through a ``_View`` (its elements from ``group * size``): inside a
decode step the stacked arrays are updated in place, with no slice copied out for the
kernels and none copied back. One group's metadata is resolved as a stack of one.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ula_jax.memory.ula.atomics import atomic
from ula_jax.core.types import INVALID
from ula_jax.memory.ula.policies import bitmap
from ula_jax.memory.ula.policies.lru import Lru, LruState
from ula_jax.memory.ula.policies.pb_lru import PbLruState
from ula_jax.memory.ula.state import GroupMeta, UlaPlan

_I32 = jnp.int32
_U32 = jnp.uint32
TILE = 32  # a bitmap pass reads [TILE, TILE] words: 1024 words (32768 bits) per program
BLOCK_WORDS = TILE * TILE
POLICIES = ("pb_lru", "lru")

# Scratch header (int32 counters, then one total per bitmap of the victim lists).
_N_HIT, _N_MISS, _N_FRESH, _N_FETCH, _N_EVICT, _N_LISTED, _TOT_HOST = range(7)
_TOT_POLICY = 7  # + b for policy bitmap b (0 free, 1 cold, 2 + r ring bucket r)
_BARRIERS = 3  # grid barriers of the fused launch (between its four stages)


@dataclasses.dataclass(frozen=True)
class ResolveConfig:
  """Tuning of the Pallas resolve (static and hashable).

  block_elems: selected entries per program in the mark and publish launches (power of 2)
  block_place: entries to place per program in the place launch, which reads
               ``[block_place, 32]`` tiles per pyramid level (power of 2)
  num_warps:   warps per program (Triton)
  fuse:        PB-LRU's resolve as one launch (``ula_resolve_fused``): persistent
               programs run the four stages, with a grid barrier between stages (exact
               LRU's pick is XLA's ``top_k``, so its resolve is always four launches)
  per_sm:      programs of the fused launch resident per SM (None: 8 / num_warps, which
               holds at any register count). More is only safe when the compiled kernel
               allows it (64K registers per SM: 3 programs of 4 warps at <= 168 registers
               per thread; ``ula-jax bench kernel_report`` shows the count), and the
               count follows the shapes and the PB-LRU ring (the fused launch compiles
               to 168 at batch 64, top-k 2048, 512K slots and 218 at batch 16, top-k
               256, 8K slots); a launch that is not all resident never passes its first
               grid barrier: the GPU hangs

  The defaults are ``kernels.resolve=pallas``, the fastest of sweeps on an H200 (1M-slot
  pool, batch 32 and 64, k 2048): the place launch is bound by the latency of each
  program's pyramid descents, so small programs that spread its entries over the SMs win.
  ``kernels.resolve=pallas_fused`` launches ``FUSED_CONFIG``; its persistent programs hide
  less memory latency than the four launches' own programs, which stay faster on the
  device (32-36 us against 43.7-46.8 per resolve at batch 64 from a cold cache).
  ``docs/kernels/resolve.md`` has the numbers.
  """

  block_elems: int = 256
  block_place: int = 16
  num_warps: int = 4
  fuse: bool = False
  per_sm: int | None = None

  def __post_init__(self):
    for name in ("block_elems", "block_place", "num_warps"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"ResolveConfig.{name}={v!r}: expected a power of 2 "
                         "(Triton arrays have power-of-2 sizes)")
    if not isinstance(self.fuse, bool):
      raise ValueError(f"ResolveConfig.fuse={self.fuse!r}: expected true or false")
    if self.per_sm is not None and (isinstance(self.per_sm, bool)
                                    or not isinstance(self.per_sm, int)
                                    or not 1 <= self.per_sm <= 16):
      raise ValueError(f"ResolveConfig.per_sm={self.per_sm!r}: expected None or an "
                       "integer in [1, 16] (programs resident per SM)")

  def resident_per_sm(self) -> int:
    """Programs of the fused launch resident on one SM at once: ``per_sm``, else those of
    ``num_warps`` warps that fit whatever their register use (255 registers per thread
    at most, 64K per SM)."""
    return self.per_sm or max(1, 8 // self.num_warps)


# The one launch (docs/kernels/resolve.md): 128-entry mark blocks and 8-entry place blocks
# spread the stages over the programs; two programs of 4 warps per SM, resident whatever
# the registers the shapes compile to (three, measured faster with a ring of 4 buckets,
# needs <= 168 per thread, which some shapes exceed).
FUSED_CONFIG = ResolveConfig(fuse=True, block_elems=128, block_place=8)


def fused_programs(config: ResolveConfig, interpret: bool,
                   programs: int | None = None) -> int:
  """Persistent programs of the fused launch: ``programs``, else every SM's share of
  resident programs (GPU) or one (interpreted: the grid runs one program after another,
  so a grid barrier between two programs could never complete).

  A grid barrier needs every program resident: more would deadlock, and so could two
  fused launches run side by side on one GPU (a decode step's resolves run one after
  another: each group's selection needs the layers before it).
  """
  if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int)
                               or programs < 1):
    raise ValueError(f"programs={programs!r}: expected a positive integer or None (every "
                     "SM's resident programs on GPU, one interpreted)")
  if interpret:
    if programs not in (None, 1):
      raise ValueError(f"programs={programs}: interpret mode runs the fused resolve as "
                       "one program (pass 1 or None, or ResolveConfig.fuse=False)")
    return 1
  sms = getattr(jax.local_devices()[0], "core_count", None)
  if not sms:
    if programs is None:
      raise ValueError("programs=None: the device does not report its SM count; pass "
                       "programs (all of them must be resident at once) or "
                       "ResolveConfig.fuse=False")
    return programs
  limit = sms * config.resident_per_sm()
  if programs is not None and programs > limit:
    raise ValueError(f"programs={programs}: the fused resolve's programs must all be "
                     f"resident at once; at most {limit} on this device ({sms} SMs x "
                     f"{config.resident_per_sm()} programs of {config.num_warps} warps)")
  return programs or limit


def default_interpret() -> bool:
  """Interpret mode everywhere but on GPU (the only Triton target)."""
  return jax.default_backend() != "gpu"


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class _Pyramid:
  """Count pyramid of ``count`` bitmaps of ``bits`` bits each, in the scratch buffer.

  Level 0 is the bitmap itself (popcounts of its words); level ``t >= 1`` holds, for
  entry ``g``, the set bits under words ``[g * 32^t, (g + 1) * 32^t)``. Sizes equal
  the bitmap's summary levels (``bitmap.level_sizes``); the top level has one entry.
  Level ``t`` of bitmap ``b``, entry ``g`` is at ``offsets[t - 1] + b * sizes[t] + g``.
  """

  sizes: tuple[int, ...]
  offsets: tuple[int, ...]
  count: int

  @property
  def top(self) -> int:
    return len(self.sizes) - 1

  @property
  def blocks(self) -> int:
    """Programs of a bitmap pass (``BLOCK_WORDS`` words each)."""
    return _cdiv(self.sizes[0], BLOCK_WORDS)

  def at(self, t: int, b, g):
    return self.offsets[t - 1] + b * self.sizes[t] + g


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """Static sizes of one resolve and the scratch layout (hashable)."""

  B: int
  k: int
  N: int  # logical addresses
  Sd: int  # device slots
  Hr: int  # host rows
  R: int  # PB-LRU recent buckets (1 for lru)
  policy: str
  config: ResolveConfig
  programs: int = 1  # persistent programs of the fused launch
  # scratch layout
  hits_off: int = 0  # [W0(Sd)] hit bits (launches 1-2)
  placed_off: int = 0  # [W0(Sd)] placed bits (launches 3-4)
  host_off: int = 0  # [W0(Hr)] missed host slots (1-2), then used host slots (3-4)
  addr_off: int = 0  # [W0(N)] miss addresses (1-3)
  sync_off: int = 0  # [_BARRIERS] arrivals at the fused launch's grid barriers
  scratch_size: int = 0
  pol: _Pyramid | None = None
  host: _Pyramid | None = None
  addr: _Pyramid | None = None

  @classmethod
  def build(cls, *, B, k, N, Sd, Hr, R, policy, config, programs=1) -> _Geometry:
    sync_off = _TOT_POLICY + (R + 2 if policy == "pb_lru" else 0)
    off = sync_off + _BARRIERS
    hits_off, off = off, off + bitmap.num_words(Sd)
    placed_off, off = off, off + bitmap.num_words(Sd)
    host_off, off = off, off + bitmap.num_words(Hr)
    addr_off, off = off, off + bitmap.num_words(N)

    def pyramid(bits: int, count: int) -> _Pyramid:
      nonlocal off
      sizes = bitmap.level_sizes(bits)
      offsets = []
      for w in sizes[1:]:
        offsets.append(off)
        off += count * w
      return _Pyramid(sizes=sizes, offsets=tuple(offsets), count=count)

    pol = pyramid(Sd, R + 2) if policy == "pb_lru" else None
    host = pyramid(Hr, 1)
    addr = pyramid(N, 1)
    return cls(B=B, k=k, N=N, Sd=Sd, Hr=Hr, R=R, policy=policy, config=config,
               programs=programs, hits_off=hits_off, placed_off=placed_off,
               host_off=host_off, addr_off=addr_off,
               sync_off=sync_off, scratch_size=off,
               pol=pol, host=host, addr=addr)

  @property
  def BK(self) -> int:
    return self.B * self.k

  @property
  def M(self) -> int:
    return self.B * self.k + self.B

  @property
  def Bp(self) -> int:
    return _pow2(self.B)

  @property
  def round_units(self) -> int:
    """Virtual programs of the round stage over the policy bitmaps: per block of words,
    one per ring bucket and one for the free list (PB-LRU; 0 for exact LRU). Every
    bitmap's tile has a program of its own, so the ring's buckets run side by side."""
    return self.pol.blocks * (self.R + 1) if self.policy == "pb_lru" else 0

  @property
  def publish_units(self) -> int:
    """Virtual programs of the publish stage over the policy bitmaps: per block of
    words, one per list (free, cold, every ring bucket)."""
    return self.pol.blocks * (self.R + 2) if self.policy == "pb_lru" else 0

  @property
  def round_programs(self) -> int:
    """Virtual programs of the round stage (its launch's grid): the policy bitmaps',
    the host free slots' and the miss addresses' blocks."""
    return self.round_units + self.host.blocks + self.addr.blocks

  @property
  def publish_programs(self) -> int:
    """Virtual programs of the publish stage (its launch's grid): the policy bitmaps',
    the host free slots' blocks and the entries' (``block_elems`` each)."""
    return self.publish_units + self.host.blocks + _cdiv(self.M, self.config.block_elems)

  def elem_programs(self, block: int) -> tuple[int, int]:
    """(programs over the selection, programs over the new tokens)."""
    return _cdiv(self.BK, block), _cdiv(self.B, block)


# ----------------------------------------------------------------------------------
# Ref helpers (shared by the GPU and interpret paths)
# ----------------------------------------------------------------------------------


class _View(NamedTuple):
  """One group's part of a stacked array's ref: its elements ``[base, base + size)``.

  The kernels take the metadata of every layer group, stacked and flattened (``[G *
  size]``), and read and write one group's part in place; ``base`` is ``group * size``,
  loaded from the launch's ``group`` input. The ref helpers below take a view or a
  plain ref alike."""

  ref: Any
  base: Any  # int32 scalar
  size: int

  @property
  def shape(self) -> tuple[int]:
    return (self.size,)

  @property
  def dtype(self) -> Any:
    return self.ref.dtype


def _addr(ref, idx):
  """(the ref to index, ``idx`` in it): a view's indices offset by its base."""
  if isinstance(ref, _View):
    return ref.ref, ref.base + idx
  return ref, idx


def _ld(ref, idx, mask, other):
  """``ref[idx]`` where ``mask`` (``other`` elsewhere); masked lanes read index 0."""
  ref, idx = _addr(ref, idx)
  return plgpu.load(ref.at[jnp.where(mask, idx, 0)], mask=mask, other=other)


def _st(ref, idx, val, mask) -> None:
  """``ref[idx] = val`` where ``mask``. Masked lanes point one past the end (of the whole
  stacked array for a view): masked on GPU, dropped when interpreted (where a masked
  lane would otherwise write back the value it read, over a live lane's store to the
  same index)."""
  ref, idx = _addr(ref, idx)
  plgpu.store(ref.at[jnp.where(mask, idx, ref.shape[0])], val, mask=mask)


def _get(ref, i):
  """Scalar ``ref[i]``."""
  ref, i = _addr(ref, jnp.asarray(i, _I32))
  return plgpu.load(ref.at[i])


def _put(ref, i, val) -> None:
  """Scalar ``ref[i] = val``."""
  ref, i = _addr(ref, jnp.asarray(i, _I32))
  plgpu.store(ref.at[i], val)


def _bit(pos):
  """[n] int32 -> the int32 word with bit ``pos % 32`` set."""
  return jnp.left_shift(jnp.int32(1), pos & 31)


def _atomic(kind: str, ref, idx, val, mask, *, interpret: bool):
  """Per-lane atomic ``ref[idx] (op)= val`` where ``mask``; returns the old values.

  On GPU these are Triton's atomics. Interpreted, lanes are serialized in lane order:
  a lane's old value includes the updates of the lanes before it to the same index.
  """
  if not interpret:
    ref, idx = _addr(ref, idx)
    return atomic(kind, ref, (jnp.where(mask, idx, 0),), val, mask=mask)
  n = idx.shape[0]
  lane = jnp.arange(n, dtype=_I32)
  same = mask[:, None] & mask[None, :] & (idx[:, None] == idx[None, :])
  before = same & (lane[None, :] < lane[:, None])
  cur = _ld(ref, idx, mask, 0)
  if kind == "add":
    acc = lambda m: jnp.sum(jnp.where(m, val[None, :], 0), axis=1, dtype=cur.dtype)
    old, new = cur + acc(before), cur + acc(same)
  else:
    op = jax.lax.bitwise_or if kind == "or" else jax.lax.bitwise_and
    unit = jnp.zeros((), cur.dtype) if kind == "or" else ~jnp.zeros((), cur.dtype)
    acc = lambda m: jax.lax.reduce(jnp.where(m, val[None, :], unit), unit, op, (1,))
    old, new = op(cur, acc(before)), op(cur, acc(same))
  _st(ref, idx, new, mask)
  return old


def _add_scalar(ref, i, val, *, interpret: bool):
  """``ref[i] += val`` by one program (atomic across programs on GPU); returns the old
  value (interpreted, programs run one after another)."""
  if not interpret:
    ref, i = _addr(ref, i)
    return atomic("add", ref, (i,), val)
  old = _get(ref, i)
  _put(ref, i, old + val)
  return old


def _or_scalar(ref, i, val, *, interpret: bool) -> None:
  """``ref[i] |= val`` by one program (atomic across programs on GPU)."""
  if not interpret:
    ref, i = _addr(ref, i)
    atomic("or", ref, (i,), val)
    return
  _put(ref, i, _get(ref, i) | val)


def _popcount(x):
  """Set bits of each 32-bit word (x: any shape, uint32 or int32) as int32.

  A SWAR count with shifts, masks and one multiply: ``lax.population_count`` lowers to
  ``math.ctpop``, which Triton does not legalize. Shifts are on uint32 so they are
  logical (an int32 word's sign bit must not smear into the count).
  """
  x = x.astype(_U32)
  x = x - ((x >> 1) & jnp.uint32(0x55555555))
  x = (x & jnp.uint32(0x33333333)) + ((x >> 2) & jnp.uint32(0x33333333))
  x = (x + (x >> 4)) & jnp.uint32(0x0F0F0F0F)
  return ((x * jnp.uint32(0x01010101)) >> 24).astype(_I32)


def _select_bit(word, rank):
  """Position (0..31) of the ``rank``-th set bit of each uint32 ``word`` (five steps of
  a binary search on the popcount of the low half; bit arithmetic only)."""
  pos = jnp.zeros(word.shape, _I32)
  for width in (16, 8, 4, 2, 1):
    low = (word >> pos.astype(_U32)) & jnp.uint32((1 << width) - 1)
    c = _popcount(low)
    go = rank >= c
    rank = jnp.where(go, rank - c, rank)
    pos = jnp.where(go, pos + width, pos)
  return pos


def _tile(p):
  """Word indices of bitmap block ``p``: [TILE, TILE], row = 32 consecutive words."""
  r = jnp.arange(TILE, dtype=_I32)
  return p * BLOCK_WORDS + r[:, None] * TILE + r[None, :]


def _block_counts(words, p, pyr: _Pyramid, b, work, total_at, *, interpret) -> None:
  """Count pyramid of block ``p`` of bitmap ``b`` (words: [TILE, TILE] uint32, 0 past
  the end). Levels 1 and 2 of a block belong to its program; above, blocks add up."""
  c1 = jnp.sum(_popcount(words), axis=1)  # [TILE] per 32 words
  total = jnp.sum(c1)
  if pyr.top >= 1:
    g = p * TILE + jnp.arange(TILE, dtype=_I32)
    _st(work, pyr.at(1, b, g), c1, g < pyr.sizes[1])
  if pyr.top >= 2:
    _put(work, pyr.at(2, b, p), total)
  for t in range(3, pyr.top + 1):
    _add_scalar(work, pyr.at(t, b, p >> (5 * (t - 2))), total, interpret=interpret)
  if total_at is not None:
    _add_scalar(work, total_at, total, interpret=interpret)


def _block_summaries(words, p, refs: list, bases: list, widths: tuple[int, ...], *,
                     interpret: bool) -> None:
  """Summary levels above block ``p`` of one bitmap (words: [TILE, TILE] uint32, its
  final level-0 words, 0 past the end).

  refs[t - 1]: the ref of summary level t; bases[t - 1]: this bitmap's offset in it (the
  ring buckets share one flat ref per level); widths[t - 1]: entries per bitmap. Levels
  1 and 2 of a block belong to its program; above, blocks OR their bit into words the
  round launch zeroed.
  """
  top = len(widths)
  shifts = jnp.arange(TILE, dtype=_U32)
  # Distinct powers of two: the sum is the bitwise or.
  l1 = jnp.sum((words != 0).astype(_U32) << shifts[None, :], axis=1)  # [TILE]
  if top >= 1:
    g = p * TILE + jnp.arange(TILE, dtype=_I32)
    _st(refs[0], bases[0] + g, l1, g < widths[0])
  l2 = jnp.sum((l1 != 0).astype(_U32) << shifts)
  if top >= 2:
    _put(refs[1], bases[1] + p, l2)
  for t in range(3, top + 1):
    e = p >> (5 * (t - 3))  # the level t - 1 entry that holds this block
    bit = jnp.where(l2 != 0, jnp.left_shift(jnp.uint32(1), (e & 31).astype(_U32)),
                    jnp.uint32(0))
    _or_scalar(refs[t - 1], bases[t - 1] + (e >> 5), bit, interpret=interpret)


def _zero(ref) -> None:
  n = ref.shape[0]
  i = jnp.arange(_pow2(n), dtype=_I32)
  _st(ref, i, jnp.zeros(i.shape, ref.dtype), i < n)


def _descend(searches: list, work) -> list:
  """Position of the ``rank``-th set bit (0-based) of bitmap ``b``, per lane, for each
  search ``(rank, ok, b, pyr, word_of)``:

  rank, b: [C] int32; ok: [C] bool (lanes to compute; their rank is below the total)
  pyr: the bitmaps' ``_Pyramid``; word_of(b, idx, mask): their level-0 words (uint32, 0
  where not mask)

  Top-down: at each level the lane reads the 32 counts under its node, takes the child
  its rank falls in and subtracts the counts before it. The searches step together, one
  level each per step (all their reads issued before any is used), so that independent
  searches wait for memory once per step, not once per level of each.
  """
  lane32 = jnp.arange(TILE, dtype=_I32)
  node = [jnp.zeros_like(rank) for rank, *_ in searches]
  rank = [rank for rank, *_ in searches]
  depth = max(pyr.top for _, _, _, pyr, _ in searches)
  for d in range(depth):
    cnts = []
    for i, (_, ok, b, pyr, word_of) in enumerate(searches):
      t = pyr.top - d
      if t < 1:
        cnts.append(None)
        continue
      child = node[i][:, None] * TILE + lane32[None, :]  # [C, 32] entries of level t - 1
      m = ok[:, None] & (child < pyr.sizes[t - 1])
      if t >= 2:
        cnts.append(_ld(work, pyr.at(t - 1, b[:, None], child), m, 0))
      else:
        cnts.append(_popcount(word_of(b[:, None], child, m)))
    for i, cnt in enumerate(cnts):
      if cnt is None:
        continue
      cs = jnp.cumsum(cnt, axis=1)
      pick = jnp.sum((cs <= rank[i][:, None]).astype(_I32), axis=1)
      rank[i] = rank[i] - jnp.sum(jnp.where(lane32[None, :] < pick[:, None], cnt, 0),
                                  axis=1)
      node[i] = node[i] * TILE + pick
  words = [word_of(b, node[i], ok) for i, (_, ok, b, _, word_of) in enumerate(searches)]
  return [node[i] * TILE + _select_bit(w, rank[i]) for i, w in enumerate(words)]


def _rank(a, ok, pyr: _Pyramid, work, words_off: int):
  """Set bits of the bitmap at ``work[words_off:]`` below position ``a``, per lane:
  the bits below ``a`` in its word, plus, per level, the counts of the siblings before
  ``a``'s ancestor (a: [C] int32; ok: [C] bool)."""
  lane32 = jnp.arange(TILE, dtype=_I32)
  word = _ld(work, words_off + (a >> 5), ok, 0).astype(_U32)
  below = jnp.left_shift(jnp.uint32(1), (a & 31).astype(_U32)) - jnp.uint32(1)
  r = _popcount(word & below)
  for t in range(pyr.top):
    anc = a >> (5 * (t + 1))  # ancestor entry at level t (t = 0: the word)
    sib = (anc & ~31)[:, None] + lane32[None, :]
    m = ok[:, None] & (lane32[None, :] < (anc & 31)[:, None])
    if t == 0:
      cnt = _popcount(_ld(work, words_off + sib, m, 0))
    else:
      cnt = _ld(work, pyr.at(t, 0, sib), m, 0)
    r = r + jnp.sum(cnt, axis=1)
  return r


# ----------------------------------------------------------------------------------
# Launch 1: mark
# ----------------------------------------------------------------------------------


def _mark_kernel(r: dict, g: _Geometry, interpret: bool, pid=None) -> None:
  # r: sel_addr [BK] int32, sel_valid [BK] bool, new_addr [B] int32, active [B] bool,
  #    table [N] int32, (lru: clock [1]); updated: host_owner [Hr], work, (lru: stamp [Sd]);
  #    written: roles [M] int32 (1 = the representative of a miss, 2 = of a fresh new
  #    token, 0 = neither), place_list [M] int32 (the representatives' elements, first
  #    work[_N_LISTED]), (lru: clock1 [1])
  C = g.config.block_elems
  n_sel, _ = g.elem_programs(C)
  pid = pl.program_id(0) if pid is None else pid
  work = r["work"]

  def body(new_tokens: bool) -> None:
    lane = jnp.arange(C, dtype=_I32)
    if new_tokens:
      b = (pid - n_sel) * C + lane
      live = b < g.B
      a = _ld(r["new_addr"], b, live, INVALID)
      w = _ld(r["active"], b, live, False)
      e = g.BK + b
    else:
      e = pid * C + lane
      live = e < g.BK
      a = _ld(r["sel_addr"], e, live, INVALID)
      w = _ld(r["sel_valid"], e, live, False)
    want = live & w & (a >= 0) & (a < g.N)
    loc = _ld(r["table"], a, want, INVALID)
    hit = want & (loc >= 0) & (loc < g.Sd)
    miss = want & (loc >= g.Sd)
    # The first lane to set an entry's bit is its representative. PB-LRU's round counts
    # the distinct hits from the bitmap, so no lane waits for its hit's old word.
    old = _atomic("or", work, g.hits_off + (loc >> 5), _bit(loc), hit, interpret=interpret)
    first_hit = hit & ((old & _bit(loc)) == 0) if g.policy == "lru" else None
    h = loc - g.Sd
    old = _atomic("or", work, g.host_off + (h >> 5), _bit(h), miss, interpret=interpret)
    first_miss = miss & ((old & _bit(h)) == 0)
    # Misses leave the host (a victim may take the slot later, in the place launch).
    _st(r["host_owner"], h, jnp.full(h.shape, INVALID, _I32), miss)
    _atomic("or", work, g.addr_off + (a >> 5), _bit(a), first_miss, interpret=interpret)
    if g.policy == "lru":
      clock1 = _get(r["clock"], 0) + 1
      _st(r["stamp"], loc, jnp.full(loc.shape, clock1, _I32), hit)
    fresh = jnp.zeros(want.shape, jnp.bool_)
    if new_tokens:
      # An unstored new token is placed once, by its first occurrence among new tokens
      # (selected copies of it take its slot when published).
      j = jnp.arange(g.Bp, dtype=_I32)
      jl = j < g.B
      na = _ld(r["new_addr"], j, jl, INVALID)
      nw = _ld(r["active"], j, jl, False) & jl & (na >= 0) & (na < g.N)
      earlier = nw[None, :] & (na[None, :] == a[:, None]) & (j[None, :] < b[:, None])
      fresh = want & (loc < 0) & (jnp.sum(earlier.astype(_I32), axis=1) == 0)
    role = jnp.where(first_miss, 1, jnp.where(fresh, 2, 0)).astype(_I32)
    _st(r["roles"], e, role, live)
    for at, m in ((_N_HIT, first_hit), (_N_MISS, first_miss), (_N_FRESH, fresh)):
      if m is not None:
        _add_scalar(work, at, jnp.sum(m.astype(_I32)), interpret=interpret)
    # The representatives of the entries to place, listed for the place launch so that
    # its work follows their number, not M's. List order does not matter: every entry
    # computes its own rank.
    rep = role > 0
    local = jnp.cumsum(rep.astype(_I32)) - 1
    base = _add_scalar(work, _N_LISTED, jnp.sum(rep.astype(_I32)), interpret=interpret)
    _st(r["place_list"], base + local, e, rep)

  pl.when(pid < n_sel)(lambda: body(False))
  pl.when(pid >= n_sel)(lambda: body(True))
  if g.policy == "lru":
    @pl.when(pid == 0)
    def _():
      _put(r["clock1"], 0, _get(r["clock"], 0) + 1)


# ----------------------------------------------------------------------------------
# Launch 2: round (bitmap words)
# ----------------------------------------------------------------------------------


def _round_kernel(r: dict, g: _Geometry, interpret: bool, pid=None) -> None:
  # r: (pb_lru: cur [1]); updated: work, host0 [W0(Hr)] (becomes host_free | missed),
  #    host{t} (t >= 3, zeroed), (pb_lru: free0, cold0 [W0], ring0 [R * W0],
  #    free{t}, cold{t}, ring{t} for t >= 3, zeroed); written: (pb_lru: cur1 [1])
  pid = pl.program_id(0) if pid is None else pid
  work = r["work"]
  n_pol = g.round_units
  n_host = g.host.blocks

  if g.policy == "pb_lru":
    W0, R, nb = g.pol.sizes[0], g.R, g.pol.blocks

    # Virtual program pid < n_pol: words block blk of ring bucket q (q = R: the free
    # list). Each reads the hit bits and writes its own bitmap; the next bucket's
    # program also moves the bucket's old bits to cold.
    @pl.when(pid < n_pol)
    def _():
      blk, q = pid % nb, pid // nb
      idx = _tile(blk)
      m = idx < W0
      nxt = jax.lax.rem(_get(r["cur"], 0) + 1, jnp.int32(R))
      zero = jnp.uint32(0)
      hits = _ld(work, g.hits_off + idx, m, 0).astype(_U32)
      keep = ~hits

      @pl.when(q == R)
      def _():
        _add_scalar(work, _N_HIT, jnp.sum(_popcount(hits)), interpret=interpret)
        free = _ld(r["free0"], idx, m, zero) & keep
        _st(r["free0"], idx, free, m)
        _block_counts(free, blk, g.pol, 0, work, _TOT_POLICY, interpret=interpret)

      # begin_round: the bucket after the current one joins cold and becomes current;
      # then the hits leave every bucket and join it.
      @pl.when(q < R)
      def _():
        ring = _ld(r["ring0"], q * W0 + idx, m, zero)

        @pl.when(q == nxt)
        def _():
          cold = (_ld(r["cold0"], idx, m, zero) | ring) & keep
          _st(r["cold0"], idx, cold, m)
          _block_counts(cold, blk, g.pol, 1, work, _TOT_POLICY + 1, interpret=interpret)

        ring = jnp.where(q == nxt, hits, ring & keep)
        _st(r["ring0"], q * W0 + idx, ring, m)
        _block_counts(ring, blk, g.pol, 2 + q, work, _TOT_POLICY + 2 + q,
                      interpret=interpret)

  @pl.when((pid >= n_pol) & (pid < n_pol + n_host))
  def _():
    p = pid - n_pol
    idx = _tile(p)
    m = idx < g.host.sizes[0]
    # Write-back targets: free host slots, including those the misses vacate.
    hfree = _ld(r["host0"], idx, m, jnp.uint32(0)) | _ld(
        work, g.host_off + idx, m, 0).astype(_U32)
    _st(r["host0"], idx, hfree, m)
    _st(work, g.host_off + idx, jnp.zeros(idx.shape, _I32), m)
    _block_counts(hfree, p, g.host, 0, work, _TOT_HOST, interpret=interpret)

  @pl.when(pid >= n_pol + n_host)
  def _():
    p = pid - n_pol - n_host
    idx = _tile(p)
    words = _ld(work, g.addr_off + idx, idx < g.addr.sizes[0], 0).astype(_U32)
    _block_counts(words, p, g.addr, 0, work, None, interpret=interpret)

  @pl.when(pid == 0)
  def _():
    if g.policy == "pb_lru":
      nxt = jax.lax.rem(_get(r["cur"], 0) + 1, jnp.int32(g.R))
      _put(r["cur1"], 0, nxt)
      for t in range(3, g.pol.top + 1):
        for name in ("free", "cold", "ring"):
          _zero(r[f"{name}{t}"])
    for t in range(3, g.host.top + 1):
      _zero(r[f"host{t}"])


# ----------------------------------------------------------------------------------
# Launch 3: place
# ----------------------------------------------------------------------------------


def _place_kernel(r: dict, g: _Geometry, interpret: bool, pid=None) -> None:
  # r: sel_addr [BK], new_addr [B], roles, place_list [M], host0 [W0(Hr)] (host_free |
  #    missed), (pb_lru: cur1 [1], free0, cold0, ring0), (lru: cand, cand_ok, cand_free
  #    [M], lru_counts [2] = (free slots taken, candidates found), clock1 [1]);
  #    updated: table, dev_owner, host_owner, work, (lru: stamp);
  #    written: fetch_src, fetch_dst, evict_src, evict_dst [M] (their valid prefix)
  C = g.config.block_place
  pid = pl.program_id(0) if pid is None else pid
  work = r["work"]
  n_place = _get(work, _N_LISTED)  # = misses + fresh new tokens

  if g.policy == "pb_lru":
    # Victim lists: free, cold, then the recent buckets oldest to newest (the current
    # bucket is never a list).
    R = g.R
    cur = _get(r["cur1"], 0)
    li = jnp.arange(_pow2(R + 1), dtype=_I32)
    lok = li < R + 1
    ring_q = jax.lax.rem(cur + jnp.maximum(li, 1) - 1, jnp.int32(R))
    bid = jnp.where(li == 0, 0, jnp.where(li == 1, 1, 2 + ring_q))
    tot = _ld(work, _TOT_POLICY + bid, lok, 0)  # [L] set bits per list
    n_ok = jnp.minimum(n_place, jnp.sum(tot))
    n_free_taken = jnp.minimum(jnp.sum(jnp.where(li == 0, tot, 0)), n_ok)
  else:
    n_free_taken = _get(r["lru_counts"], 0)
    n_ok = _get(r["lru_counts"], 1)

  @pl.when(pid == 0)
  def _():
    _put(work, _N_EVICT, n_ok - n_free_taken)

  @pl.when(pid * C < n_place)
  def _():
    # Loads that depend on no other come first, so that they wait for memory together.
    i = pid * C + jnp.arange(C, dtype=_I32)
    act = i < n_place
    e = _ld(r["place_list"], i, act, 0)
    jb = jnp.arange(g.Bp, dtype=_I32)
    jl = jb < g.B
    fresh_role = _ld(r["roles"], g.BK + jb, jl, 0)
    fresh_addr = _ld(r["new_addr"], jb, jl, 0)
    host_total = _get(work, _TOT_HOST)
    miss = act & (_ld(r["roles"], e, act, 0) == 1)
    is_sel = e < g.BK
    a = jnp.where(is_sel, _ld(r["sel_addr"], e, act & is_sel, 0),
                  _ld(r["new_addr"], e - g.BK, act & ~is_sel, 0))
    loc = _ld(r["table"], a, act & miss, INVALID)

    # The j-th entry to place (ascending address) takes the j-th candidate: j counts
    # the misses below (the address pyramid) and the fresh new tokens below (<= B).
    fi = _rank(a, act, g.addr, work, g.addr_off)
    fresh_a = jnp.where(jl & (fresh_role == 2), fresh_addr, g.N)
    j = fi + jnp.sum((fresh_a[None, :] < a[:, None]).astype(_I32), axis=1)

    if g.policy == "pb_lru":
      placed = act & (j < n_ok)
      cs = jnp.cumsum(tot)
      lst = jnp.sum(((cs[None, :] <= j[:, None]) & lok[None, :]).astype(_I32), axis=1)
      within = j - jnp.sum(jnp.where(li[None, :] < lst[:, None], tot[None, :], 0), axis=1)
      b = jnp.sum(jnp.where(li[None, :] == lst[:, None], bid[None, :], 0), axis=1)
      W0 = g.pol.sizes[0]
      zero = jnp.uint32(0)

      def policy_word(b, idx, m):
        return (_ld(r["free0"], idx, m & (b == 0), zero)
                | _ld(r["cold0"], idx, m & (b == 1), zero)
                | _ld(r["ring0"], (b - 2) * W0 + idx, m & (b >= 2), zero))

      searches = [(within, placed, b, g.pol, policy_word)]
      was_free = lst == 0
    else:
      s = _ld(r["cand"], j, act, INVALID)
      placed = act & _ld(r["cand_ok"], j, act, False)
      was_free = _ld(r["cand_free"], j, act, False)
      searches = []

    # Victims take free host slots in order (the misses' vacated slots included): the
    # host search needs only the entry's rank, so it runs beside the slot's.
    victim = placed & ~was_free
    vi = j - n_free_taken
    has_h = victim & (vi < host_total)
    host_word = lambda b, idx, m: _ld(r["host0"], idx, m, jnp.uint32(0))
    *found, h = _descend(searches + [(vi, has_h, jnp.zeros_like(vi), g.host, host_word)],
                         work)
    if g.policy == "pb_lru":
      s = jnp.where(placed, found[0], INVALID)
    h = jnp.where(has_h, h, INVALID)
    v_addr = _ld(r["dev_owner"], s, victim, INVALID)

    # Table and owners (victims and placed entries are disjoint: victims are on the
    # device, never selected). Each slot, address and list index has one writer.
    _st(r["table"], a, s, placed)
    _st(r["dev_owner"], s, a, placed)
    _st(r["table"], v_addr, g.Sd + h, victim)
    # (A victim without a host slot, impossible within the validated sizes, writes
    # where the jnp resolve's negative index lands: the last row.)
    _st(r["host_owner"], jnp.where(h >= 0, h, g.Hr + h), v_addr, victim)
    _st(r["evict_src"], vi, s, victim)
    _st(r["evict_dst"], vi, h, victim)
    _atomic("or", work, g.host_off + (h >> 5), _bit(h), has_h, interpret=interpret)
    if g.policy == "pb_lru":
      _atomic("or", work, g.placed_off + (s >> 5), _bit(s), placed, interpret=interpret)
    else:
      _st(r["stamp"], s, jnp.full(s.shape, _get(r["clock1"], 0), _I32), placed)
    # Placed misses are the first misses by address: the i-th fetch is the i-th miss.
    fetch = placed & miss
    _st(r["fetch_src"], fi, loc - g.Sd, fetch)
    _st(r["fetch_dst"], fi, s, fetch)
    _add_scalar(work, _N_FETCH, jnp.sum(fetch.astype(_I32)), interpret=interpret)


# ----------------------------------------------------------------------------------
# Launch 4: publish
# ----------------------------------------------------------------------------------


def _publish_kernel(r: dict, g: _Geometry, interpret: bool, pid=None) -> None:
  # r: sel_addr, sel_valid, new_addr, active, table, work, (pb_lru: cur1; lru: clock1);
  #    updated: host levels, (pb_lru: free, cold, ring levels, cur; lru: clock), the
  #    plan lists;
  #    written: slots [BK], new_slot [B], hits, misses, n_fetch, n_evict [1]
  pid = pl.program_id(0) if pid is None else pid
  work = r["work"]
  n_pol = g.publish_units
  n_host = g.host.blocks
  zero = jnp.uint32(0)

  def levels(name: str, top: int) -> list:
    return [r[f"{name}{t}"] for t in range(1, top + 1)]

  if g.policy == "pb_lru":
    W, R, nb = g.pol.sizes, g.R, g.pol.blocks

    # Virtual program pid < n_pol: words block blk of list b (0 free, 1 cold, 2 + q
    # ring bucket q); the placed slots leave every list and join the current bucket.
    @pl.when(pid < n_pol)
    def _():
      blk, b = pid % nb, pid // nb
      idx = _tile(blk)
      m = idx < W[0]
      placed = _ld(work, g.placed_off + idx, m, 0).astype(_U32)
      keep = ~placed
      for name, which in (("free", 0), ("cold", 1)):
        @pl.when(b == which)
        def _():
          words = _ld(r[f"{name}0"], idx, m, zero) & keep
          _st(r[f"{name}0"], idx, words, m)
          _block_summaries(words, blk, levels(name, g.pol.top), [0] * g.pol.top, W[1:],
                           interpret=interpret)

      @pl.when(b >= 2)
      def _():
        q = b - 2
        ring = _ld(r["ring0"], q * W[0] + idx, m, zero)
        ring = jnp.where(_get(r["cur1"], 0) == q, ring | placed, ring & keep)
        _st(r["ring0"], q * W[0] + idx, ring, m)
        _block_summaries(ring, blk, levels("ring", g.pol.top), [q * w for w in W[1:]],
                         W[1:], interpret=interpret)

  @pl.when((pid >= n_pol) & (pid < n_pol + n_host))
  def _():
    p = pid - n_pol
    idx = _tile(p)
    m = idx < g.host.sizes[0]
    used = _ld(work, g.host_off + idx, m, 0).astype(_U32)
    hfree = _ld(r["host0"], idx, m, zero) & ~used
    _st(r["host0"], idx, hfree, m)
    _block_summaries(hfree, p, levels("host", g.host.top), [0] * g.host.top,
                     g.host.sizes[1:], interpret=interpret)

  @pl.when(pid >= n_pol + n_host)
  def _():
    C = g.config.block_elems
    e = (pid - n_pol - n_host) * C + jnp.arange(C, dtype=_I32)
    live = e < g.M
    is_sel = e < g.BK
    a = jnp.where(is_sel, _ld(r["sel_addr"], e, live & is_sel, INVALID),
                  _ld(r["new_addr"], e - g.BK, live & ~is_sel, INVALID))
    w = jnp.where(is_sel, _ld(r["sel_valid"], e, live & is_sel, False),
                  _ld(r["active"], e - g.BK, live & ~is_sel, False))
    want = live & w & (a >= 0) & (a < g.N)
    # Every needed entry is on the device now (or could not be placed): its slot is
    # the table's, aligned with the selection.
    t = _ld(r["table"], a, want, INVALID)
    slot = jnp.where(want & (t >= 0) & (t < g.Sd), t, INVALID)
    _st(r["slots"], e, slot, live & is_sel)
    _st(r["new_slot"], e - g.BK, slot, live & ~is_sel)
    n_fetch = _get(work, _N_FETCH)
    n_evict = _get(work, _N_EVICT)
    inv = jnp.full(e.shape, INVALID, _I32)
    for name, n in (("fetch_src", n_fetch), ("fetch_dst", n_fetch), ("evict_src", n_evict),
                    ("evict_dst", n_evict)):
      _st(r[name], e, inv, live & (e >= n))

  @pl.when(pid == 0)
  def _():
    for name, at in (("hits", _N_HIT), ("misses", _N_MISS), ("n_fetch", _N_FETCH),
                     ("n_evict", _N_EVICT)):
      _put(r[name], 0, _get(work, at))
    # The policy's round (PB-LRU's current bucket, exact LRU's clock) into the group's
    # own word: every stage before this one has read it.
    if g.policy == "pb_lru":
      _put(r["cur"], 0, _get(r["cur1"], 0))
    else:
      _put(r["clock"], 0, _get(r["clock1"], 0))


# ----------------------------------------------------------------------------------
# One launch: the four stages in persistent programs
# ----------------------------------------------------------------------------------


def _grid_barrier(work, at: int, programs: int) -> None:
  """Waits until all ``programs`` programs of the grid reached this barrier (each barrier
  has its own zeroed word ``work[at]``; every program must be resident).

  The CTA barrier first makes the program's stores part of its arrival; the arrival and
  the polls are acquire-release atomics at GPU scope, so stores made before the barrier
  by any program are visible to every program after it. One program (interpret mode)
  has no one to wait for.
  """
  if programs == 1:
    return
  at = jnp.int32(at)
  plgpu.debug_barrier()
  plgpu.atomic_add(work, (at,), jnp.int32(1))
  jax.lax.while_loop(lambda n: n < programs,
                     lambda n: plgpu.atomic_add(work, (at,), jnp.int32(0)), jnp.int32(0))
  plgpu.debug_barrier()


def _each(n, programs: int, fn: Callable) -> None:
  """``fn(v)`` for this program's share of ``n`` virtual programs (``v = pid, pid +
  programs, ...``); ``n``: int or traced int32 scalar."""
  pid = pl.program_id(0)
  if isinstance(n, int):
    trips = _cdiv(n, programs)
    if trips == 0:
      return
    guard = n % programs != 0
  else:
    trips = jnp.maximum((n - pid + programs - 1) // programs, 0)
    guard = False

  def body(i, carry):
    v = pid + i * programs
    if guard:
      pl.when(v < n)(lambda: fn(v))
    else:
      fn(v)
    return carry

  if isinstance(trips, int) and trips == 1:
    body(0, 0)
  else:
    jax.lax.fori_loop(0, trips, body, jnp.int32(0))


def _fused_kernel(r: dict, g: _Geometry, interpret: bool) -> None:
  # r: the union of the four launches' refs (PB-LRU only). Each stage's virtual programs
  # are those of its own launch; a grid barrier stands where a launch boundary was.
  P = g.programs
  work = r["work"]
  n_sel, n_new = g.elem_programs(g.config.block_elems)
  _each(n_sel + n_new, P, lambda v: _mark_kernel(r, g, interpret, pid=v))
  _grid_barrier(work, g.sync_off, P)
  _each(g.round_programs, P, lambda v: _round_kernel(r, g, interpret, pid=v))
  _grid_barrier(work, g.sync_off + 1, P)
  # Virtual program 0 always runs (it writes the eviction count).
  C = g.config.block_place
  n_place = jnp.maximum((_get(work, _N_LISTED) + C - 1) // C, 1)
  _each(n_place, P, lambda v: _place_kernel(r, g, interpret, pid=v))
  _grid_barrier(work, g.sync_off + 2, P)
  _each(g.publish_programs, P, lambda v: _publish_kernel(r, g, interpret, pid=v))


# ----------------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------------


def _launch(kernel: Callable, g: _Geometry, *, name: str, grid: int, inputs: dict,
            aliased: dict, fresh: dict, views: dict, groups: int, interpret: bool,
            poison: int | None) -> dict:
  """One ``pallas_call``; the kernel gets one dict of refs.

  inputs:  {name: array} read only; ``group`` ([1] int32, the layer group) among them
  aliased: {name: array} updated in place (read and written through the output ref)
  fresh:   {name: ShapeDtypeStruct} new outputs; with ``poison`` (a testing aid) they
           are created filled with it and updated in place instead
  views:   {name: elements per group} of the stacked metadata arrays (``groups`` of
           them): the kernel sees the group's part of each (``_View``)
  returns {name: array} of the aliased and fresh outputs
  """
  if poison is not None:
    aliased = {**aliased, **{k: jnp.full(v.shape, poison, v.dtype) for k, v in fresh.items()}}
    fresh = {}
  in_names = [*inputs, *aliased]
  out_names = [*aliased, *fresh]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in aliased.values()]
  out_shape += list(fresh.values())

  def body(*refs):
    d = dict(zip(list(inputs), refs[:len(inputs)]))
    d.update(zip(out_names, refs[len(in_names):]))
    # A traced group is clipped to the stack: the kernels never address outside it.
    group = jnp.clip(_get(d["group"], 0), 0, groups - 1)
    for n, size in views.items():
      if n in d:
        d[n] = _View(d[n], group * size, size)
    kernel(d, g, interpret)

  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  outs = pl.pallas_call(
      body,
      out_shape=out_shape,
      grid=(max(grid, 1),),
      in_specs=[any_spec] * len(in_names),
      out_specs=[any_spec] * len(out_names),
      input_output_aliases={len(inputs) + i: i for i in range(len(aliased))},
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=g.config.num_warps, num_stages=1),
      name=name,
  )(*inputs.values(), *aliased.values())
  return dict(zip(out_names, outs))


def _flat_levels(bm: tuple, name: str, first: int = 0) -> dict:
  """Bitmap levels as flat refs named ``{name}{t}`` (stacked levels [G, (R,) W] -> [G *
  (R *) W])."""
  return {f"{name}{t}": bm[t].reshape(-1) for t in range(first, len(bm))}


def _i32_1(x) -> jax.Array:
  return jnp.asarray(x, _I32).reshape(1)


@functools.partial(jax.jit, static_argnames=("g", "interpret", "poison"))
def _resolve(meta: GroupMeta, group, sel_addr, sel_valid, new_addr, active, *,
             g: _Geometry, interpret: bool, poison: int | None = None):
  # meta: every group's metadata, stacked ([G, ...] leaves); group: [1] int32. The
  # kernels update the group's part of each stacked array in place.
  B, M = g.B, g.M
  G = meta.table.shape[0]
  i32 = lambda shape: jax.ShapeDtypeStruct(shape, _I32)
  pb_lru = g.policy == "pb_lru"
  pst = meta.policy
  sel = {"group": group, "sel_addr": sel_addr.reshape(-1).astype(_I32),
         "sel_valid": sel_valid.reshape(-1).astype(jnp.bool_),
         "new_addr": new_addr.astype(_I32), "active": active.astype(jnp.bool_)}
  work = jnp.zeros((g.scratch_size,), _I32)
  host = _flat_levels(meta.host_free, "host")
  state = {"table": meta.table.reshape(-1), "dev_owner": meta.dev_owner.reshape(-1),
           "host_owner": meta.host_owner.reshape(-1), **host}
  pol = {}
  if pb_lru:
    pol = {**_flat_levels(pst.free, "free"), **_flat_levels(pst.cold, "cold"),
           **_flat_levels(pst.ring, "ring")}
    state.update(pol, cur=pst.cur.reshape(-1))
  else:
    state.update(stamp=pst.stamp.reshape(-1), clock=pst.clock.reshape(-1))
  views = {n: x.shape[0] // G for n, x in state.items()}
  launch = functools.partial(_launch, g=g, views=views, groups=G, interpret=interpret,
                             poison=poison)
  n_sel, n_new = g.elem_programs(g.config.block_elems)

  if pb_lru and g.config.fuse:
    ins = dict(sel)
    upd = {"table": state["table"], "dev_owner": state["dev_owner"],
           "host_owner": state["host_owner"], "work": work, **host, **pol,
           "cur": state["cur"]}
    new = {"roles": i32((M,)), "place_list": i32((M,)), "cur1": i32((1,)),
           **{n: i32((M,)) for n in ("fetch_src", "fetch_dst", "evict_src", "evict_dst")},
           "slots": i32((g.BK,)), "new_slot": i32((B,)),
           **{n: i32((1,)) for n in ("hits", "misses", "n_fetch", "n_evict")}}
    o4 = launch(_fused_kernel, name="ula_resolve_fused", grid=g.programs, inputs=ins,
                aliased=upd, fresh=new)
    return _outputs(g, meta, o4, o4)

  # 1. mark
  ins = {**sel, "table": state["table"]}
  upd = {"host_owner": state["host_owner"], "work": work}
  new = {"roles": i32((M,)), "place_list": i32((M,))}
  if not pb_lru:
    ins["clock"] = state["clock"]
    upd["stamp"] = state["stamp"]
    new["clock1"] = i32((1,))
  o1 = launch(_mark_kernel, name="ula_resolve_mark", grid=n_sel + n_new, inputs=ins,
              aliased=upd, fresh=new)

  # 2. round
  upd = {"work": o1["work"], "host0": host["host0"],
         **{f"host{t}": host[f"host{t}"] for t in range(3, g.host.top + 1)}}
  ins, new = {"group": group}, {}
  if pb_lru:
    ins["cur"] = state["cur"]
    upd.update({f"{n}{t}": pol[f"{n}{t}"] for n in ("free", "cold", "ring")
                for t in (0, *range(3, g.pol.top + 1))})
    new["cur1"] = i32((1,))
  o2 = launch(_round_kernel, name="ula_resolve_round", grid=g.round_programs, inputs=ins,
              aliased=upd, fresh=new)
  host.update({n: o2[n] for n in host if n in o2})
  pol.update({n: o2[n] for n in pol if n in o2})

  # 3. place (exact LRU: its pick, a ranking of every slot, runs in XLA first)
  ins = {"group": group, "sel_addr": sel["sel_addr"], "new_addr": sel["new_addr"],
         "roles": o1["roles"], "place_list": o1["place_list"], "host0": host["host0"]}
  upd = {"table": state["table"], "dev_owner": state["dev_owner"],
         "host_owner": o1["host_owner"], "work": o2["work"]}
  if pb_lru:
    ins.update({"cur1": o2["cur1"], "free0": pol["free0"], "cold0": pol["cold0"],
                "ring0": pol["ring0"]})
  else:
    clock1 = o1["clock1"]
    n_place = o2["work"][_N_LISTED]
    stamp = o1["stamp"].reshape(G, -1)[group[0]]
    cand, ok, was_free = Lru(g.Sd).pick(LruState(stamp=stamp, clock=clock1[0]), n_place, M)
    ins.update({"cand": cand, "cand_ok": ok, "cand_free": was_free, "clock1": clock1,
                "lru_counts": jnp.stack([jnp.sum(was_free), jnp.sum(ok)]).astype(_I32)})
    upd["stamp"] = o1["stamp"]
  new = {n: i32((M,)) for n in ("fetch_src", "fetch_dst", "evict_src", "evict_dst")}
  o3 = launch(_place_kernel, name="ula_resolve_place", grid=_cdiv(M, g.config.block_place),
              inputs=ins, aliased=upd, fresh=new)

  # 4. publish
  ins = {**sel, "table": o3["table"], "work": o3["work"]}
  upd = {n: o3[n] for n in ("fetch_src", "fetch_dst", "evict_src", "evict_dst")}
  upd.update(host)
  if pb_lru:
    ins["cur1"] = o2["cur1"]
    upd.update(pol, cur=state["cur"])
  else:
    ins["clock1"] = o1["clock1"]
    upd["clock"] = state["clock"]
  new = {"slots": i32((g.BK,)), "new_slot": i32((B,)),
         **{n: i32((1,)) for n in ("hits", "misses", "n_fetch", "n_evict")}}
  o4 = launch(_publish_kernel, name="ula_resolve_publish", grid=g.publish_programs,
              inputs=ins, aliased=upd, fresh=new)

  return _outputs(g, meta, o3, o4)


def _outputs(g: _Geometry, meta: GroupMeta, o3: dict, o4: dict):
  """``resolve_meta``'s results from the place and publish launches' outputs, the
  metadata stacked like ``meta``."""
  B, k, pb_lru = g.B, g.k, g.policy == "pb_lru"
  like = lambda x, old: x.reshape(old.shape)
  host_free = tuple(like(o4[f"host{t}"], meta.host_free[t]) for t in range(g.host.top + 1))
  pst = meta.policy
  if pb_lru:
    policy = PbLruState(
        free=tuple(like(o4[f"free{t}"], pst.free[t]) for t in range(g.pol.top + 1)),
        cold=tuple(like(o4[f"cold{t}"], pst.cold[t]) for t in range(g.pol.top + 1)),
        ring=tuple(like(o4[f"ring{t}"], pst.ring[t]) for t in range(g.pol.top + 1)),
        cur=like(o4["cur"], pst.cur))
  else:
    policy = LruState(stamp=like(o3["stamp"], pst.stamp), clock=like(o4["clock"], pst.clock))
  meta = GroupMeta(table=like(o3["table"], meta.table),
                   dev_owner=like(o3["dev_owner"], meta.dev_owner),
                   host_owner=like(o3["host_owner"], meta.host_owner),
                   host_free=host_free, policy=policy)
  n_evict = o4["n_evict"].reshape(())
  plan = UlaPlan(fetch_src=o4["fetch_src"], fetch_dst=o4["fetch_dst"],
                 evict_src=o4["evict_src"], evict_dst=o4["evict_dst"],
                 n_fetch=o4["n_fetch"].reshape(()), n_evict=n_evict)
  stats = {"hits": o4["hits"].reshape(()), "misses": o4["misses"].reshape(()),
           "evictions": n_evict}
  return meta, o4["slots"].reshape(B, k), o4["new_slot"], plan, stats


def stack_indexable(meta: GroupMeta) -> bool:
  """Whether the kernels can take ``meta``'s stacked arrays whole: they index them with
  int32, so every array must hold fewer than 2^31 elements."""
  return all(x.size < 2**31 for x in jax.tree.leaves(meta))


def resolve_group_pallas(system: Any, meta: GroupMeta, sel_addr: jax.Array,
                         sel_valid: jax.Array, new_addr: jax.Array, active: jax.Array, *,
                         config: ResolveConfig | None = None,
                         interpret: bool | None = None, programs: int | None = None,
                         poison: int | None = None, group: Any = None):
  """``system.resolve_meta`` as Pallas kernels (see the module doc); same signature.

  system: a ``ula.Ula`` (its sizes and policy are static); meta: its ``GroupMeta`` for
  one layer group (local arrays; donate them to update in place), or with ``group``
  set, every group's (``[G, ...]`` leaves, ``UlaState.meta``'s local arrays): the
  kernels then read and write group ``group``'s part of the stacked arrays in place
  (no slice out and no copy back), and the metadata returned is stacked likewise
  group: None, or the layer group to resolve (int in [0, G), or a traced int32 scalar,
  clipped to [0, G))
  sel_addr: [B, k] int32; sel_valid: [B, k] bool; new_addr: [B] int32; active: [B] bool
  config: tuning (``ResolveConfig``); interpret: Pallas interpret mode (None: on
  everywhere but on GPU)
  programs: persistent programs of the fused launch (None: ``fused_programs``' choice,
  what ``kernels.resolve`` runs); for lowering without the GPU, and for tests of the
  grid barriers at other counts
  poison: testing aid: when set, every array the kernels create is first filled with
  this value, so an element a kernel fails to write shows up
  returns (meta, slots [B, k] int32, new_slot [B] int32, plan, stats), identical to
  ``system.resolve_meta``
  """
  config = config or ResolveConfig()
  if interpret is None:
    interpret = default_interpret()
  policy = system.policy_name
  if policy not in POLICIES:
    raise ValueError(f"memory.policy={policy!r}: the Pallas resolve supports {list(POLICIES)}")
  if sel_addr.ndim != 2 or sel_valid.shape != sel_addr.shape:
    raise ValueError(f"sel_addr.shape={tuple(sel_addr.shape)}, sel_valid.shape="
                     f"{tuple(sel_valid.shape)}: expected the same [B, k]")
  B, k = sel_addr.shape
  if B < 1 or k < 1:
    raise ValueError(f"sel_addr.shape={tuple(sel_addr.shape)}: the Pallas resolve needs "
                     "B >= 1 and k >= 1")
  if new_addr.shape != (B,) or active.shape != (B,):
    raise ValueError(f"new_addr.shape={tuple(new_addr.shape)}, active.shape="
                     f"{tuple(active.shape)}: expected [B] = [{B}]")
  if poison is not None and (isinstance(poison, bool) or not isinstance(poison, int)):
    raise ValueError(f"poison={poison!r}: expected None or an int32 value")
  fused = policy == "pb_lru" and config.fuse
  g = _Geometry.build(B=B, k=k, N=system.num_logical, Sd=system.device_slots,
                      Hr=system.host_rows, R=system.buckets if policy == "pb_lru" else 1,
                      policy=policy, config=config,
                      programs=fused_programs(config, interpret, programs) if fused else 1)
  if group is None:  # one group's metadata: a stack of one
    meta = jax.tree.map(lambda x: x[None], meta)
  elif not stack_indexable(meta):
    raise ValueError(f"meta: a stacked array of {max(x.size for x in jax.tree.leaves(meta))}"
                     " elements: the kernels index the stacked arrays with int32; pass "
                     "one group's metadata (group=None)")
  G = meta.table.shape[0]
  if isinstance(group, (int, np.integer)) and not 0 <= group < G:
    raise ValueError(f"group={group}: expected a group of the stacked metadata, 0 <= group "
                     f"< {G}")
  at = _i32_1(0 if group is None else group)
  meta, *rest = _resolve(meta, at, sel_addr, sel_valid, new_addr, active, g=g,
                         interpret=interpret, poison=poison)
  if group is None:
    meta = jax.tree.map(lambda x: x[0], meta)
  return (meta, *rest)


def resolve_group_pallas_fused(system: Any, meta: GroupMeta, sel_addr: jax.Array,
                               sel_valid: jax.Array, new_addr: jax.Array, active: jax.Array,
                               *, config: ResolveConfig | None = None,
                               interpret: bool | None = None, programs: int | None = None,
                               poison: int | None = None, group: Any = None):
  """``resolve_group_pallas`` with ``config.fuse`` set (``FUSED_CONFIG`` when None):
  PB-LRU's resolve in one launch (``kernels.resolve=pallas_fused``)."""
  config = dataclasses.replace(config or FUSED_CONFIG, fuse=True)
  return resolve_group_pallas(system, meta, sel_addr, sel_valid, new_addr, active,
                              config=config, interpret=interpret, programs=programs,
                              poison=poison, group=group)
