"""Sparse MLA decode attention as a Pallas Mosaic GPU kernel (Hopper).

Same contract as ``reference.sparse_mla_attention_reference`` for 64 heads and
576-wide rows (512 latent + 64 rope), bf16 queries and pool. One program per (request,
k split). Hopper's tensor memory accelerator has no row gather, so the split's selected
rows are gathered by 16-byte ``cp.async`` copies (from ``plgpu.inline_mgpu``) straight
into the tensor cores' swizzled layout, a tile of rows at a time, into a ring of
shared-memory tiles next to the queries. Two warpgroups each compute a tile's scores
for all 64 heads (``wgmma``, queries and rows in shared memory), the online softmax in
float32 (base 2) and half of the 512 output columns (``wgmma`` with the probabilities in
registers). Two launch forms (``MosaicAttentionConfig.producer``):

- two warpgroups (the default): both issue their halves of the copies of tile
  ``t + stages - 1`` at the start of step ``t``, in a loop over rounds of the ring's
  ``stages`` tiles (64-row tiles in two stages, or 32-row tiles in four);
- three: a producer warpgroup issues every copy and signals each tile when it landed;
  the two consumers raise their registers with ``setmaxnreg`` to what the producer
  gives up.

Measured on an H200 (``RESULTS.md``) both are exact and slower than the Triton kernel:
the copies do not overlap the arithmetic. In the two-warpgroup form the time is the
same whether or not a step waits for its copies to land, so issuing them is what stalls
the warps that then compute; with a producer its single warpgroup issues them at half
the rate, and the consumers compile to 168 registers with spills. The arithmetic alone
takes twice the Triton kernel's for the same tensor-core instructions. Each program
writes its split's normalised output and log-sum-exp; ``pallas.merge_splits_pallas``
merges splits.

GPU only (sm_90a): Mosaic GPU's interpret mode has no transposed shared-memory operand,
register operand or layout cast, and the copies are inline Mosaic GPU code. On other
machines ``lower_for_cuda`` checks that it lowers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_LOG2E = math.log2(math.e)
HEADS, LATENT, ROPE = 64, 512, 64
WIDTH = LATENT + ROPE  # 576 bf16 per row: 72 chunks of 16 bytes, 9 swizzle columns of 64
_CHUNKS = WIDTH * 2 // 16
_WG = 128  # threads per warpgroup
_LAUNCH_REGISTERS = 65536 // (3 * _WG) // 8 * 8  # per thread at launch: 168


BLOCK_K = 64  # rows per ring tile (the output matmul's K: a multiple of the swizzle's 64)
STAGES = 2  # ring tiles: two 72-KB tiles and the 72-KB queries fill a block's 227 KB
MAX_SPLIT_ROWS = 1024  # without a producer: a split's slot list in shared memory (4 KB)


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
  """Launch of the Mosaic GPU sparse attention (static and hashable).

  num_splits: programs per request along k (None: 2 below 128 requests, else 1 -- an
              H200 has 132 SMs and a program takes one)
  consumer_registers: with a producer, registers per thread of each consumer
              warpgroup after its ``setmaxnreg`` (a multiple of 8, 168-232); the
              producer lowers its own to what is left of the launch's
              (``producer_registers``)
  producer:   False (default): two warpgroups (255 registers each) that issue the
              copies themselves, ``stages - 1`` tiles ahead, at the start of each step;
              True: a third, producer warpgroup gathers the tiles (the faster form on
              an H200 is the default: ``RESULTS.md``)
  block_k:    rows per ring tile: 64 (two stages, the 128-byte swizzle) or, without a
              producer, 32 (four stages, the 64-byte swizzle: the output matmul's K of
              32 is a multiple of its 32 columns)
  """

  num_splits: int | None = None
  consumer_registers: int = 232
  producer: bool = False
  block_k: int = 64

  def __post_init__(self):
    if self.num_splits is not None and (isinstance(self.num_splits, bool)
                                        or not isinstance(self.num_splits, int)
                                        or self.num_splits < 1):
      raise ValueError(f"MosaicAttentionConfig.num_splits={self.num_splits!r}: expected "
                       "None or a positive integer")
    if not isinstance(self.producer, bool):
      raise ValueError(f"MosaicAttentionConfig.producer={self.producer!r}: expected true "
                       "or false")
    if self.block_k not in (32, 64) or (self.block_k == 32 and self.producer):
      raise ValueError(f"MosaicAttentionConfig.block_k={self.block_k!r}: expected 64, or "
                       "32 without a producer (producer=False)")
    r = self.consumer_registers
    if isinstance(r, bool) or not isinstance(r, int) or r % 8 or not 168 <= r <= 232:
      raise ValueError(f"MosaicAttentionConfig.consumer_registers={r!r}: expected a "
                       "multiple of 8 in [168, 232] (the producer keeps at least 40)")

  def producer_registers(self) -> int:
    """What the consumers leave of the registers the launch gives the program: its 384
    threads start with 168 each (64K / 384, rounded down to a multiple of 8), and a
    ``setmaxnreg`` increase waits until that many are free -- asking for more than the
    producer releases deadlocks."""
    pool = _LAUNCH_REGISTERS * 3 * _WG
    return (pool - 2 * _WG * self.consumer_registers) // _WG // 8 * 8

  def ring(self) -> tuple[int, int, int]:
    """(rows per tile, stages, swizzle bytes): each ring holds 144 KB."""
    return (64, 2, 128) if self.block_k == 64 else (32, 4, 64)

  def splits(self, B: int) -> int:
    return self.num_splits or (2 if B < 128 else 1)


def smem_bytes(config: MosaicAttentionConfig | None = None) -> int:
  """Shared memory of one program at most: queries, the ring (144 KB in every form),
  small buffers and, without a producer, the split's slot list (the output staging
  reuses the queries' and ring's memory)."""
  config = config or MosaicAttentionConfig()
  slot_list = 2 * BLOCK_K * 4 if config.producer else MAX_SPLIT_ROWS * 4
  return (HEADS + STAGES * BLOCK_K) * WIDTH * 2 + 2048 + slot_list


def _gather_tile(stage: int, ring_offset: int, *, threads: int = _WG,
                 block_k: int = BLOCK_K, swizzle: int = 128, commit: bool = True):
  """Inline Mosaic GPU code: this thread's share of one tile's ``block_k`` rows (their
  pool rows listed in ``slots``, shared memory: [block_k] int32) into ring stage
  ``stage`` (``ring``: the shared memory holding the ring ``ring_offset`` bytes in), as
  16-byte ``cp.async`` copies, closing their commit group unless ``commit`` is False
  (then ``_commit_group`` closes it); the tile is shared by ``threads``
  threads (one warpgroup, or two). The ring is in (8, swizzle / 2) bf16 tiles with the
  ``swizzle``-byte swizzle (128 or 64)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
  from jax.experimental.mosaic.gpu import utils as mu

  per_row = swizzle // 16  # 16-byte chunks in a tile row
  tiles_per_row = WIDTH * 2 // swizzle

  def body(ctx, pool, slots, ring):
    del ctx
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    i8, index = ir.IntegerType.get_signless(8), ir.IndexType.get()
    c = lambda v: arith.constant(i32, v)
    tid = arith.remui(mu.thread_idx(), c(threads))
    gbase = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(pool))
    sbase = mu.memref_ptr(ring)
    base = ring_offset + stage * block_k * WIDTH * 2
    for it in range(block_k * _CHUNKS // threads):
      h = arith.addi(c(it * threads), tid)
      row, e = arith.divui(h, c(_CHUNKS)), arith.remui(h, c(_CHUNKS))
      r8, j = arith.remui(row, c(8)), arith.remui(e, c(per_row))
      slot = memref.load(slots, [arith.index_cast(index, row)])
      # Row-major source; destination in (8, swizzle / 2) tiles: the swizzle moves the
      # 16-byte chunk j of tile row r8 to chunk j ^ ((r8 * swizzle / 128) % per_row).
      group = arith.remui(arith.divui(arith.muli(r8, c(swizzle)), c(128)), c(per_row))
      tile_idx = arith.addi(arith.muli(arith.divui(row, c(8)), c(tiles_per_row)),
                            arith.divui(e, c(per_row)))
      soff = arith.addi(
          c(base),
          arith.addi(arith.muli(tile_idx, c(8 * swizzle)),
                     arith.addi(arith.muli(r8, c(swizzle)),
                                arith.muli(arith.xori(j, group), c(16)))))
      goff = arith.addi(arith.muli(arith.extui(i64, slot), arith.constant(i64, WIDTH * 2)),
                        arith.extui(i64, arith.muli(e, c(16))))
      nvvm.cp_async_shared_global(mu.getelementptr(sbase, [soff], i8),
                                  mu.getelementptr(gbase, [goff], i8), 16,
                                  nvvm.LoadCacheModifierKind.CG)
    if commit:
      nvvm.cp_async_commit_group()
    return None

  return body


def _commit_group():
  """Inline Mosaic GPU code: close this thread's copy group (empty if it issued none)."""
  from jax._src.lib.mlir.dialects import nvvm

  def body(ctx):
    del ctx
    nvvm.cp_async_commit_group()
    return None

  return body


def _wait_groups(pending: int):
  """Inline Mosaic GPU code: wait until this thread has at most ``pending`` commit
  groups of copies in flight."""
  from jax._src.lib.mlir.dialects import nvvm

  def body(ctx):
    del ctx
    nvvm.cp_async_wait_group(pending)
    return None

  return body


def _softmax_init():
  """A consumer's running max and sum per head and its 64 x 256 output accumulator."""
  rows = plgpu.Layout.WGMMA.reduce(1)
  return (plgpu.layout_cast(jnp.full((HEADS,), -jnp.inf, jnp.float32), rows),
          plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), rows),
          plgpu.layout_cast(jnp.zeros((HEADS, LATENT // 2), jnp.float32),
                            plgpu.Layout.WGMMA))


def _scores(q_smem, stage, block_k: int):
  """Scores of all 64 heads over the ``block_k`` rows in ring ``stage`` (float32,
  ``wgmma`` with both operands in shared memory)."""

  def scores(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(stage, (1, 0)))
    return acc_ref[...]

  return pl.run_scoped(scores, plgpu.ACC((HEADS, block_k), jnp.float32))


def _softmax_update(sc, m, l, acc):
  """The online softmax (base 2) over one tile's scaled scores: -> (the new running max,
  the new running sum, the rescaled accumulator, the probabilities)."""
  m_new = jnp.maximum(m, sc.max(axis=1))
  # While a head has seen nothing valid, m is -inf: shift by 0 so exp2() gives 0.
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_safe)
  p = jnp.exp2(sc - jax.lax.broadcast_in_dim(m_safe, sc.shape, [0]))
  l = l * alpha + p.sum(axis=1)
  return m_new, l, acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]), p


def _outputs(p, stage, w: int, acc):
  """``acc`` plus the probabilities ``p`` times output columns ``[256 w, 256 w + 256)``
  of the rows in ring ``stage`` (``wgmma``, ``p`` in registers as bf16)."""
  p16 = p.astype(jnp.bfloat16)

  def outputs(acc_ref):
    plgpu.wgmma(acc_ref, p16, stage.at[:, pl.ds(w * (LATENT // 2), LATENT // 2)])

  return pl.run_state(outputs)(plgpu.ACC.init(acc))


def _tile_step(q_smem, stage, bits_smem, t, w: int, scale2: float, m, l, acc,
               block_k: int = BLOCK_K):
  """One consumer's work on tile ``t`` (``block_k`` rows) in ring ``stage``: the scores
  of all 64 heads, masked by the tile's validity bits, the online softmax (base 2) and
  output columns ``[256 w, 256 w + 256)``. -> the new (m, l, acc)."""
  sc = _scores(q_smem, stage, block_k)
  col = plgpu.broadcasted_iota(jnp.int32, (HEADS, block_k), 1, layout=plgpu.Layout.WGMMA)
  if block_k == 64:
    word = jnp.where(col < 32, bits_smem[2 * t], bits_smem[2 * t + 1])
  else:
    word = bits_smem[t]
  ok = jnp.bitwise_and(jnp.right_shift(word, jnp.bitwise_and(col, 31)), 1) != 0
  m, l, acc, p = _softmax_update(jnp.where(ok, sc * scale2, -jnp.inf), m, l, acc)
  return m, l, _outputs(p, stage, w, acc)


def _write_out(o_stage, lse_smem, o_gmem, lse_gmem, w: int, m, l, acc) -> None:
  """Consumer ``w``'s normalised output columns (and, from consumer 0, the log-sum-exp)
  through shared memory no longer read by anyone to the split's outputs."""
  l_ok = l > 0
  l_safe = jnp.where(l_ok, l, 1.0)
  o_stage.at[w][...] = acc / jax.lax.broadcast_in_dim(l_safe, acc.shape, [0])
  if w == 0:
    lse_smem[...] = jnp.where(l_ok, m / _LOG2E + jnp.log(l_safe), -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_stage.at[w], o_gmem.at[:, pl.ds(w * (LATENT // 2), LATENT // 2)])
  if w == 0:
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
  plgpu.wait_smem_to_gmem(0)


def _program(union):
  """A program's shared memory and ids: (queries, ring, output staging, the shared
  memory holding the ring, the ring's byte offset in it, (request, split, warpgroup))."""
  (q_smem, ring), o_stage = union
  aliased = [t for t in ring.transforms if type(t).__name__ == "ExtractAliasedRef"]
  if len(aliased) != 1:
    raise NotImplementedError(f"the ring's shared memory view {ring.transforms}: expected "
                              "one ExtractAliasedRef (this jax's Mosaic GPU differs)")
  ids = tuple(jax.lax.axis_index(n) for n in ("b", "split", "wg"))
  return q_smem, ring, o_stage, ring.ref, aliased[0].offset, ids


def _kernel(q_ref, pool_ref, slots_ref, bits_ref, o_ref, lse_ref, union, slots0, slots1,
            bits_smem, lse_smem, in_bar, slot_bar, full, empty, done, *, tiles: int,
            scale2: float, ablation: str | None, registers: tuple[int, int]):
  # Tiles are processed in pairs, the first of a pair in ring stage 0 and the second in
  # stage 1, so that every stage, barrier and buffer index below is static.
  q_smem, ring, o_stage, ring_raw, ring_offset, (b, sp, wg) = _program(union)
  slots_s, ref_t, pairs = (slots0, slots1), plgpu.RefType(), tiles // 2

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(registers[1], action="decrease")
    plgpu.copy_gmem_to_smem(bits_ref.at[b, sp], bits_smem, in_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, in_bar)
    for s in range(2):
      plgpu.copy_gmem_to_smem(slots_ref.at[b, sp, s], slots_s[s], slot_bar.at[s])

    def pair(jj, carry):
      for s in range(2):
        t = 2 * jj + s

        @pl.when(jj > 0)
        def _():
          plgpu.barrier_wait(empty.at[s])  # the consumers are done with tile t - 2

        plgpu.barrier_wait(slot_bar.at[s])
        gather = lambda: plgpu.inline_mgpu(arg_types=(ref_t,) * 3)(
            _gather_tile(s, ring_offset))(pool_ref, slots_s[s], ring_raw)
        if ablation == "compute":  # the first two tiles only, reused by every step
          pl.when(jj == 0)(gather)
        else:
          gather()
        plgpu.commit_smem()  # every thread has read the slot list (and orders the copies)

        @pl.when(t + 2 < tiles)
        def _():
          plgpu.copy_gmem_to_smem(slots_ref.at[b, sp, t + 2], slots_s[s], slot_bar.at[s])

        def hand_over():  # tile t - 1 has landed: hand it to the consumers
          plgpu.inline_mgpu()(_wait_groups(1))()
          plgpu.commit_smem()
          plgpu.barrier_arrive(full.at[1 - s])

        if s == 1:
          hand_over()
        else:
          pl.when(jj > 0)(hand_over)
      return carry

    jax.lax.fori_loop(0, pairs, pair, 0)
    plgpu.inline_mgpu()(_wait_groups(0))()
    plgpu.commit_smem()
    plgpu.barrier_arrive(full.at[1])

  def consumer(w: int):
    plgpu.set_max_registers(registers[0], action="increase")
    plgpu.barrier_wait(in_bar)

    def pair(jj, carry):
      m, l, acc = carry
      for s in range(2):
        t = 2 * jj + s
        plgpu.barrier_wait(full.at[s])
        stage = ring.at[s]
        if ablation == "gather":  # the tile is not read
          plgpu.barrier_arrive(empty.at[s])
          continue

        m, l, acc = _tile_step(q_smem, stage, bits_smem, t, w, scale2, m, l, acc)
        plgpu.barrier_arrive(empty.at[s])
      return m, l, acc

    m, l, acc = jax.lax.fori_loop(0, pairs, pair, _softmax_init())
    # Both consumers are done with the queries and the ring: their memory stages the
    # outputs.
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)
    _write_out(o_stage, lse_smem, o_ref.at[b, sp], lse_ref.at[b, sp], w, m, l, acc)

  pl.when(wg == 0)(lambda: consumer(0))
  pl.when(wg == 1)(lambda: consumer(1))


def _kernel_two(q_ref, pool_ref, slots_ref, bits_ref, o_ref, lse_ref, union, slots,
                bits_smem, lse_smem, in_bar, slot_bar, step_bar, *, tiles: int,
                stages: int, block_k: int, swizzle: int, scale2: float,
                ablation: str | None):
  # Two warpgroups and no producer. A loop over rounds of ``stages`` tiles, step s of a
  # round in ring stage s (every stage static): at the start of step t both issue their
  # halves of tile t + stages - 1's copies into the stage tile t - 1 left, compute tile
  # t, then wait until tile t + 1 has landed and meet at a barrier (so tile t is no
  # longer read either). Every step commits one copy group, empty past the last tile, so
  # the groups left in flight are the same at every step. (With every step unrolled the
  # kernel was ~400 KB of instructions with 2.4 times the spills, and slower: RESULTS.md.)
  q_smem, ring, o_stage, ring_raw, ring_offset, (b, sp, wg) = _program(union)
  ref_t = plgpu.RefType()

  def copies(t, stage: int):
    plgpu.inline_mgpu(arg_types=(ref_t,) * 3)(_gather_tile(
        stage, ring_offset, threads=2 * _WG, block_k=block_k, swizzle=swizzle,
        commit=False))(pool_ref, slots.at[t], ring_raw)

  def commit():
    plgpu.inline_mgpu()(_commit_group())()

  def land(pending: int):  # this warpgroup's copies but ``pending`` groups landed; meet
    plgpu.inline_mgpu()(_wait_groups(pending))()
    plgpu.commit_smem()
    plgpu.barrier_arrive(step_bar)
    plgpu.barrier_wait(step_bar)

  def body(w: int):
    if w == 0:  # one warpgroup issues the bulk copies (one arrival each)
      plgpu.copy_gmem_to_smem(bits_ref.at[b, sp], bits_smem, in_bar)
      plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, in_bar)
      plgpu.copy_gmem_to_smem(slots_ref.at[b, sp], slots, slot_bar)
    plgpu.barrier_wait(slot_bar)
    for t in range(stages - 1):  # tiles is a multiple of stages
      copies(t, t)
      commit()
    land(stages - 2)  # tile 0
    plgpu.barrier_wait(in_bar)

    def round_(r, carry):
      m, l, acc = carry
      for s in range(stages):
        t = r * stages + s
        nxt = t + stages - 1
        issue = nxt < tiles
        if ablation == "compute":  # the first tiles only, reused
          issue = jnp.logical_and(issue, nxt < stages)
        pl.when(issue)(lambda: copies(nxt, (s + stages - 1) % stages))
        commit()
        if ablation != "gather":
          m, l, acc = _tile_step(q_smem, ring.at[s], bits_smem, t, w, scale2, m, l, acc,
                                 block_k)
        land(stages - 2)  # tile t + 1 (past the end: nothing in flight but empty groups)
      return m, l, acc

    m, l, acc = jax.lax.fori_loop(0, tiles // stages, round_, _softmax_init())
    land(0)  # both done reading before the output staging reuses the memory
    _write_out(o_stage, lse_smem, o_ref.at[b, sp], lse_ref.at[b, sp], w, m, l, acc)

  pl.when(wg == 0)(lambda: body(0))
  pl.when(wg == 1)(lambda: body(1))


def sparse_mla_attention_mosaic(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                                slots: jax.Array, valid: jax.Array, *, scale: float,
                                config: MosaicAttentionConfig | None = None,
                                merge: bool = True, ablation: str | None = None):
  """Attention of every head over the selected pool rows (Mosaic GPU, sm_90a).

  q_lat: [B, 64, 512], q_rope: [B, 64, 64] queries (cast to bf16); pool: [S, 576] bf16;
  slots: [B, k] int32 (ignored where not valid; clamped into [0, S)); valid: [B, k]
  bool; scale: softmax scale. returns o_lat: [B, 64, 512] float32; ``merge=False``:
  the splits' normalised outputs [B, NS, 64, 512] and log-sum-exps [B, NS, 64].
  ablation: for benchmarks only, as in ``sparse_mla_attention_pallas`` (the output is
  not attention): 'compute' gathers each split's first round of the ring only (two tiles,
  four with ``block_k=32``) and computes on them at every step, 'gather' gathers every
  tile and computes nothing (zeros).
  """
  from ula_jax.kernels.sparse_attention.pallas import ABLATIONS, merge_splits_pallas

  config = config or MosaicAttentionConfig()
  if ablation not in (None, *ABLATIONS):
    raise ValueError(f"ablation={ablation!r}: expected None or one of {list(ABLATIONS)}")
  B, H, Dl = q_lat.shape
  Dr = q_rope.shape[-1]
  if (H, Dl, Dr) != (HEADS, LATENT, ROPE) or pool.shape[-1] != WIDTH:
    raise ValueError(f"q_lat {tuple(q_lat.shape)}, q_rope {tuple(q_rope.shape)}, pool "
                     f"{tuple(pool.shape)}: the Mosaic kernel takes {HEADS} heads of "
                     f"{LATENT} + {ROPE} columns (use the Pallas Triton kernel otherwise)")
  if pool.dtype != jnp.bfloat16:
    raise ValueError(f"pool.dtype={pool.dtype}: the Mosaic kernel takes bfloat16 pools")
  S, k = pool.shape[0], slots.shape[1]
  bk, stages, swizzle = config.ring()
  splits = config.splits(B)
  if not config.producer:  # the split's whole slot list sits in shared memory
    splits = max(splits, -(-k // MAX_SPLIT_ROWS))
  tiles = stages * -(-k // (stages * bk * splits))  # per split, whole rounds of the ring
  kp = tiles * bk * splits
  pad = ((0, 0), (0, kp - k))
  slots = jnp.pad(jnp.where(valid, jnp.clip(slots, 0, S - 1), 0).astype(jnp.int32), pad)
  valid = jnp.pad(valid, pad)
  # Validity as bits, 32 entries per int32 word (bit i of word w: entry 32 w + i).
  shifts = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
  bits = jnp.sum(jnp.where(valid.reshape(B, kp // 32, 32), shifts, jnp.uint32(0)),
                 axis=-1, dtype=jnp.uint32)
  words = kp // 32 // splits
  wpad = -(-words // 32) * 32  # copies move multiples of 128 bytes
  bits = jax.lax.bitcast_convert_type(bits, jnp.int32).reshape(B, splits, words)
  bits = jnp.pad(bits, ((0, 0), (0, 0), (0, wpad - words)))
  slots = slots.reshape(B, splits, tiles, bk)
  q = jnp.concatenate([q_lat, q_rope], axis=-1).astype(jnp.bfloat16)

  tiled = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
  out_tiled = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  union = plgpu.RefUnion(
      (plgpu.SMEM((HEADS, WIDTH), jnp.bfloat16, transforms=tiled),
       plgpu.SMEM((stages, bk, WIDTH), jnp.bfloat16, transforms=tiled)),
      plgpu.SMEM((2, HEADS, LATENT // 2), jnp.float32, transforms=out_tiled))
  small = [plgpu.SMEM((wpad,), jnp.int32), plgpu.SMEM((HEADS,), jnp.float32),
           plgpu.Barrier(num_arrivals=2)]  # bits and queries copied in
  static = dict(tiles=tiles, scale2=float(scale) * _LOG2E, ablation=ablation)
  if config.producer:
    body = lambda *refs: _kernel(*refs, **static, registers=(
        config.consumer_registers, config.producer_registers()))
    scratch = [union, plgpu.SMEM((bk,), jnp.int32), plgpu.SMEM((bk,), jnp.int32), *small,
               plgpu.Barrier(num_arrivals=1, num_barriers=2),  # a slot list copied in
               plgpu.Barrier(num_arrivals=1, num_barriers=2),  # a ring tile landed
               plgpu.Barrier(num_arrivals=2, num_barriers=2),  # both consumers done
               plgpu.Barrier(num_arrivals=2)]  # both consumers left the loop
  else:
    body = lambda *refs: _kernel_two(*refs, **static, stages=stages, block_k=bk,
                                     swizzle=swizzle)
    scratch = [union, plgpu.SMEM((tiles, bk), jnp.int32), *small,
               plgpu.Barrier(num_arrivals=1),  # the slot list copied in
               plgpu.Barrier(num_arrivals=2)]  # the end of a step
  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, splits, HEADS, LATENT), jnp.float32),
                jax.ShapeDtypeStruct((B, splits, HEADS), jnp.float32)),
      scratch_types=scratch,
      grid=(splits, B), grid_names=("split", "b"), num_threads=3 if config.producer else 2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                           approx_math=True),
  )
  o, lse = kernel(q, pool, slots, bits)
  if not merge:
    return o, lse
  if splits == 1:
    return o[:, 0]
  return merge_splits_pallas(o, lse, interpret=False)


def lower_for_cuda(B: int = 2, k: int = 256, S: int = 512,
                   config: MosaicAttentionConfig | None = None) -> str:
  """The kernel lowered for CUDA on any machine (no GPU needed): the StableHLO text."""
  spec = jax.ShapeDtypeStruct
  f = jax.jit(lambda *a: sparse_mla_attention_mosaic(*a, scale=0.1, config=config,
                                                     merge=False))
  return f.trace(spec((B, HEADS, LATENT), jnp.bfloat16), spec((B, HEADS, ROPE), jnp.bfloat16),
                 spec((S, WIDTH), jnp.bfloat16), spec((B, k), jnp.int32),
                 spec((B, k), jnp.bool_)).lower(lowering_platforms=("cuda",)).as_text()


__all__ = ["BLOCK_K", "MosaicAttentionConfig", "STAGES", "lower_for_cuda", "smem_bytes",
           "sparse_mla_attention_mosaic"]
