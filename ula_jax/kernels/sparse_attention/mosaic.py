"""Sparse MLA decode attention as a Pallas Mosaic GPU kernel (Hopper).

Same contract as ``reference.sparse_mla_attention_reference`` for 64 heads and
576-wide rows (512 latent + 64 rope), bf16 queries and pool. One program per (request,
k split). Hopper's tensor memory accelerator has no row gather, so the split's selected
rows are gathered by 16-byte ``cp.async`` copies (from ``plgpu.inline_mgpu``) straight
into the tensor cores' swizzled layout, a tile of rows at a time, into a ring of
shared-memory tiles next to the queries. Two warpgroups each compute a tile's scores
for all 64 heads (``wgmma``, queries and rows in shared memory), the online softmax in
float32 (base 2) and half of the 512 output columns (``wgmma`` with the probabilities in
registers). Three launch forms (``MosaicAttentionConfig``):

- two warpgroups (the default): both issue their halves of the copies of tile
  ``t + stages - 1`` at the start of step ``t``, in a loop over rounds of the ring's
  ``stages`` tiles (64-row tiles in two stages, or 32-row tiles in four);
- ``producer=True``: a producer warpgroup issues every copy and signals each tile when
  it landed; the two consumers raise their registers with ``setmaxnreg`` to what the
  producer gives up;
- ``rows=True``: one TMA copy per row into row-major tiles, computed transposed with the
  rows as ``wgmma``'s register operand (the section before ``_ldmatrix_frag`` says how);
  with ``producer=True`` a third warpgroup issues the row copies (four of its warps, a
  quarter of a tile each, ``_issue_rows``).

Measured on an H200 (``RESULTS.md``) all are exact; the row form with a producer
(``FASTEST``, ``kernels.attention='mosaic'``) is the fastest: 0.42 / 0.51 / 0.53 of copy
bandwidth at batch 64 / 128 / 256, 1.3 times the Triton kernel's speed. In the
two-warpgroup form the time is the same whether
or not a step waits for its copies to land, so issuing them is what stalls the warps
that then compute; with a ``cp.async`` producer its single warpgroup issues them at half
the rate, and the consumers compile to 168 registers with spills. TMA row copies read
at 0.58-0.78 of copy bandwidth inside the kernel (1.0 in ``benchmarks/probes/gpu_row_gather.py``),
and issuing them takes a thread about as long as the copy engine takes to move them: in
the row form without a producer that held each warpgroup 35 us per call at batch 64.
What is left is arithmetic: 2-2.4 times the Triton kernel's in the ``cp.async`` forms
(with spills), 1.9 times in the row form, whose register-operand ``wgmma`` calls wait for
each operand's ``ldmatrix`` (about 62 cycles per instruction where the instruction alone
takes 20: ``benchmarks/probes/gpu_wgmma_rate.py``).
Each program writes its split's normalised output and log-sum-exp;
``pallas.merge_splits_pallas`` merges splits.

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
              warpgroup after its ``setmaxnreg`` (a multiple of 8, 168-240); the
              producer lowers its own to what is left of the launch's
              (``producer_registers``: 40 at 232, 24 at 240)
  producer:   False (default): two warpgroups (255 registers each) that issue the
              copies themselves, ``stages - 1`` tiles ahead, at the start of each step;
              True: a third, producer warpgroup gathers the tiles (of the ``cp.async``
              forms the faster on an H200 is the default; with ``rows`` the producer
              is the faster: ``RESULTS.md``)
  block_k:    rows per ring tile: 64 (two stages, the 128-byte swizzle) or, without a
              producer, 32 (four stages, the 64-byte swizzle: the output matmul's K of
              32 is a multiple of its 32 columns)
  rows:       gather each selected row with one TMA copy into a ring of row-major tiles
              and compute transposed from them (two warpgroups, 32 heads each; 64-row
              tiles; the copies issued by the two, or by a producer); False: the
              16-byte ``cp.async`` copies into the tensor cores' layout
  """

  num_splits: int | None = None
  consumer_registers: int = 232
  producer: bool = False
  block_k: int = 64
  rows: bool = False

  def __post_init__(self):
    if self.num_splits is not None and (isinstance(self.num_splits, bool)
                                        or not isinstance(self.num_splits, int)
                                        or self.num_splits < 1):
      raise ValueError(f"MosaicAttentionConfig.num_splits={self.num_splits!r}: expected "
                       "None or a positive integer")
    if not isinstance(self.producer, bool):
      raise ValueError(f"MosaicAttentionConfig.producer={self.producer!r}: expected true "
                       "or false")
    if not isinstance(self.rows, bool):
      raise ValueError(f"MosaicAttentionConfig.rows={self.rows!r}: expected true or false")
    if self.rows and self.block_k != 64:
      raise ValueError(f"MosaicAttentionConfig.rows=True takes block_k=64 (got "
                       f"block_k={self.block_k!r})")
    if self.block_k not in (32, 64) or (self.block_k == 32 and self.producer):
      raise ValueError(f"MosaicAttentionConfig.block_k={self.block_k!r}: expected 64, or "
                       "32 without a producer (producer=False)")
    r = self.consumer_registers
    if isinstance(r, bool) or not isinstance(r, int) or r % 8 or not 168 <= r <= 240:
      raise ValueError(f"MosaicAttentionConfig.consumer_registers={r!r}: expected a "
                       "multiple of 8 in [168, 240] (the producer keeps at least 24)")

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


def _bit_words(split_rows: int) -> int:
  """int32 words of a split's validity bits in shared memory (copies move multiples of
  128 bytes)."""
  return -(-(split_rows // 32) // 32) * 32


def smem_bytes(config: MosaicAttentionConfig | None = None,
               split_rows: int = MAX_SPLIT_ROWS) -> int:
  """Shared memory of one program at most: queries, the ring (144 KB in every form),
  small buffers and, in the two-warpgroup form, the split's slot list (the output
  staging reuses the queries' and ring's memory); the rows form holds both warpgroups'
  probabilities and one buffer of slot lists, maxima and the validity bits of a split
  of ``split_rows`` rows (1 KB at 1024 rows, the most without a producer) instead."""
  config = config or MosaicAttentionConfig()
  if config.rows:  # + both warpgroups' probabilities and the meta buffer
    return ((HEADS + STAGES * BLOCK_K) * WIDTH * 2 + 2 * BLOCK_K * HALF * 2
            + (_BITS + _bit_words(split_rows)) * 4)
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



# --- The TMA row form (``MosaicAttentionConfig(rows=True)``) -----------------------------
# Each selected row is one TMA copy of its 1152 bytes (the pool viewed as [S, 9, 64], a
# (9, 64) box with the 128-byte swizzle), so a ring tile holds its 64 rows one after
# another: row r's columns [64 c, 64 c + 64) are the 128-byte line 9 r + c, its 16-byte
# chunk j stored at chunk j ^ (line % 8) (the swizzle follows the shared-memory address;
# the ring starts 1024-byte aligned). ``wgmma`` cannot read such a tile from shared
# memory (it reads eight rows' pieces of one column block together), but ``ldmatrix``
# can: each lane names the row it loads, and the swizzle puts the eight rows of a load
# in eight different banks. So the tile is the register operand: warpgroup w computes
# the transposed scores of its 32 heads, S^T = K Q_w^T ([64 rows, 32 heads], nine
# ``wgmma`` of K 64 with the queries' columns in shared memory), their softmax over the
# rows, and O_w^T += V^T P_w^T ([512 columns, 32 heads], eight ``wgmma`` with V^T
# loaded by ``ldmatrix.trans`` and P_w^T written to shared memory).

ROW_LINES = WIDTH // 64  # 128-byte lines per row
HALF = HEADS // 2  # heads per warpgroup
# How the row form feeds its register operands (read when a kernel is traced; the values
# are the fastest measured on an H200, ``benchmarks/probes/gpu_mosaic_probe.py`` times the others:
# RESULTS.md):
_IN_FLIGHT = 1  # wgmma calls left in flight before the next operand is loaded (1: two live)
_VOLATILE_BASE = True  # ldmatrix addresses from the zero word (False: plain, hoistable)
_FRAG_K = 64  # columns (K) of each register operand: 64 (four ldmatrix) or 16 (one)
# The shared-memory operands' slices at offsets read from the zero word (a dynamic 0), so
# that their wgmma descriptors are computed where they are used, not hoisted out of the
# loop into registers (False: 704-840 B of spills, and slower: RESULTS.md).
_DYNAMIC_DESCRIPTORS = True
# The rows forms take the queries' latent and rope parts as given, two copies into two
# buffers (True: no concatenation before the launch, whose 9.4 MB at batch 128 took 6.7
# us, and the same kernel time), or concatenated before the launch, as the other forms
# do (False). RESULTS.md.
_QUERY_PARTS = True
# (ranges per warpgroup, folder): the kernel records its named scopes' clocks per
# warpgroup (Mosaic GPU's profiler) and writes a trace there per call; None: off.
_PROFILE: tuple[int, str] | None = None


def _ldmatrix_frag(stage: int, block: int, trans: bool, steps: tuple[int, ...] = (0, 1, 2, 3)):
  """Inline Mosaic GPU code: a [64, 16 len(steps)] bf16 ``wgmma`` register operand
  (WGMMA layout) from ring ``stage`` (the ring's memref, [2, 64, 9, 64] bf16, 1024-byte
  aligned), one ``ldmatrix`` per k16 step in ``steps``.

  trans=False: rows x columns [64 block + 16 s, 64 block + 16 s + 16) of the tile, for s
  in ``steps`` (the scores' K);
  trans=True: columns [64 block, 64 block + 64) x rows [16 s, 16 s + 16) (the outputs'
  V^T).

  Each ``ldmatrix`` address is the row-major address L with the swizzle applied to it,
  L ^ ((L >> 3) & 0x70) (its 16-byte chunk bits XOR its 128-byte line's bits 7-9), from
  a base that reads the meta buffer's zero word (a volatile load): the compiler cannot
  hoist the 68 addresses of a tile out of the loop and keep them in registers."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mu
  import numpy as np

  def body(ctx, ring, meta):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    c = lambda v: arith.constant(i32, v)
    tid = arith.remui(mu.thread_idx(), c(_WG))
    warp, lane = arith.divui(tid, c(32)), arith.remui(tid, c(32))
    q, idx = arith.divui(lane, c(8)), arith.remui(lane, c(8))  # matrix, its row
    qlo, qhi = arith.remui(q, c(2)), arith.divui(q, c(2))
    meta_ptr = llvm.ptrtoint(i32, mu.memref_ptr(meta))
    zero = (llvm.inline_asm(i32, [arith.addi(meta_ptr, c(4 * _ZERO))],
                            "ld.volatile.shared.u32 $0, [$1];", "=r,r", has_side_effects=True)
            if _VOLATILE_BASE else c(0))
    base = arith.addi(arith.addi(llvm.ptrtoint(i32, mu.memref_ptr(ring)), zero),
                      c(stage * BLOCK_K * WIDTH * 2))
    row_bytes = WIDTH * 2
    if trans:  # matrix q: columns 16 warp + 8 (q % 2) (+8), rows 16 kk + 8 (q // 2) + idx
      thread = arith.addi(arith.muli(arith.addi(arith.muli(qhi, c(8)), idx), c(row_bytes)),
                          arith.muli(arith.addi(arith.muli(warp, c(2)), qlo), c(16)))
      step = lambda kk: 16 * kk * row_bytes + 128 * block
    else:  # matrix q: rows 16 warp + 8 (q % 2) + idx, columns 64 block + 16 kk + 8 (q // 2)
      thread = arith.addi(arith.muli(arith.addi(arith.muli(warp, c(16)),
                                                arith.addi(arith.muli(qlo, c(8)), idx)),
                                     c(row_bytes)), arith.muli(qhi, c(16)))
      step = lambda kk: 128 * block + 32 * kk
    start = arith.addi(base, thread)
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    layout = fa.WGMMA_LAYOUT
    regs = np.empty(layout.registers_shape((64, 16 * len(steps))), dtype=object)
    struct = llvm.StructType.get_literal([i32] * 4)
    op = "ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") + ".shared.b16"
    for i, kk in enumerate(steps):  # k16 steps
      lin = arith.addi(start, c(step(kk)))
      addr = arith.xori(lin, arith.andi(arith.shrui(lin, c(3)), c(0x70)))
      out = llvm.inline_asm(struct, [addr], op + " {$0, $1, $2, $3}, [$4];",
                            "=r,=r,=r,=r,r", has_side_effects=False)
      for m in range(4):  # matrix m -> register (column group 2 i + m // 2, row half m % 2)
        reg = mu.bitcast(llvm.extractvalue(i32, out, [m]), bf16x2)
        regs[0, 2 * i + m // 2, 0, 0, m % 2, 0, 0, 0, 0] = reg
    return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return body


def _store_transposed(col0: int):
  """Inline Mosaic GPU code: stores x [R, C] (a WGMMA-layout or WGMMA-column-layout
  float32 array, this warpgroup's heads as its last axis) transposed into ``ref``:
  x[r, c] -> ref[col0 + c, r] (2-D), or x[c] -> ref[col0 + c] (1-D)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, vector

  def body(ctx, x, ref):
    del ctx
    index = ir.IndexType.get()
    for idx, reg in zip(x.layout.thread_idxs(x.shape), x.registers.flat):
      n = ir.VectorType(reg.type).shape[0]
      for e in range(n):
        val = vector.extract(reg, dynamic_position=[], static_position=[e])
        col = arith.addi(idx[-1], arith.constant(index, col0 + e))
        dst = [col] if len(idx) == 1 else [col, idx[0]]
        memref.store(val, ref, dst)
    return None

  return body



_MAX_KEYS = STAGES * BLOCK_K  # meta buffer: two slot lists, each warpgroup's running maxima,
_ZERO = _MAX_KEYS + HEADS  # a word kept 0 (``_ldmatrix_frag``)
_MBAR = _ZERO + 4  # with a producer, two mbarriers (8-byte aligned): ring stage s landed
_BITS = _ZERO + 32  # and the split's validity bits (a 128-byte multiple in)
_ISSUERS = 4  # with a producer, its warps that issue a tile's row copies (1, 2 or 4; 4 is
# the fastest measured: RESULTS.md)


def _ordered(i32v):
  """float32 bits <-> int32 that orders like the floats (an involution)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  i32 = ir.IntegerType.get_signless(32)
  sign = arith.shrsi(i32v, arith.constant(i32, 31))
  return arith.xori(i32v, arith.andi(sign, arith.constant(i32, 0x7FFFFFFF)))


def _warp_col_reduce(x, op):
  """This warp's column reductions of x [64, 32] (WGMMA layout, float32): registers
  [j][v] for columns 8 j + 2 (lane % 4) + v, the same in every lane of a column."""
  from jax._src.lib.mlir.dialects import vector
  from jax.experimental.mosaic.gpu import utils as mu
  regs = x.registers
  if regs.shape != (1, 4, 1, 1, 2, 1, 1, 1, 1):
    raise NotImplementedError(f"registers {regs.shape}: expected a [64, 32] WGMMA array")
  out = []
  for j in range(4):
    a = op(regs[0, j, 0, 0, 0, 0, 0, 0, 0], regs[0, j, 0, 0, 1, 0, 0, 0, 0])
    for stride in (4, 8, 16):  # lanes of the same column: lane / 4 differs
      a = op(a, mu.shfl_bfly(a, stride))
    out.append([vector.extract(a, dynamic_position=[], static_position=[v])
                for v in range(2)])
  return out


def _col_array(values):
  """A [32] WGMMA-column-layout float32 array from values[j][v]."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import vector
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  import numpy as np
  f32x2 = ir.VectorType.get((2,), ir.F32Type.get())
  regs = np.empty(fa.WGMMA_COL_LAYOUT.registers_shape((HALF,)), dtype=object)
  for j, (a, b) in enumerate(values):
    regs[j, 0, 0] = vector.from_elements(f32x2, [a, b])
  return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_COL_LAYOUT, _is_signed=None)


def _lanes_then_all(lane, write, read):
  """Inline Mosaic GPU code: lanes 0-3 of every warp run ``write(j, v)`` for their
  eight columns (8 j + 2 lane + v), the warpgroup meets, and every thread returns
  ``read(j, v)`` as a [32] column-layout array."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, scf
  from jax.experimental.mosaic.gpu import utils as mu
  i32 = ir.IntegerType.get_signless(32)
  if_op = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, lane, arith.constant(i32, 4)))
  with ir.InsertionPoint(if_op.then_block):
    for j in range(4):
      for v in range(2):
        write(j, v)
    scf.yield_([])
  mu.warpgroup_barrier()
  return _col_array([[read(j, v) for v in range(2)] for j in range(4)])


def _running_max(w: int):
  """Inline Mosaic GPU code: the running column maxima of warpgroup ``w``, raised by
  x [64, 32] (its scores over one tile): every warp's column maxima go into the
  warpgroup's 32 keys of the meta buffer by a shared-memory atomic max (keys only
  grow, so the running maxima need no reset), and every thread reads them back."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref
  from jax.experimental.mosaic.gpu import utils as mu

  def body(ctx, x, meta):
    del ctx
    i32, f32, index = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.IndexType.get()
    c = lambda v: arith.constant(i32, v)
    lane = arith.remui(mu.thread_idx(), c(32))
    col = arith.muli(arith.remui(lane, c(4)), c(2))
    vals = _warp_col_reduce(x, arith.maximumf)
    base = arith.addi(llvm.ptrtoint(i32, mu.memref_ptr(meta)), c(4 * (_MAX_KEYS + HALF * w)))

    def write(j, v):
      key = _ordered(arith.bitcast(i32, vals[j][v]))
      addr = arith.addi(base, arith.muli(arith.addi(col, c(8 * j + v)), c(4)))
      llvm.inline_asm(ir.Type.parse("!llvm.void"), [addr, key],
                      "red.shared.max.s32 [$0], $1;", "r,r", has_side_effects=True)

    def read(j, v):
      i = arith.addi(col, c(_MAX_KEYS + HALF * w + 8 * j + v))
      return arith.bitcast(f32, _ordered(memref.load(meta, [arith.index_cast(index, i)])))

    return _lanes_then_all(lane, write, read)

  return body


def _init_max(w: int):
  """Inline Mosaic GPU code: warpgroup ``w``'s running maxima set to -inf (and the
  zero word to 0)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, scf
  from jax.experimental.mosaic.gpu import utils as mu

  def body(ctx, meta):
    del ctx
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    tid = arith.remui(mu.thread_idx(), arith.constant(i32, _WG))
    if_op = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, tid, arith.constant(i32, HALF)))
    with ir.InsertionPoint(if_op.then_block):
      neg_inf = _ordered(arith.constant(i32, -8388608))  # 0xFF800000: -inf
      i = arith.addi(tid, arith.constant(i32, _MAX_KEYS + HALF * w))
      memref.store(neg_inf, meta, [arith.index_cast(index, i)])
      memref.store(arith.constant(i32, 0), meta, [arith.constant(index, _ZERO)])
      scf.yield_([])
    mu.warpgroup_barrier()
    return None

  return body


def _stage_barrier(meta, s):
  """Ring stage ``s``'s mbarrier in the meta buffer (``_MBAR``), as Mosaic GPU's
  ``BarrierRef`` of one barrier (``s``: an int or an i32 value)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic.gpu import utils as mu
  i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
  base = mu.getelementptr(mu.memref_ptr(meta), [4 * _MBAR], i8)
  offset = arith.constant(i32, s) if isinstance(s, int) else s
  return mu.BarrierRef(base, offset, None, 1)


def _init_stage_barriers():
  """Inline Mosaic GPU code, run by every thread of the program before its warpgroups
  part: thread 0 initialises the ring stages' mbarriers (``_ISSUERS`` arrivals each: the
  issuing warps' expected bytes), and the program meets."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu, llvm, nvvm
  from jax.experimental.mosaic.gpu import utils as mu

  def body(ctx, meta):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    first = arith.cmpi(arith.CmpIPredicate.eq, mu.thread_idx(), arith.constant(i32, 0))
    for s in range(STAGES):
      nvvm.mbarrier_init(_stage_barrier(meta, s).get_ptr(), arith.constant(i32, _ISSUERS),
                         predicate=first)
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.mbarrier_init.release.cluster;",
                    "", has_side_effects=True)
    gpu.barrier()
    return None

  return body


def _issue_rows(s: int):
  """Inline Mosaic GPU code (the producer warpgroup): lane 0 of each of its first
  ``_ISSUERS`` warps expects its rows' bytes on ring stage ``s``'s mbarrier and issues
  their TMA copies, rows [n warp, n warp + n) (n = 64 / ``_ISSUERS``) of the tile whose
  slot list is slot list ``s`` of the meta buffer (one copy per row: a (9, 64) box of the pool viewed as
  [S, 9, 64], with the 128-byte swizzle). One arrival per issuing warp and no arrival per
  copy: the copies only complete bytes."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, vector
  from jax.experimental.mosaic.gpu import utils as mu

  rows = BLOCK_K // _ISSUERS

  def body(ctx, pool, ring, meta):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    c = lambda v: arith.constant(i32, v)
    tid = arith.remui(mu.thread_idx(), c(_WG))
    warp, lane = arith.divui(tid, c(32)), arith.remui(tid, c(32))
    issuer = arith.andi(arith.cmpi(arith.CmpIPredicate.eq, lane, c(0)),
                        arith.cmpi(arith.CmpIPredicate.ult, warp, c(_ISSUERS)))
    bar = _stage_barrier(meta, s)
    bar.arrive_expect_tx(c(rows * WIDTH * 2), predicate=issuer)
    first = arith.muli(arith.remui(warp, c(_ISSUERS)), c(rows))  # (in bounds for every warp)
    slot_t = ir.VectorType.get((4,), i32)
    for i0 in range(0, rows, 4):
      at = arith.index_cast(index, arith.addi(first, c(BLOCK_K * s + i0)))
      slots = vector.load(slot_t, meta, [at])
      for i in range(4):
        slot = vector.extract(slots, dynamic_position=[], static_position=[i])
        row = arith.index_cast(index, arith.addi(first, c(i0 + i)))
        dst = mu.memref_slice(ring, (arith.constant(index, s), row))
        ctx.async_copy(src_ref=pool, dst_ref=dst, gmem_slice=(arith.index_cast(index, slot),),
                       swizzle=128, barrier=bar, arrive=False, predicate=issuer)
    return None

  return body


def _wait_stage(s: int):
  """Inline Mosaic GPU code: wait for ring stage ``s``'s rows (``_issue_rows``) of round
  ``r`` (the tile's index over two): its mbarrier's phase of parity r % 2."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith

  def body(ctx, meta, r):
    del ctx
    i1, i32 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32)
    parity = arith.trunci(i1, arith.andi(r.registers.flat[0], arith.constant(i32, 1)))
    _stage_barrier(meta, s).wait_parity(parity)
    return None

  return body


def _warp_sums():
  """Inline Mosaic GPU code: this warp's column sums of x [64, 32] (its 16 rows) as a
  [32] column-layout array (so not the same in every warp: ``_final_sums`` adds them)."""
  from jax._src.lib.mlir.dialects import arith

  def body(ctx, x):
    del ctx
    return _col_array(_warp_col_reduce(x, arith.addf))

  return body


def _final_sums(offset: int):
  """Inline Mosaic GPU code: the four warps' column sums (``_warp_sums``, accumulated)
  added, through the 512 bytes of ``scratch`` ``offset`` bytes in (this warpgroup's,
  and no longer read by anyone)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, vector
  from jax.experimental.mosaic.gpu import utils as mu

  def body(ctx, x, scratch):
    del ctx
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    c = lambda v: arith.constant(i32, v)
    tid = arith.remui(mu.thread_idx(), c(_WG))
    warp, lane = arith.divui(tid, c(32)), arith.remui(tid, c(32))
    col = arith.muli(arith.remui(lane, c(4)), c(2))
    base = arith.addi(llvm.ptrtoint(i32, mu.memref_ptr(scratch)), c(offset))
    ptr_t = llvm.PointerType.get(address_space=3)
    addr = lambda wp, j, v: llvm.inttoptr(ptr_t, arith.addi(
        base, arith.muli(arith.addi(arith.muli(wp, c(HALF)), arith.addi(col, c(8 * j + v))),
                         c(4))))
    vals = [[vector.extract(x.registers[j, 0, 0], dynamic_position=[], static_position=[v])
             for v in range(2)] for j in range(4)]

    def read(j, v):
      total = llvm.load(f32, addr(c(0), j, v))
      for wp in range(1, 4):
        total = arith.addf(total, llvm.load(f32, addr(c(wp), j, v)))
      return total

    return _lanes_then_all(lane, lambda j, v: llvm.store(vals[j][v], addr(warp, j, v)), read)

  return body


def _rows_load(ring, meta_smem, s: int, block: int, trans: bool,
               steps: tuple[int, ...] = (0, 1, 2, 3)):
  """A [64, 16 len(steps)] register operand from ring stage ``s`` (``_ldmatrix_frag``)."""
  frag_t = plgpu.ShapeDtypeStruct((64, 16 * len(steps)), jnp.bfloat16,
                                  layout=plgpu.Layout.WGMMA)
  ref_t = plgpu.RefType((plgpu.SwizzleTransform(128),))
  return plgpu.inline_mgpu(arg_types=(ref_t, plgpu.RefType()), return_type=frag_t)(
      _ldmatrix_frag(s, block, trans, steps))(ring, meta_smem)


def _pt_transforms():
  """The probabilities' shared-memory tiles ([64 rows, 32 heads] per warpgroup, the
  output matmul's B operand): a K group of its swizzle is at most a register operand's
  K (``_FRAG_K``): the 64-byte swizzle over 32 heads, or the 32-byte one over 16."""
  return ((plgpu.TilingTransform((8, HALF)), plgpu.SwizzleTransform(64)) if _FRAG_K == 64
          else (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32)))


def _frag_steps():
  """The k16 steps of each register operand: all four of a 64-column block in one
  operand (``_FRAG_K`` 64), or one per operand (16)."""
  return [(0, 1, 2, 3)] if _FRAG_K == 64 else [(kk,) for kk in range(4)]


def _zero_based(meta_smem, start: int):
  """``start`` (a multiple of 8), plus 8 times the zero word when
  ``_DYNAMIC_DESCRIPTORS``: a slice starting there has its descriptor computed where it
  is used."""
  if not _DYNAMIC_DESCRIPTORS:
    return start
  return pl.multiple_of(meta_smem[_ZERO] * 8 + start, 8)


def _rows_scores(q_smem, ring, meta_smem, s: int, w: int):
  """The transposed scores S^T = K Q_w^T of heads [32 w, 32 w + 32) over the rows in
  ring stage ``s``: [64 rows, 32 heads] float32, unscaled (q_smem: the queries, one
  [64, 576] buffer or the pair [64, 512], [64, 64]: ``_QUERY_PARTS``)."""

  def scores(acc_ref):
    for c in range(ROW_LINES):
      for steps in _frag_steps():
        q, c0 = ((q_smem[0], 64 * c) if len(q_smem) == 1 or c < LATENT // 64
                 else (q_smem[1], 64 * c - LATENT))
        cols = pl.ds(c0 + 16 * steps[0], 16 * len(steps))
        heads = pl.ds(_zero_based(meta_smem, HALF * w), HALF)
        qt = plgpu.transpose_ref(q.at[heads, cols], (1, 0))
        plgpu.wgmma(acc_ref, _rows_load(ring, meta_smem, s, c, False, steps), qt)
        plgpu.wgmma_wait(_IN_FLIGHT)  # so that at most _IN_FLIGHT + 1 operands are live
    return acc_ref[...]

  return pl.run_scoped(scores, plgpu.ACC((BLOCK_K, HALF), jnp.float32))


_COL = plgpu.Layout.WGMMA.reduce(0)  # a warpgroup's per-head values ([32], by column)
_COL_T = plgpu.ShapeDtypeStruct((HALF,), jnp.float32, layout=_COL)


def _rows_softmax(sc, meta_smem, t, w: int, scale2: float, m, l):
  """The online softmax (base 2) of warpgroup ``w``'s scores over tile ``t`` (masked by
  its validity bits): -> (the probabilities [64 rows, 32 heads], the new running
  maxima, the new running sums of this warp's rows, the accumulators' factor)."""
  row = plgpu.broadcasted_iota(jnp.int32, (BLOCK_K, HALF), 0, layout=plgpu.Layout.WGMMA)
  bits = _BITS + 2 * t  # the tile's two validity words in the meta buffer
  word = jnp.where(row < 32, meta_smem[bits], meta_smem[bits + 1])
  ok = jnp.bitwise_and(jnp.right_shift(word, jnp.bitwise_and(row, 31)), 1) != 0
  sc = jnp.where(ok, sc * scale2, -jnp.inf)
  # Column reductions are inline: Pallas' cross-warp reductions share one scratch
  # buffer between warpgroups.
  m_new = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                            return_type=_COL_T)(_running_max(w))(sc, meta_smem)
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing valid yet: exp2() gives 0
  alpha = jnp.exp2(m - m_safe)
  p = jnp.exp2(sc - jax.lax.broadcast_in_dim(m_safe, sc.shape, [1]))
  # l: this warp's rows only, the warps' sums added at the end (``_final_sums``).
  l = l * alpha + _rows_warp_sums(p)
  return p, m_new, l, alpha


def _rows_warp_sums(x):
  """This warp's column sums of x [64, 32] (``_warp_sums``)."""
  return plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=_COL_T)(
      _warp_sums())(x)


def _rows_outputs(p, ring, pt_smem, meta_smem, s: int, w: int, acc_refs, alpha=None):
  """``acc_refs`` (eight [64 columns, 32 heads]) times ``alpha`` (per head; None: 1)
  plus V^T P^T over the rows in ring stage ``s``, with ``p`` through this warpgroup's
  probabilities buffer; no ``wgmma`` in flight after."""
  if alpha is not None:
    scale = jax.lax.broadcast_in_dim(alpha, (64, HALF), [1])
    for acc_ref in acc_refs:  # (reading one waits for the last tile's output matmuls)
      acc_ref[...] = acc_ref[...] * scale
  pt_smem.at[w][...] = p.astype(jnp.bfloat16)
  plgpu.commit_smem()  # visible to the tensor cores (and every thread has written)
  for steps in _frag_steps():
    rows = pl.ds(_zero_based(meta_smem, 16 * steps[0]), 16 * len(steps))
    for cb, acc_ref in enumerate(acc_refs):
      plgpu.wgmma(acc_ref, _rows_load(ring, meta_smem, s, cb, True, steps),
                  pt_smem.at[w, rows])
      plgpu.wgmma_wait(_IN_FLIGHT)
  # None in flight past the step: accumulators carried by the loop are copied at its
  # back edge, and ptxas serialises every wgmma of a kernel that reads one in flight.
  plgpu.wgmma_wait(0)


def _rows_tile_step(q_smem, ring, pt_smem, meta_smem, s: int, t, w: int, scale2: float,
                    m, l, acc_refs):
  """Warpgroup ``w``'s work on tile ``t`` in ring stage ``s``: the transposed scores of
  heads [32 w, 32 w + 32), masked by the tile's validity bits, the online softmax over
  the rows and the 512 output columns of those heads, accumulated in ``acc_refs``
  (eight [64 columns, 32 heads] accumulators). -> the new (m, l)."""
  sc = _rows_scores(q_smem, ring, meta_smem, s, w)
  p, m, l, alpha = _rows_softmax(sc, meta_smem, t, w, scale2, m, l)
  _rows_outputs(p, ring, pt_smem, meta_smem, s, w, acc_refs, alpha)
  return m, l


def _kernel_rows(q_refs, pool_ref, slots_ref, bits_ref, o_ref, lse_ref, q_smem, ring,
                 pt_smem, meta_smem, in_bar, slot_bar, full, step_bar, *, tiles: int,
                 scale2: float, ablation: str | None,
                 registers: tuple[int, int] | None = None):
  # A loop over pairs of tiles, tile t in ring stage t % 2. Slot lists are
  # double-buffered like the ring: ``meta_smem`` holds them (64 words each) and then the
  # split's validity bits.
  # Without a producer (``registers`` None), step t: wait for tile t, compute it, meet
  # (both warpgroups are done reading stage t % 2), issue tile t + 2's row copies into it
  # (each warpgroup half the rows, from one thread) and copy tile t + 3's slot list in.
  # With a producer (warpgroup 2; ``registers``: the consumers' and its own after
  # ``setmaxnreg``) it issues every copy: tile t + 2's once both consumers released
  # stage t % 2 (``step_bar`` is then that stage's barrier of two arrivals), so the
  # consumers never stop for the copies and never wait for each other. Its first
  # ``_ISSUERS`` warps issue them (``_issue_rows``), and the consumers wait for each stage
  # on an mbarrier of the meta buffer (``_wait_stage``; ``full`` is then None).
  # q_refs, q_smem: the queries' one part or two (``_QUERY_PARTS``).
  b, sp, wg = (jax.lax.axis_index(n) for n in ("b", "split", "wg"))
  producer = registers is not None

  def slots_in(t, s: int):
    plgpu.copy_gmem_to_smem(slots_ref.at[b, sp, t],
                            meta_smem.at[pl.ds(BLOCK_K * s, BLOCK_K)], slot_bar.at[s])

  def rows_in(t, s: int, first: int, count: int):  # rows [first, first + count) of tile t
    plgpu.barrier_wait(slot_bar.at[s])

    def row(i, carry):
      r = first + i
      slot = meta_smem[BLOCK_K * s + r]
      plgpu.copy_gmem_to_smem(pool_ref.at[slot], ring.at[s, r], full.at[s])
      return carry

    jax.lax.fori_loop(0, count, row, 0)  # (unrolled, the step took 188 us, not 134)

  def meet():
    plgpu.barrier_arrive(step_bar)
    plgpu.barrier_wait(step_bar)

  def init():
    return (plgpu.layout_cast(jnp.full((HALF,), -jnp.inf, jnp.float32), _COL),
            plgpu.layout_cast(jnp.zeros((HALF,), jnp.float32), _COL))

  def inputs_in():  # validity bits, queries and the first two slot lists
    plgpu.copy_gmem_to_smem(bits_ref.at[b, sp],
                            meta_smem.at[pl.ds(_BITS, bits_ref.shape[-1])], in_bar)
    for q_ref, q_buf in zip(q_refs, q_smem):
      plgpu.copy_gmem_to_smem(q_ref.at[b], q_buf, in_bar)
    slots_in(0, 0)
    slots_in(1, 1)

  def producer_body():
    plgpu.set_max_registers(registers[1], action="decrease")
    with jax.named_scope("p_inputs"):
      inputs_in()

    def tile_in(t, s: int):
      plgpu.barrier_wait(slot_bar.at[s])
      plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType((plgpu.SwizzleTransform(128),)),
                                   plgpu.RefType()))(_issue_rows(s))(pool_ref, ring, meta_smem)
      plgpu.commit_smem()  # every thread has read slot list s before it is rewritten
      if ablation != "compute":
        pl.when(t + 2 < tiles)(lambda: slots_in(t + 2, s))

    with jax.named_scope("p_first"):
      tile_in(0, 0)
      tile_in(1, 1)
    if ablation == "compute":  # the first two tiles only, reused by every step
      return

    def pair(jj, carry):
      for s in range(2):
        t = 2 * jj + s
        plgpu.barrier_wait(step_bar.at[s])  # both consumers are done with tile t - 2
        tile_in(t, s)
      return carry

    with jax.named_scope("p_loop"):
      jax.lax.fori_loop(1, tiles // 2, pair, 0)

  def body(w: int):
    if producer:
      plgpu.set_max_registers(registers[0], action="increase")
    else:
      if w == 0:
        inputs_in()
      rows_in(0, 0, HALF * w, HALF)
      rows_in(1, 1, HALF * w, HALF)
      meet()  # both read slot lists 0 and 1
      if w == 0 and tiles > 2 and ablation != "compute":
        slots_in(2, 0)
    with jax.named_scope("c_inputs"):
      plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_init_max(w))(meta_smem)
      plgpu.barrier_wait(in_bar)

    def pair(jj, carry, acc_refs):
      m, l = carry
      for s in range(2):
        t = 2 * jj + s
        if producer:  # the stage's mbarrier (``_issue_rows``), phase jj
          wait = lambda s=s: plgpu.inline_mgpu(
              arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(())))(_wait_stage(s))(
                  meta_smem, jj)
        else:
          wait = lambda s=s: plgpu.barrier_wait(full.at[s])
        if ablation == "compute":  # only the first two tiles are gathered
          pl.when(jj == 0)(wait)
        else:
          with jax.named_scope("c_wait"):
            wait()
        if ablation != "gather":
          m, l = _rows_tile_step(q_smem, ring, pt_smem, meta_smem, s, t, w, scale2, m, l,
                                 acc_refs)
        if producer:
          plgpu.barrier_arrive(step_bar.at[s])  # stage s is free
          continue
        meet()
        if ablation != "compute":  # (which reuses the first two tiles)
          pl.when(t + 2 < tiles)(lambda: rows_in(t + 2, s, HALF * w, HALF))
          if w == 0:
            pl.when(t + 3 < tiles)(lambda: slots_in(t + 3, 1 - s))
      return m, l

    def run(*acc_refs):  # the accumulators stay in place (no copy per step)
      m, l = jax.lax.fori_loop(0, tiles // 2, lambda jj, c: pair(jj, c, acc_refs), init())
      return m, l, tuple(r[...] for r in acc_refs)

    with jax.named_scope("c_loop"):
      m, l, accs = pl.run_scoped(run, *[plgpu.ACC((64, HALF), jnp.float32)] * (LATENT // 64))
    with jax.named_scope("c_epilogue"):
      # The warps' sums added through memory no longer read: with a producer this
      # warpgroup's probabilities (its last output matmuls have finished), else the ring
      # (every tile computed and met after).
      if producer:
        scratch, offset = pt_smem, w * BLOCK_K * HALF * 2
        scratch_t = plgpu.RefType(_pt_transforms())
      else:
        scratch, offset = ring, 512 * w
        scratch_t = plgpu.RefType((plgpu.SwizzleTransform(128),))
      l = plgpu.inline_mgpu(arg_types=(_COL, scratch_t), return_type=_COL_T)(
          _final_sums(offset))(l, scratch)
      l_ok = l > 0
      l_safe = jnp.where(l_ok, l, 1.0)
      inv = jax.lax.broadcast_in_dim(1.0 / l_safe, (64, HALF), [1])
      lse = jnp.where(l_ok, m / _LOG2E + jnp.log(l_safe), -jnp.inf)
      o = o_ref.at[b, sp]  # [64 heads, 512]
      for cb, acc in enumerate(accs):
        plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
            _store_transposed(HALF * w))(acc * inv, o.at[:, pl.ds(64 * cb, 64)])
      plgpu.inline_mgpu(arg_types=(_COL, plgpu.RefType()))(
          _store_transposed(HALF * w))(lse, lse_ref.at[b, sp])

  if producer:  # its stage barriers, before any warpgroup can use them
    plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_init_stage_barriers())(meta_smem)
  pl.when(wg == 0)(lambda: body(0))
  pl.when(wg == 1)(lambda: body(1))
  if producer:
    pl.when(wg == 2)(producer_body)


def _prepare(q_lat, q_rope, S: int, slots, valid, config: MosaicAttentionConfig):
  """The kernel's inputs: the queries (bf16; [B, 64, 576], or for the rows forms with
  ``_QUERY_PARTS`` the pair [B, 64, 512], [B, 64, 64] as given), the slot lists
  [B, splits, tiles, rows per tile] int32 (clamped, 0 where not valid, padded with 0 to
  whole rounds of the ring) and the validity bits [B, splits, words] int32
  (``_bit_words``). With the queries' parts as given only the slot lists and the bits
  are computed before the launch, in one pass over [B, k]."""
  B, k = slots.shape
  bk, stages, _ = config.ring()
  splits = config.splits(B)
  if not config.producer:  # the split's whole slot list sits in shared memory
    splits = max(splits, -(-k // MAX_SPLIT_ROWS))
  tiles = stages * -(-k // (stages * bk * splits))  # per split, whole rounds of the ring
  kp = tiles * bk * splits
  pad = ((0, 0), (0, kp - k))
  parts = config.rows and _QUERY_PARTS
  slots = jnp.where(valid, jnp.clip(slots, 0, S - 1), 0)
  slots = jnp.pad(slots.astype(jnp.int32), pad)
  valid = jnp.pad(valid, pad)
  # Validity as bits, 32 entries per int32 word (bit i of word w: entry 32 w + i).
  shifts = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
  bits = jnp.sum(jnp.where(valid.reshape(B, kp // 32, 32), shifts, jnp.uint32(0)),
                 axis=-1, dtype=jnp.uint32)
  words = kp // 32 // splits
  wpad = _bit_words(kp // splits)
  bits = jax.lax.bitcast_convert_type(bits, jnp.int32).reshape(B, splits, words)
  bits = jnp.pad(bits, ((0, 0), (0, 0), (0, wpad - words)))
  slots = slots.reshape(B, splits, tiles, bk)
  if parts:
    q = (q_lat.astype(jnp.bfloat16), q_rope.astype(jnp.bfloat16))
  else:
    q = jnp.concatenate([q_lat, q_rope], axis=-1).astype(jnp.bfloat16)
  return q, slots, bits


def _launch(q, pool, slots, bits, *, scale: float, config: MosaicAttentionConfig,
            ablation: str | None):
  """The kernel on ``_prepare``'s inputs -> each split's (normalised output, log-sum-exp)."""
  B, splits, tiles, bk = slots.shape
  S, wpad = pool.shape[0], bits.shape[-1]
  stages, swizzle = config.ring()[1:]
  tiled = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
  out_tiled = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  union = plgpu.RefUnion(
      (plgpu.SMEM((HEADS, WIDTH), jnp.bfloat16, transforms=tiled),
       plgpu.SMEM((stages, bk, WIDTH), jnp.bfloat16, transforms=tiled)),
      plgpu.SMEM((2, HEADS, LATENT // 2), jnp.float32, transforms=out_tiled))
  small = [plgpu.SMEM((wpad,), jnp.int32), plgpu.SMEM((HEADS,), jnp.float32),
           plgpu.Barrier(num_arrivals=2)]  # bits and queries copied in
  static = dict(tiles=tiles, scale2=float(scale) * _LOG2E, ablation=ablation)
  if config.rows:
    registers = ((config.consumer_registers, config.producer_registers())
                 if config.producer else None)
    pool = pool.reshape(S, ROW_LINES, 64)  # a row is one (9, 64) box
    union = None
    # The queries in tiles as wide as a register operand's K (16 columns: the 32-byte
    # swizzle), so that each wgmma's slice of them is whole tiles.
    q_swizzle = 2 * _FRAG_K
    q_tiled = (plgpu.TilingTransform((8, _FRAG_K)), plgpu.SwizzleTransform(q_swizzle))
    q_parts = ([plgpu.SMEM((HEADS, LATENT), jnp.bfloat16, transforms=q_tiled),
                plgpu.SMEM((HEADS, ROPE), jnp.bfloat16, transforms=q_tiled)]
               if isinstance(q, tuple) else
               [plgpu.SMEM((HEADS, WIDTH), jnp.bfloat16, transforms=q_tiled)])
    n = len(q_parts)  # the kernel's refs: queries, 5 more inputs and outputs, queries' buffers
    def body(*refs):
      rest = list(refs[2 * n + 5:])
      if config.producer:  # rows landed: the meta buffer's mbarriers (``_issue_rows``)
        rest.insert(5, None)
      _kernel_rows(refs[:n], *refs[n:n + 5], refs[n + 5:2 * n + 5], *rest, **static,
                   registers=registers)

    scratch = [*q_parts,
               plgpu.SMEM((STAGES, BLOCK_K, ROW_LINES, 64), jnp.bfloat16,
                          transforms=(plgpu.SwizzleTransform(128),)),
               plgpu.SMEM((2, BLOCK_K, HALF), jnp.bfloat16, transforms=_pt_transforms()),
               plgpu.SMEM((_BITS + wpad,), jnp.int32),  # slot lists, maxima, bits
               plgpu.Barrier(num_arrivals=1 + n),  # the bits and the queries copied in
               plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # a slot list copied in
               *([] if config.producer else  # rows landed
                 [plgpu.Barrier(num_arrivals=BLOCK_K, num_barriers=STAGES)]),
               # the end of a step; with a producer, per stage: both consumers done
               plgpu.Barrier(num_arrivals=2, num_barriers=STAGES if config.producer else 1)]
  elif config.producer:
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
      grid=(splits, B), grid_names=("split", "b"),
      num_threads=3 if config.producer else 2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True,
          # The rows form orders its shared memory itself (a step's meet before its
          # copies overwrite a ring stage, a wgmma wait before the probabilities are
          # rewritten); Pallas' automatic barriers put a warpgroup barrier before
          # every one of its 64 row copies per tile.
          unsafe_no_auto_barriers=config.rows,
          **({} if _PROFILE is None else
             dict(profile_space=_PROFILE[0], profile_dir=_PROFILE[1]))),
  )
  return kernel(*(q if isinstance(q, tuple) else (q,)), pool, slots, bits)


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
  q, slots, bits = _prepare(q_lat, q_rope, pool.shape[0], slots, valid, config)
  o, lse = _launch(q, pool, slots, bits, scale=scale, config=config, ablation=ablation)
  if not merge:
    return o, lse
  if o.shape[1] == 1:
    return o[:, 0]
  return merge_splits_pallas(o, lse, interpret=False)


FASTEST = MosaicAttentionConfig(rows=True, producer=True, consumer_registers=240)


def sparse_mla_attention_fastest(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                                 slots: jax.Array, valid: jax.Array, *,
                                 scale: float) -> jax.Array:
  """``sparse_mla_attention_mosaic`` in the fastest launch measured on an H200
  (``FASTEST``: the TMA row form with a producer; RESULTS.md), with the reference's
  signature (``kernels.attention='mosaic'``). Refused off a GPU (``lower_for_cuda``
  lowers the kernel anywhere)."""
  if jax.default_backend() != "gpu":
    raise ValueError(f"kernels.attention='mosaic' runs on Hopper GPUs only (the backend is "
                     f"{jax.default_backend()!r}); use 'pallas' or 'xla'")
  return sparse_mla_attention_mosaic(q_lat, q_rope, pool, slots, valid, scale=scale,
                                     config=FASTEST)


def lower_for_cuda(B: int = 2, k: int = 256, S: int = 512,
                   config: MosaicAttentionConfig | None = None) -> str:
  """The kernel lowered for CUDA on any machine (no GPU needed): the StableHLO text."""
  spec = jax.ShapeDtypeStruct
  f = jax.jit(lambda *a: sparse_mla_attention_mosaic(*a, scale=0.1, config=config,
                                                     merge=False))
  return f.trace(spec((B, HEADS, LATENT), jnp.bfloat16), spec((B, HEADS, ROPE), jnp.bfloat16),
                 spec((S, WIDTH), jnp.bfloat16), spec((B, k), jnp.int32),
                 spec((B, k), jnp.bool_)).lower(lowering_platforms=("cuda",)).as_text()


__all__ = ["BLOCK_K", "FASTEST", "MosaicAttentionConfig", "STAGES", "lower_for_cuda",
           "smem_bytes", "sparse_mla_attention_fastest", "sparse_mla_attention_mosaic"]
