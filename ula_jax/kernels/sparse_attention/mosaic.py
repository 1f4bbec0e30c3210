"""Sparse MLA decode attention as a Pallas Mosaic GPU kernel (Hopper), the kernel of
``kernels.attention='mosaic'``.

Same contract as ``reference.sparse_mla_attention_reference`` for 64 heads and
576-wide rows (512 latent + 64 rope), bf16 queries and pool. One program per (request,
k split), three warpgroups:

- a producer gathers the split's selected rows, 64 at a time, into a ring of two
  row-major shared-memory tiles: one TMA copy per row (the pool viewed as [S, 9, 64], a
  (9, 64) box with the 128-byte swizzle; Hopper's TMA has no row gather), lane 0 of each
  of its four warps issuing a quarter of a tile with one mbarrier arrival per warp and
  none per copy (``_issue_rows``). It refills a ring stage once both consumers released
  it, so the consumers never stop to issue copies or wait for each other;
- two consumers, 32 heads each, compute transposed: ``wgmma`` cannot read a row-major
  tile from shared memory, so the rows are its register operand (``ldmatrix``; the
  section before ``_ldmatrix_frag`` says how), the online softmax (float32, base 2) runs
  over the rows, and each consumer accumulates the 512 output columns of its heads.
  ``setmaxnreg`` gives them the registers the producer does not need.

Measured on an H200 it reads 0.42 / 0.51 / 0.53 of copy bandwidth at batch 64 / 128 /
256, 1.3 times the Triton kernel's speed (``docs/kernels/sparse_attention.md``, which
also lists the forms tried and lost). The copies hide behind the arithmetic, which is
what bounds it: the register-operand ``wgmma`` calls wait for each operand's
``ldmatrix`` (about 62 cycles per instruction where the instruction alone takes 20:
``benchmarks/probes/gpu_wgmma_rate.py``). Each program writes its split's normalised
output and log-sum-exp; ``pallas.merge_splits_pallas`` merges splits.

Diagnostics (a tile step with parts left out, the arithmetic or the gathers alone, the
profiler's timeline of named scopes) are arguments of ``sparse_mla_attention_probe``,
which only the probe scripts call.

GPU only (sm_90a): Mosaic GPU's interpret mode has no transposed shared-memory operand,
register operand or layout cast, and the copies are inline Mosaic GPU code. On other
machines ``lower_for_cuda`` checks that it lowers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_LOG2E = math.log2(math.e)
HEADS, LATENT, ROPE = 64, 512, 64
WIDTH = LATENT + ROPE  # 576 bf16 per row: 9 lines of 128 bytes
_WG = 128  # threads per warpgroup
_LAUNCH_REGISTERS = 65536 // (3 * _WG) // 8 * 8  # per thread at launch: 168

BLOCK_K = 64  # rows per ring tile (the output matmul's K: a multiple of the swizzle's 64)
STAGES = 2  # ring tiles: two 72-KB tiles and the 72-KB queries fill a block's 227 KB
# Probe-only launches with part of the work left out (``sparse_mla_attention_probe``).
ABLATIONS = ("compute", "gather")

@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
  """Launch of the Mosaic GPU sparse attention (static and hashable); the defaults are
  the fastest measured on an H200.

  num_splits: programs per request along k (None: 2 below 128 requests, else 1 -- an
              H200 has 132 SMs and a program takes one)
  consumer_registers: registers per thread of each consumer warpgroup after its
              ``setmaxnreg`` (a multiple of 8, 168-240); the producer lowers its own to
              what is left of the launch's (``producer_registers``: 24 at 240, 40 at 232)
  """

  num_splits: int | None = None
  consumer_registers: int = 240

  def __post_init__(self):
    if self.num_splits is not None and (isinstance(self.num_splits, bool)
                                        or not isinstance(self.num_splits, int)
                                        or self.num_splits < 1):
      raise ValueError(f"MosaicAttentionConfig.num_splits={self.num_splits!r}: expected "
                       "None or a positive integer")
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

  def splits(self, B: int) -> int:
    return self.num_splits or (2 if B < 128 else 1)

# The launch ``kernels.attention='mosaic'`` runs (``sparse_mla_attention_fastest``).
FASTEST = MosaicAttentionConfig()

def _bit_words(split_rows: int) -> int:
  """int32 words of a split's validity bits in shared memory (copies move multiples of
  128 bytes)."""
  return -(-(split_rows // 32) // 32) * 32

def smem_bytes(split_rows: int = 1024) -> int:
  """Shared memory of one program: the queries and the ring (216 KB), both consumers'
  probabilities (8 KB) and the meta buffer of slot lists, maxima, the zero word, the
  ring's mbarriers and the validity bits of a split of ``split_rows`` rows (1 KB at
  1024 rows)."""
  return ((HEADS + STAGES * BLOCK_K) * WIDTH * 2 + 2 * BLOCK_K * HALF * 2
          + (_BITS + _bit_words(split_rows)) * 4)

# --- Computing from row-major tiles ---------------------------------------------------
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
# loaded by ``ldmatrix.trans`` and P_w^T written to shared memory). One ``wgmma`` call is
# left in flight before the next operand is loaded (two operands live: a third, or
# operands of 16 columns, made ptxas serialise every ``wgmma`` for want of registers).

ROW_LINES = WIDTH // 64  # 128-byte lines per row
HALF = HEADS // 2  # heads per warpgroup

def _ldmatrix_frag(stage: int, block: int, trans: bool):
  """Inline Mosaic GPU code: a [64, 64] bf16 ``wgmma`` register operand (WGMMA layout)
  from ring ``stage`` (the ring's memref, [2, 64, 9, 64] bf16, 1024-byte aligned), one
  ``ldmatrix`` per k16 step.

  trans=False: rows x columns [64 block, 64 block + 64) of the tile (the scores' K);
  trans=True: columns [64 block, 64 block + 64) x rows (the outputs' V^T).

  Each ``ldmatrix`` address is the row-major address L with the swizzle applied to it,
  L ^ ((L >> 3) & 0x70) (its 16-byte chunk bits XOR its 128-byte line's bits 7-9), from
  a base that reads the meta buffer's zero word (a volatile load): the compiler cannot
  hoist the 68 addresses of a tile out of the loop and keep them in registers (it did,
  and spilled them)."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm
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
    zero = llvm.inline_asm(i32, [arith.addi(meta_ptr, c(4 * _ZERO))],
                           "ld.volatile.shared.u32 $0, [$1];", "=r,r", has_side_effects=True)
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
    regs = np.empty(layout.registers_shape((64, 64)), dtype=object)
    struct = llvm.StructType.get_literal([i32] * 4)
    op = "ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") + ".shared.b16"
    for kk in range(4):  # k16 steps
      lin = arith.addi(start, c(step(kk)))
      addr = arith.xori(lin, arith.andi(arith.shrui(lin, c(3)), c(0x70)))
      out = llvm.inline_asm(struct, [addr], op + " {$0, $1, $2, $3}, [$4];",
                            "=r,=r,=r,=r,r", has_side_effects=False)
      for m in range(4):  # matrix m -> register (column group 2 kk + m // 2, row half m % 2)
        reg = mu.bitcast(llvm.extractvalue(i32, out, [m]), bf16x2)
        regs[0, 2 * kk + m // 2, 0, 0, m % 2, 0, 0, 0, 0] = reg
    return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return body

def _store_transposed(col0: int):
  """Inline Mosaic GPU code: stores x [R, C] (a WGMMA-layout or WGMMA-column-layout
  float32 array, this warpgroup's heads as its last axis) transposed into ``ref``:
  x[r, c] -> ref[col0 + c, r] (2-D), or x[c] -> ref[col0 + c] (1-D)."""
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, memref, vector

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
_MBAR = _ZERO + 4  # two mbarriers (8-byte aligned): ring stage s landed
_BITS = _ZERO + 32  # and the split's validity bits (a 128-byte multiple in)
_ISSUERS = 4  # the producer's warps that issue a tile's row copies (one or two were slower)

def _ordered(i32v):
  """float32 bits <-> int32 that orders like the floats (an involution)."""
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith
  i32 = ir.IntegerType.get_signless(32)
  sign = arith.shrsi(i32v, arith.constant(i32, 31))
  return arith.xori(i32v, arith.andi(sign, arith.constant(i32, 0x7FFFFFFF)))

def _warp_col_reduce(x, op):
  """This warp's column reductions of x [64, 32] (WGMMA layout, float32): registers
  [j][v] for columns 8 j + 2 (lane % 4) + v, the same in every lane of a column."""
  from jaxlib.mlir.dialects import vector
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
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import vector
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
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, scf
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
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, memref
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
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, memref, scf
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
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith
  from jax.experimental.mosaic.gpu import utils as mu
  i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
  base = mu.getelementptr(mu.memref_ptr(meta), [4 * _MBAR], i8)
  offset = arith.constant(i32, s) if isinstance(s, int) else s
  return mu.BarrierRef(base, offset, None, 1)

def _init_stage_barriers():
  """Inline Mosaic GPU code, run by every thread of the program before its warpgroups
  part: thread 0 initialises the ring stages' mbarriers (``_ISSUERS`` arrivals each: the
  issuing warps' expected bytes), and the program meets."""
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, gpu, llvm, nvvm
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
  slot list is slot list ``s`` of the meta buffer (one copy per row: a (9, 64) box of
  the pool viewed as [S, 9, 64], with the 128-byte swizzle). One arrival per issuing warp
  and no arrival per copy: the copies only complete bytes."""
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, vector
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
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith

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
  from jaxlib.mlir.dialects import arith

  def body(ctx, x):
    del ctx
    return _col_array(_warp_col_reduce(x, arith.addf))

  return body

def _final_sums(offset: int):
  """Inline Mosaic GPU code: the four warps' column sums (``_warp_sums``, accumulated)
  added, through the 512 bytes of ``scratch`` ``offset`` bytes in (this warpgroup's,
  and no longer read by anyone)."""
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, vector
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

def _rows_load(ring, meta_smem, s: int, block: int, trans: bool):
  """A [64, 64] register operand from ring stage ``s`` (``_ldmatrix_frag``)."""
  frag_t = plgpu.ShapeDtypeStruct((64, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA)
  ref_t = plgpu.RefType((plgpu.SwizzleTransform(128),))
  return plgpu.inline_mgpu(arg_types=(ref_t, plgpu.RefType()), return_type=frag_t)(
      _ldmatrix_frag(s, block, trans))(ring, meta_smem)

def _pt_transforms():
  """The probabilities' shared-memory tiles ([64 rows, 32 heads] per warpgroup, the
  output matmul's B operand): the 64-byte swizzle over 32 heads, so that a K group of
  the swizzle is no more than a register operand's K."""
  return (plgpu.TilingTransform((8, HALF)), plgpu.SwizzleTransform(64))

def _zero_based(meta_smem, start: int):
  """``start`` (a multiple of 8) plus 8 times the zero word: a shared-memory operand's
  slice starting there has its ``wgmma`` descriptor computed where it is used, not
  hoisted out of the loop into registers (which spilled 704-840 B)."""
  return pl.multiple_of(meta_smem[_ZERO] * 8 + start, 8)

def _rows_scores(q_smem, ring, meta_smem, s: int, w: int):
  """The transposed scores S^T = K Q_w^T of heads [32 w, 32 w + 32) over the rows in
  ring stage ``s``: [64 rows, 32 heads] float32, unscaled (q_smem: the queries' latent
  [64, 512] and rope [64, 64] parts)."""

  def scores(acc_ref):
    for c in range(ROW_LINES):
      q, c0 = ((q_smem[0], 64 * c) if c < LATENT // 64 else (q_smem[1], 64 * c - LATENT))
      cols = pl.ds(c0, 64)
      heads = pl.ds(_zero_based(meta_smem, HALF * w), HALF)
      qt = plgpu.transpose_ref(q.at[heads, cols], (1, 0))
      plgpu.wgmma(acc_ref, _rows_load(ring, meta_smem, s, c, False), qt)
      plgpu.wgmma_wait(1)  # so that at most two operands are live
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
  rows = pl.ds(_zero_based(meta_smem, 0), BLOCK_K)
  for cb, acc_ref in enumerate(acc_refs):
    plgpu.wgmma(acc_ref, _rows_load(ring, meta_smem, s, cb, True), pt_smem.at[w, rows])
    plgpu.wgmma_wait(1)
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
                 pt_smem, meta_smem, in_bar, slot_bar, step_bar, *, tiles: int,
                 scale2: float, registers: tuple[int, int], tile_step: Callable,
                 ablation: str | None):
  # A loop over pairs of tiles, tile t in ring stage t % 2. Slot lists are
  # double-buffered like the ring: ``meta_smem`` holds them (64 words each) and then the
  # split's validity bits. The producer (warpgroup 2; ``registers``: the consumers' and
  # its own after ``setmaxnreg``) issues every copy: tile t + 2's once both consumers
  # released stage t % 2 (``step_bar``: that stage's barrier of two arrivals). Its first
  # ``_ISSUERS`` warps issue them (``_issue_rows``), and the consumers wait for each stage
  # on an mbarrier of the meta buffer (``_wait_stage``). q_refs, q_smem: the queries'
  # latent and rope parts. ``tile_step`` and ``ablation``: ``sparse_mla_attention_probe``.
  b, sp, wg = (jax.lax.axis_index(n) for n in ("b", "split", "wg"))

  def slots_in(t, s: int):
    plgpu.copy_gmem_to_smem(slots_ref.at[b, sp, t],
                            meta_smem.at[pl.ds(BLOCK_K * s, BLOCK_K)], slot_bar.at[s])

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
    plgpu.set_max_registers(registers[0], action="increase")
    with jax.named_scope("c_inputs"):
      plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_init_max(w))(meta_smem)
      plgpu.barrier_wait(in_bar)

    def pair(jj, carry, acc_refs):
      m, l = carry
      for s in range(2):
        t = 2 * jj + s
        # The stage's mbarrier (``_issue_rows``), phase jj.
        wait = lambda s=s: plgpu.inline_mgpu(
            arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(())))(_wait_stage(s))(
                meta_smem, jj)
        if ablation == "compute":  # only the first two tiles are gathered
          pl.when(jj == 0)(wait)
        else:
          with jax.named_scope("c_wait"):
            wait()
        if ablation != "gather":
          m, l = tile_step(q_smem, ring, pt_smem, meta_smem, s, t, w, scale2, m, l,
                           acc_refs)
        plgpu.barrier_arrive(step_bar.at[s])  # stage s is free
      return m, l

    def run(*acc_refs):  # the accumulators stay in place (no copy per step)
      m, l = jax.lax.fori_loop(0, tiles // 2, lambda jj, c: pair(jj, c, acc_refs), init())
      return m, l, tuple(r[...] for r in acc_refs)

    with jax.named_scope("c_loop"):
      m, l, accs = pl.run_scoped(run, *[plgpu.ACC((64, HALF), jnp.float32)] * (LATENT // 64))
    with jax.named_scope("c_epilogue"):
      # The warps' sums added through memory no longer read: this warpgroup's
      # probabilities (its last output matmuls have finished).
      l = plgpu.inline_mgpu(arg_types=(_COL, plgpu.RefType(_pt_transforms())),
                            return_type=_COL_T)(
          _final_sums(w * BLOCK_K * HALF * 2))(l, pt_smem)
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

  # The ring's mbarriers, before any warpgroup can use them.
  plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_init_stage_barriers())(meta_smem)
  pl.when(wg == 0)(lambda: body(0))
  pl.when(wg == 1)(lambda: body(1))
  pl.when(wg == 2)(producer_body)

def _prepare(q_lat, q_rope, S: int, slots, valid, config: MosaicAttentionConfig):
  """The kernel's inputs: the queries' parts as given (bf16; [B, 64, 512], [B, 64, 64]:
  two copies into two buffers cost the kernel nothing, a concatenation before the launch
  6.7 us at batch 128), the slot lists [B, splits, tiles, 64] int32 (clamped, 0 where
  not valid, padded with 0 to whole rounds of the ring) and the validity bits [B,
  splits, words] int32 (``_bit_words``): one pass over [B, k] before the launch (a clamp
  by the producer put two instructions per row copy on the kernel's critical path)."""
  B, k = slots.shape
  splits = config.splits(B)
  tiles = STAGES * -(-k // (STAGES * BLOCK_K * splits))  # per split, whole rounds of the ring
  kp = tiles * BLOCK_K * splits
  pad = ((0, 0), (0, kp - k))
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
  slots = slots.reshape(B, splits, tiles, BLOCK_K)
  return (q_lat.astype(jnp.bfloat16), q_rope.astype(jnp.bfloat16)), slots, bits

def _launch(q, pool, slots, bits, *, scale: float, config: MosaicAttentionConfig,
            tile_step: Callable | None = None, ablation: str | None = None,
            profile: tuple[int, str] | None = None):
  """The kernel on ``_prepare``'s inputs -> each split's (normalised output, log-sum-exp);
  ``tile_step``, ``ablation``, ``profile``: ``sparse_mla_attention_probe``."""
  B, splits, tiles, _ = slots.shape
  S, wpad = pool.shape[0], bits.shape[-1]
  static = dict(tiles=tiles, scale2=float(scale) * _LOG2E, ablation=ablation,
                registers=(config.consumer_registers, config.producer_registers()),
                tile_step=tile_step or _rows_tile_step)
  pool = pool.reshape(S, ROW_LINES, 64)  # a row is one (9, 64) box
  # The queries in tiles as wide as a register operand's K (64 columns: the 128-byte
  # swizzle), so that each wgmma's slice of them is whole tiles.
  q_tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def body(*refs):  # queries, 5 more inputs and outputs, the queries' buffers, the rest
    _kernel_rows(refs[:2], *refs[2:7], refs[7:9], *refs[9:], **static)

  scratch = [plgpu.SMEM((HEADS, LATENT), jnp.bfloat16, transforms=q_tiled),
             plgpu.SMEM((HEADS, ROPE), jnp.bfloat16, transforms=q_tiled),
             plgpu.SMEM((STAGES, BLOCK_K, ROW_LINES, 64), jnp.bfloat16,
                        transforms=(plgpu.SwizzleTransform(128),)),
             plgpu.SMEM((2, BLOCK_K, HALF), jnp.bfloat16, transforms=_pt_transforms()),
             plgpu.SMEM((_BITS + wpad,), jnp.int32),  # slot lists, maxima, bits
             plgpu.Barrier(num_arrivals=3),  # the bits and the queries' two parts copied in
             plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # a slot list copied in
             # per stage: both consumers are done with it
             plgpu.Barrier(num_arrivals=2, num_barriers=STAGES)]
  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, splits, HEADS, LATENT), jnp.float32),
                jax.ShapeDtypeStruct((B, splits, HEADS), jnp.float32)),
      scratch_types=scratch,
      grid=(splits, B), grid_names=("split", "b"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True,
          # The kernel orders its shared memory itself (a wgmma wait before the
          # probabilities are rewritten, the stage barriers before a stage's copies);
          # Pallas' automatic barriers put a warpgroup barrier before every row copy.
          unsafe_no_auto_barriers=True,
          **({} if profile is None else
             dict(profile_space=profile[0], profile_dir=profile[1]))),
  )
  return kernel(*q, pool, slots, bits)

def _split_outputs(q_lat, q_rope, pool, slots, valid, *, scale: float,
                   config: MosaicAttentionConfig | None, **diagnostics):
  """Each split's (normalised output [B, NS, 64, 512], log-sum-exp [B, NS, 64]) after the
  geometry checks."""
  config = config or MosaicAttentionConfig()
  B, H, Dl = q_lat.shape
  Dr = q_rope.shape[-1]
  if (H, Dl, Dr) != (HEADS, LATENT, ROPE) or pool.shape[-1] != WIDTH:
    raise ValueError(f"q_lat {tuple(q_lat.shape)}, q_rope {tuple(q_rope.shape)}, pool "
                     f"{tuple(pool.shape)}: the Mosaic kernel takes {HEADS} heads of "
                     f"{LATENT} + {ROPE} columns (use the Pallas Triton kernel otherwise)")
  if pool.dtype != jnp.bfloat16:
    raise ValueError(f"pool.dtype={pool.dtype}: the Mosaic kernel takes bfloat16 pools")
  q, slots, bits = _prepare(q_lat, q_rope, pool.shape[0], slots, valid, config)
  return _launch(q, pool, slots, bits, scale=scale, config=config, **diagnostics)

def sparse_mla_attention_mosaic(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                                slots: jax.Array, valid: jax.Array, *, scale: float,
                                config: MosaicAttentionConfig | None = None,
                                merge: bool = True):
  """Attention of every head over the selected pool rows (Mosaic GPU, sm_90a).

  q_lat: [B, 64, 512], q_rope: [B, 64, 64] queries (cast to bf16); pool: [S, 576] bf16;
  slots: [B, k] int32 (ignored where not valid; clamped into [0, S)); valid: [B, k]
  bool; scale: softmax scale. returns o_lat: [B, 64, 512] float32; ``merge=False``:
  the splits' normalised outputs [B, NS, 64, 512] and log-sum-exps [B, NS, 64].
  """
  from ula_jax.kernels.sparse_attention.pallas import merge_splits_pallas

  o, lse = _split_outputs(q_lat, q_rope, pool, slots, valid, scale=scale, config=config)
  if not merge:
    return o, lse
  if o.shape[1] == 1:
    return o[:, 0]
  return merge_splits_pallas(o, lse, interpret=False)

def sparse_mla_attention_probe(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                               slots: jax.Array, valid: jax.Array, *, scale: float,
                               config: MosaicAttentionConfig | None = None,
                               tile_step: Callable | None = None,
                               ablation: str | None = None,
                               profile: tuple[int, str] | None = None):
  """``sparse_mla_attention_mosaic(..., merge=False)`` with the probes' diagnostics
  (``benchmarks/probes/gpu_mosaic_probe.py``); the defaults are the kernel itself.

  tile_step: replaces ``_rows_tile_step`` (same signature and result), e.g. with parts
          of a step left out; the outputs are then not attention
  ablation: 'compute' gathers each split's first two tiles only and computes on them
          at every step (the arithmetic alone), 'gather' gathers every tile and
          computes nothing (the copies alone; the outputs are zeros)
  profile: (ranges per warpgroup, folder): Mosaic GPU's profiler records the kernel's
          named scopes per warpgroup and writes a trace to the folder per call
  """
  if ablation not in (None, *ABLATIONS):
    raise ValueError(f"ablation={ablation!r}: expected None or one of {list(ABLATIONS)}")
  return _split_outputs(q_lat, q_rope, pool, slots, valid, scale=scale, config=config,
                        tile_step=tile_step, ablation=ablation, profile=profile)

def sparse_mla_attention_fastest(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                                 slots: jax.Array, valid: jax.Array, *,
                                 scale: float) -> jax.Array:
  """``sparse_mla_attention_mosaic`` in the fastest launch measured on an H200
  (``FASTEST``), with the reference's signature (``kernels.attention='mosaic'``).
  Refused off a GPU (``lower_for_cuda`` lowers the kernel anywhere)."""
  if jax.default_backend() != "gpu":
    raise ValueError(f"kernels.attention='mosaic' runs on Hopper GPUs only (the backend is "
                     f"{jax.default_backend()!r}); use 'pallas' or 'xla'")
  return _fastest_shared(q_lat, q_rope, pool, slots, valid, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale",))
def _fastest_shared(q_lat, q_rope, pool, slots, valid, *, scale: float):
  """``sparse_mla_attention_mosaic`` in ``FASTEST``, as one jitted function: a program
  with several call sites of the same shapes (a decode step's layers) lowers the kernel
  once, and every site carries the same module, which is compiled once."""
  return sparse_mla_attention_mosaic(q_lat, q_rope, pool, slots, valid, scale=scale,
                                     config=FASTEST)

def lower_for_cuda(B: int = 2, k: int = 256, S: int = 512,
                   config: MosaicAttentionConfig | None = None, **diagnostics) -> str:
  """The kernel lowered for CUDA on any machine (no GPU needed): the StableHLO text of
  its split outputs (``merge=False``), or with ``diagnostics`` (keywords of
  ``sparse_mla_attention_probe``) the probe's launch."""
  spec = jax.ShapeDtypeStruct
  if diagnostics:
    call = lambda *a: sparse_mla_attention_probe(*a, scale=0.1, config=config,
                                                 **diagnostics)
  else:
    call = lambda *a: sparse_mla_attention_mosaic(*a, scale=0.1, config=config,
                                                  merge=False)
  return jax.jit(call).trace(
      spec((B, HEADS, LATENT), jnp.bfloat16), spec((B, HEADS, ROPE), jnp.bfloat16),
      spec((S, WIDTH), jnp.bfloat16), spec((B, k), jnp.int32),
      spec((B, k), jnp.bool_)).lower(lowering_platforms=("cuda",)).as_text()

__all__ = ["ABLATIONS", "BLOCK_K", "FASTEST", "MosaicAttentionConfig", "STAGES",
           "lower_for_cuda", "smem_bytes", "sparse_mla_attention_fastest",
           "sparse_mla_attention_mosaic", "sparse_mla_attention_probe"]
