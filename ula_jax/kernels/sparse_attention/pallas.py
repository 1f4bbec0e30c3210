"""Sparse MLA decode attention as a Pallas kernel (Triton on GPU, interpret mode on CPU).

Same contract as ``reference.sparse_mla_attention_reference``: per request row ``b``,
every head attends over the ``k`` pool rows ``slots[b]`` (where ``valid``), in absorbed
form (scores from the 576-wide latent rows, outputs in the latent space).

Grid: (head blocks, k splits, B), head blocks varying fastest so that the programs that
gather the same rows (one request, one split, different heads) run side by side and
share them through L2. A program holds ``block_h`` heads' queries and walks its share of
the selection ``block_k`` rows at a time: it gathers each row once by slot straight from
the pool and uses it for all its heads, as two tensor-core matmuls per step
(``[block_h, Dl+Dr] x [Dl+Dr, block_k]`` for the scores, ``[block_h, block_k] x
[block_k, Dl]`` for the output), with an online softmax in float32 (base 2).

With one split a program writes the normalised output. With several (flash-decoding,
for batches whose ``B x head blocks`` programs leave SMs idle), each split writes its normalised
partial output and log-sum-exp and a second, small kernel merges them: those partials are
extra traffic (``AttentionCost.partial_bytes``), and the merge an extra launch. The
automatic launch (``AttentionConfig.launch``) weighs them against the SMs a split
occupies with a roofline model (``launch_seconds``). Rows with no valid entry produce
zeros.

FP8 rows (``model.kv_layout='fp8'``, ``core.kv_layout``: per entry ``Dl`` float8_e4m3fn
latent values in blocks of 128 with one float32 scale each, then ``Dr`` bf16 rope values,
all as bytes) are gathered as bytes and decoded in the program: the fp8 values become
bf16 exactly (3 mantissa bits of 7), each 128-column block is multiplied with its own
slice of the queries, and the block's scale multiplies the block's scores, and the
softmax weights of the block's output product, in float32. So the tensor cores see the
stored values themselves, no scaled copy rounded to bf16, and a 656-byte row is read
once for every head of the program.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ula_jax.core import kv_layout as kv_layout_lib

_LOG2E = math.log2(math.e)


def _pow2(n: int) -> bool:
  return n >= 1 and not n & (n - 1)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Tuning of the Pallas sparse attention (static and hashable).

  block_h:    heads per program (power of 2, >= 16 for the tensor cores); None: the
              largest of 64, 32 and 16 that fits ``smem_kb`` and gives at least
              ``min_programs`` programs before any split, else the smallest
  block_k:    selected rows per loop step (power of 2, >= 16)
  num_splits: programs per request row and head block along k; None: chosen by
              ``launch_seconds`` among powers of 2
  num_warps:  warps per program; None: 4 for block_h <= 16, else 8
  num_stages: software pipelining stages of the row gathers (Triton)
  num_sms, hbm_gbps, l2_gbps, sm_tflops, merge_us: the GPU as the launch model sees it
              (defaults: an H200; sm_tflops is a tensor-core rate per SM reachable from
              Triton, merge_us the cost of the extra launch that merges splits)
  smem_kb:    shared memory an automatic head block may plan for: the pipelined row
              tiles and the queries (``smem_bytes``); an H200 block may use 227 KB,
              and Triton needs some for itself (64-head blocks of 64-row tiles plan
              216 KB and run)
  min_programs: programs (requests x head blocks) an automatic head block must give
              before any split. Larger head blocks feed the tensor cores full 64-row
              tiles and gather each row once for more heads, but leave fewer programs;
              splits make up for few programs only in part (each writes partials). On
              an H200 (64 heads, k 2048): 64-head blocks were fastest at batch 32 and 64
              (0.29 / 0.34 of copy bandwidth, against 0.22 / 0.26 for 32-head blocks),
              16-head blocks at batch 1 and 8 (0.27 / 0.18, against 0.18 / 0.16)
  preload_slots: a program loads its split's slot list before its loop when the list
              (padded to a power of 2 of ``block_k`` blocks) has at most this many
              entries, so that its row gathers are pipelined ``num_stages - 1`` steps
              ahead; 0: load each step's slots in the loop (gathers one step ahead)
  """

  block_h: int | None = None
  block_k: int = 64
  num_splits: int | None = None
  num_warps: int | None = None
  num_stages: int = 2
  num_sms: int = 132
  hbm_gbps: float = 4000.0
  l2_gbps: float = 10000.0
  sm_tflops: float = 3.0
  merge_us: float = 3.0
  smem_kb: float = 220.0
  min_programs: int = 16
  preload_slots: int = 4096

  def __post_init__(self):
    for name in ("block_h", "block_k"):
      v = getattr(self, name)
      if v is not None and (not _pow2(v) or v < 16):
        raise ValueError(f"{name}={v}: expected a power of 2 >= 16")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"num_splits={self.num_splits}: expected >= 1 (or None)")
    if self.num_warps is not None and not _pow2(self.num_warps):
      raise ValueError(f"num_warps={self.num_warps}: expected a power of 2")
    if self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages}: expected >= 1")
    if self.preload_slots < 0:
      raise ValueError(f"preload_slots={self.preload_slots}: expected >= 0 (0: never)")
    for name in ("num_sms", "hbm_gbps", "l2_gbps", "sm_tflops", "smem_kb", "min_programs"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name}={getattr(self, name)}: expected > 0")

  def warps(self, block_h: int) -> int:
    if self.num_warps is not None:
      return self.num_warps
    return 4 if block_h <= 16 else 8

  def smem_bytes(self, block_h: int, Dl: int, Dr: int, itemsize: int) -> int:
    """Shared memory of a program, roughly: ``num_stages`` row tiles in flight and the
    queries (kept there for the tensor cores)."""
    return (self.num_stages * self.block_k + block_h) * (Dl + Dr) * itemsize

  def launch(self, B: int, H: int, k: int, Dl: int, Dr: int,
             itemsize: int) -> tuple[int, int]:
    """(block_h, splits) for these shapes: the given ones, else the head block of
    ``block_h``'s rule and the splits with the smallest ``launch_seconds`` (ties: fewer
    splits)."""
    blocks = max(pl.cdiv(k, self.block_k), 1)
    if self.block_h is not None:
      heads = [self.block_h]
    else:
      heads = [h for h in (64, 32, 16) if h <= max(16, _next_pow2(H))]
      budget = self.smem_kb * 1024
      heads = [h for h in heads if self.smem_bytes(h, Dl, Dr, itemsize) <= budget] or [16]
      enough = [h for h in heads if B * pl.cdiv(H, h) >= self.min_programs]
      heads = [max(enough) if enough else min(heads)]
    if self.num_splits is not None:
      splits = {_drop_empty(self.num_splits, blocks)}
    else:
      splits = {_drop_empty(1 << i, blocks) for i in range(blocks.bit_length())}
    best = min((launch_seconds(self, B, H, k, Dl, Dr, itemsize, bh, ns), ns, -bh)
               for bh in heads for ns in sorted(splits))
    return -best[2], best[1]


def _drop_empty(splits: int, blocks: int) -> int:
  """Splits that each get a block of k: e.g. 5 blocks in 4 splits are (2, 2, 1), 3."""
  splits = max(1, min(splits, blocks))
  return pl.cdiv(blocks, pl.cdiv(blocks, splits))


def launch_seconds(config: AttentionConfig, B: int, H: int, k: int, Dl: int, Dr: int,
                   itemsize: int, block_h: int, splits: int) -> float:
  """A roofline estimate of one call with this launch: the slowest of HBM traffic (the
  selected rows once, the split partials written and read back), L2 traffic (every head
  block gathers the rows; repeats hit L2) and tensor-core work (the busiest SM's
  programs), plus the merge launch when split. It chooses the launch; the attention
  benchmark prints it beside the measured time."""
  num_hb = pl.cdiv(H, block_h)
  programs = B * num_hb * splits
  rows_per_program = min(k, pl.cdiv(pl.cdiv(k, config.block_k), splits) * config.block_k)
  row_bytes = (Dl + Dr) * itemsize
  partial = 0 if splits == 1 else 2 * B * splits * H * (Dl + 1) * 4
  hbm = B * k * row_bytes + partial
  l2 = B * num_hb * k * row_bytes + partial
  waves = pl.cdiv(programs, config.num_sms)
  work = waves * 2 * block_h * rows_per_program * (2 * Dl + Dr)
  seconds = max(hbm / (config.hbm_gbps * 1e9), l2 / (config.l2_gbps * 1e9),
                work / (config.sm_tflops * 1e12))
  return seconds + (config.merge_us * 1e-6 if splits > 1 else 0.0)


def _attention_kernel(q_lat_ref, q_rope_ref, pool_ref, slots_ref, *out_refs, H: int,
                      k: int, Dl: int, Dr: int, block_h: int, block_k: int,
                      blocks_per_split: int, slot_blocks: int, scale: float,
                      split_out: bool, fp8_blocks: int):
  # q_lat_ref: [B, H, Dl]; q_rope_ref: [B, H, Dr]; pool_ref: [S, Dl + Dr] values, or
  # with fp8_blocks > 0 fp8 rows [S, Dl + 4 fp8_blocks + 2 Dr] uint8
  # slots_ref: [B, k] int32, -1 where not valid
  # out_refs: (o [B, H, Dl] f32,) or (o [B, NS, H, Dl] f32, lse [B, NS, H] f32)
  hb, sp, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  h0 = hb * block_h
  head_ok = (h0 + jnp.arange(block_h, dtype=jnp.int32)) < H  # [bh]
  if fp8_blocks:
    compute = jnp.bfloat16
  else:
    compute = pool_ref.dtype if jnp.dtype(pool_ref.dtype).itemsize == 2 else jnp.float32
  precision = None if compute != jnp.float32 else jax.lax.Precision.HIGHEST
  # The latent columns in blocks: one block of Dl for value rows, the fp8 scale blocks
  # for fp8 rows (each with its own slice of the queries and its own accumulator).
  nblk = max(fp8_blocks, 1)
  width = Dl // nblk
  q_lat = [plgpu.load(q_lat_ref.at[b, pl.ds(h0, block_h), pl.ds(j * width, width)],
                      mask=head_ok[:, None], other=0).astype(compute)
           for j in range(nblk)]  # nblk x [bh, width]
  q_rope = plgpu.load(q_rope_ref.at[b, pl.ds(h0, block_h), :], mask=head_ok[:, None],
                      other=0).astype(compute)  # [bh, Dr]
  # Column indices of each gather, made once outside the loop: the latent blocks' and the
  # rope's (bf16 rows); for fp8 rows also each block's 4 scale bytes, and the rope's
  # low and high bytes.
  blk_cols = jnp.arange(width, dtype=jnp.int32)
  lat_cols = [blk_cols] + [j * width + blk_cols for j in range(1, nblk)]
  if not fp8_blocks:
    rope_cols = Dl + jnp.arange(Dr, dtype=jnp.int32)
  else:
    scale_cols = [Dl + 4 * j + jnp.arange(4, dtype=jnp.int32) for j in range(nblk)]
    rope_lo = Dl + 4 * nblk + 2 * jnp.arange(Dr, dtype=jnp.int32)
    rope_hi = rope_lo + 1
    shifts = (8 * jnp.arange(4, dtype=jnp.uint32))[None, :]
  # Scores in log2 units: exp2 is one instruction, exp a library call.
  scale2 = scale * _LOG2E

  if slot_blocks:
    # The split's whole selection, loaded once. A row gather whose addresses come from
    # a load in the same step is an indirect load, which Triton's pipeliner issues one
    # step ahead whatever ``num_stages`` says; picked out per step by the loop index,
    # the gathers are direct and issued ``num_stages - 1`` steps ahead.
    blk = jnp.arange(slot_blocks, dtype=jnp.int32)[:, None]
    jj = ((sp * blocks_per_split + blk) * block_k
          + jnp.arange(block_k, dtype=jnp.int32)[None, :])
    in_split = (jj < k) & (blk < blocks_per_split)
    split_slots = plgpu.load(slots_ref.at[b, jnp.where(in_split, jj, 0)], mask=in_split,
                             other=-1)  # [slot_blocks, bk]

  def gather(rows, ok, cols):
    # One gather per row for every head of the block. Masked rows load as 0 so that
    # garbage (even NaN) in unused slots cannot leak into the output.
    return plgpu.load(pool_ref.at[rows, cols[None, :]], mask=ok[:, None], other=0)

  def tile(i):
    """Block ``i`` of the split: (valid [bk], latent blocks nblk x [bk, width] in
    ``compute``, their scales nblk x [bk] float32 (None for value rows), rope rows
    [bk, Dr] in ``compute``)."""
    if slot_blocks:
      slot = jnp.max(jnp.where(blk == i, split_slots, -1), axis=0)  # [bk]
    else:
      j0 = (sp * blocks_per_split + i) * block_k
      in_k = (j0 + jnp.arange(block_k, dtype=jnp.int32)) < k
      slot = plgpu.load(slots_ref.at[b, pl.ds(j0, block_k)], mask=in_k, other=-1)  # [bk]
    ok = slot >= 0
    rows = jnp.where(ok, slot, 0)[:, None]
    if not fp8_blocks:
      c = gather(rows, ok, lat_cols[0])
      kr = gather(rows, ok, rope_cols)
      return ok, [c.astype(compute)], None, kr.astype(compute)
    # fp8 rows: latent bytes as float8_e4m3fn (exact in bf16); each block's float32
    # scale from its 4 little-endian bytes; the rope's bf16 values from byte pairs.
    cs = [jax.lax.bitcast_convert_type(gather(rows, ok, cols), jnp.float8_e4m3fn)
          .astype(compute) for cols in lat_cols]
    scales = []
    for cols in scale_cols:
      word = jnp.sum(gather(rows, ok, cols).astype(jnp.uint32) << shifts,
                     axis=1)  # [bk] (the bytes do not overlap)
      scales.append(jax.lax.bitcast_convert_type(word, jnp.float32))
    lo = gather(rows, ok, rope_lo).astype(jnp.uint16)
    hi = gather(rows, ok, rope_hi).astype(jnp.uint16)
    kr = jax.lax.bitcast_convert_type(lo | (hi << 8), jnp.bfloat16).astype(compute)
    return ok, cs, scales, kr

  def body(i, carry):
    m, l, accs = carry  # [bh], [bh], nblk x [bh, width] float32
    ok, cs, scales, kr = tile(i)
    s = None
    for j, c in enumerate(cs):
      sj = plgpu.dot(q_lat[j], c, trans_b=True, precision=precision)
      sj = sj if scales is None else sj * scales[j][None, :]
      s = sj if s is None else s + sj
    s = s + plgpu.dot(q_rope, kr, trans_b=True, precision=precision)
    s = jnp.where(ok[None, :], s * scale2, -jnp.inf)  # [bh, bk]
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # While a row has seen nothing valid, m is -inf: shift by 0 so exp2() gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    accs = tuple(
        acc * alpha[:, None]
        + plgpu.dot((p if scales is None else p * scales[j][None, :]).astype(compute), c,
                    precision=precision)
        for j, (acc, c) in enumerate(zip(accs, cs)))
    return m_new, l, accs

  init = (jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32),
          tuple(jnp.zeros((block_h, width), jnp.float32) for _ in range(nblk)))
  m, l, accs = jax.lax.fori_loop(0, blocks_per_split, body, init)
  outs = [acc / jnp.where(l > 0, l, 1.0)[:, None] for acc in accs]
  if split_out:
    # Natural-log log-sum-exp of the split's scores: ln(2^m * l).
    lse = jnp.where(l > 0, m / _LOG2E + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  for j, o in enumerate(outs):
    where = (b, pl.ds(h0, block_h), pl.ds(j * width, width))
    if split_out:
      where = (b, sp) + where[1:]
    plgpu.store(out_refs[0].at[where], o, mask=head_ok[:, None])
  if split_out:
    plgpu.store(out_refs[1].at[b, sp, pl.ds(h0, block_h)], lse, mask=head_ok)


def merge_splits(o_bshc: jax.Array, lse_bsh: jax.Array) -> jax.Array:
  """Merges per-split normalised outputs by their log-sum-exp (the jnp reference of
  ``merge_splits_pallas``).

  o_bshc: [B, NS, H, Dl] float32; lse_bsh: [B, NS, H] float32 (-inf: split saw nothing)
  returns [B, H, Dl] float32 (zeros where no split saw anything)
  """
  top_bh = jnp.max(lse_bsh, axis=1)
  top_bh = jnp.where(jnp.isfinite(top_bh), top_bh, 0.0)
  w_bsh = jnp.exp(lse_bsh - top_bh[:, None])
  den_bh = jnp.sum(w_bsh, axis=1)
  o_bhc = jnp.sum(w_bsh[..., None] * o_bshc, axis=1)
  return o_bhc / jnp.where(den_bh > 0, den_bh, 1.0)[..., None]


# Merge kernel tile: heads x latent columns per program (small, so that even batch 1
# spreads the partials over dozens of programs).
MERGE_BLOCK_H = 16
MERGE_BLOCK_C = 64


def _merge_kernel(o_ref, lse_ref, out_ref, *, H: int, splits: int, block_h: int,
                  block_c: int):
  # o_ref: [B, NS, H, Dl] f32; lse_ref: [B, NS, H] f32; out_ref: [B, H, Dl] f32
  cb, hb, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  h0, c0 = hb * block_h, cb * block_c
  head_ok = (h0 + jnp.arange(block_h, dtype=jnp.int32)) < H  # [bh]

  def body(sp, carry):  # one pass, rescaling as a larger log-sum-exp shows up
    m, den, acc = carry  # [bh], [bh], [bh, bc]
    lse = plgpu.load(lse_ref.at[b, sp, pl.ds(h0, block_h)], mask=head_ok, other=-jnp.inf)
    o = plgpu.load(o_ref.at[b, sp, pl.ds(h0, block_h), pl.ds(c0, block_c)],
                   mask=head_ok[:, None], other=0.0)
    m_new = jnp.maximum(m, lse)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha, w = jnp.exp(m - m_safe), jnp.exp(lse - m_safe)
    return m_new, den * alpha + w, acc * alpha[:, None] + w[:, None] * o

  init = (jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32),
          jnp.zeros((block_h, block_c), jnp.float32))
  _, den, acc = jax.lax.fori_loop(0, splits, body, init)
  out = acc / jnp.where(den > 0, den, 1.0)[:, None]
  plgpu.store(out_ref.at[b, pl.ds(h0, block_h), pl.ds(c0, block_c)], out,
              mask=head_ok[:, None])


def merge_splits_pallas(o_bshc: jax.Array, lse_bsh: jax.Array, *,
                        interpret: bool | None = None) -> jax.Array:
  """``merge_splits`` as one kernel launch (XLA would take several reductions).

  o_bshc: [B, NS, H, Dl] float32 (Dl a power of 2); lse_bsh: [B, NS, H] float32
  returns [B, H, Dl] float32
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  B, NS, H, Dl = o_bshc.shape
  block_c = min(MERGE_BLOCK_C, Dl)
  kernel = functools.partial(_merge_kernel, H=H, splits=NS, block_h=MERGE_BLOCK_H,
                             block_c=block_c)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((B, H, Dl), jnp.float32),
      grid=(pl.cdiv(Dl, block_c), pl.cdiv(H, MERGE_BLOCK_H), B),
      in_specs=[any_spec] * 2,
      out_specs=any_spec,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      name="ula_sparse_mla_attention_merge",
  )(o_bshc, lse_bsh)


@dataclasses.dataclass(frozen=True)
class AttentionCost:
  """What one call moves and computes (for the benchmark's explanation of a rate).

  must_read:     bytes any implementation must read: the k selected rows per request
                 and the queries
  partial_bytes: split partial outputs and log-sum-exps, written then read by the merge
  row_reads:     selected-row bytes gathered by all programs (head blocks re-read a
                 request's rows; L2 absorbs the repeats when they run side by side)
  flops:         tensor-core FLOPs (scores and outputs)
  block_h, splits, programs, num_warps: the launch
  model_us:      the launch model's estimate (``launch_seconds``)
  """

  must_read: int
  partial_bytes: int
  row_reads: int
  flops: int
  block_h: int
  splits: int
  programs: int
  num_warps: int
  model_us: float


def attention_cost(B: int, H: int, k: int, Dl: int, Dr: int, pool_dtype, q_dtype,
                   config: AttentionConfig | None = None) -> AttentionCost:
  """The cost of ``sparse_mla_attention_pallas`` on these shapes (see ``AttentionCost``)."""
  config = config or AttentionConfig()
  itemsize = jnp.dtype(pool_dtype).itemsize
  bh, ns = config.launch(B, H, k, Dl, Dr, itemsize)
  num_hb = pl.cdiv(H, bh)
  partial = 0 if ns == 1 else 2 * B * ns * H * (Dl + 1) * 4
  return AttentionCost(
      must_read=bytes_read(B, H, k, Dl, Dr, pool_dtype, q_dtype), partial_bytes=partial,
      row_reads=B * num_hb * k * (Dl + Dr) * itemsize, flops=2 * B * H * k * (2 * Dl + Dr),
      block_h=bh, splits=ns, programs=B * num_hb * ns, num_warps=config.warps(bh),
      model_us=launch_seconds(config, B, H, k, Dl, Dr, itemsize, bh, ns) * 1e6)


def sparse_mla_attention_pallas(q_lat: jax.Array, q_rope: jax.Array, pool: jax.Array,
                                slots: jax.Array, valid: jax.Array, *, scale: float,
                                config: AttentionConfig | None = None,
                                interpret: bool | None = None,
                                kv_layout: str = "bf16") -> jax.Array:
  """Attention of every head over the selected pool rows (Pallas).

  q_lat:  [B, H, Dl] latent queries; q_rope: [B, H, Dr] rotary queries
  pool:   [S, Dl + Dr] entries, bf16/f16 (tensor-core dots, f32 accumulation) or f32;
          with ``kv_layout='fp8'`` their fp8 rows [S, Dl + 4 Dl/128 + 2 Dr] uint8
          (``core.kv_layout``; bf16 tensor-core dots of the stored fp8 values, each
          128-column block's scale applied in float32)
  slots:  [B, k] int32 pool rows (ignored where not valid; clamped into [0, S))
  valid:  [B, k] bool
  scale:  softmax scale; config: tuning (``AttentionConfig``; fp8 rows launch as bf16
          rows of the same shape would)
  interpret: Pallas interpret mode (None: interpret everywhere but on GPU)
  kv_layout: 'bf16' (rows of values) or 'fp8'
  Dl and Dr must be powers of 2 (Triton block shapes), >= 16 on GPU.
  returns o_lat: [B, H, Dl] float32
  """
  config = config or AttentionConfig()
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  kv_layout_lib.check_kind(kv_layout)
  B, H, Dl = q_lat.shape
  Dr = q_rope.shape[-1]
  S, k = pool.shape[0], slots.shape[1]
  if not (_pow2(Dl) and _pow2(Dr)):
    raise ValueError(f"q_lat.shape[-1]={Dl}, q_rope.shape[-1]={Dr}: the Pallas kernel needs "
                     "powers of 2 (use impl='xla' otherwise)")
  fp8_blocks = 0
  if kv_layout == "fp8":
    kv_layout_lib.check_fp8_pool(pool, Dl, Dr)
    fp8_blocks = Dl // kv_layout_lib.FP8_BLOCK
    itemsize = 2  # launched as the bf16 rows the values become
  else:
    if pool.shape[1] != Dl + Dr:
      raise ValueError(f"pool.shape={tuple(pool.shape)}: expected [S, Dl + Dr] = "
                       f"[S, {Dl + Dr}]")
    itemsize = jnp.dtype(pool.dtype).itemsize
  if B == 0 or H == 0 or k == 0 or S == 0:
    return jnp.zeros((B, H, Dl), jnp.float32)
  # One int32 list for the kernel: -1 where not valid; valid slots are clamped into the
  # pool like the reference does.
  slots = jnp.where(valid, jnp.clip(slots, 0, S - 1), -1).astype(jnp.int32)

  block_h, splits = config.launch(B, H, k, Dl, Dr, itemsize)
  num_hb = pl.cdiv(H, block_h)
  blocks_per_split = pl.cdiv(pl.cdiv(k, config.block_k), splits)
  split_out = splits > 1
  slot_blocks = _next_pow2(blocks_per_split)
  if slot_blocks * config.block_k > config.preload_slots:
    slot_blocks = 0
  kernel = functools.partial(
      _attention_kernel, H=H, k=k, Dl=Dl, Dr=Dr, block_h=block_h, block_k=config.block_k,
      blocks_per_split=blocks_per_split, slot_blocks=slot_blocks, scale=float(scale),
      split_out=split_out, fp8_blocks=fp8_blocks)
  if split_out:
    out_shape = (jax.ShapeDtypeStruct((B, splits, H, Dl), jnp.float32),
                 jax.ShapeDtypeStruct((B, splits, H), jnp.float32))
  else:
    out_shape = (jax.ShapeDtypeStruct((B, H, Dl), jnp.float32),)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(num_hb, splits, B),
      in_specs=[any_spec] * 4,
      out_specs=tuple(any_spec for _ in out_shape),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.warps(block_h),
                                           num_stages=config.num_stages),
      name="ula_sparse_mla_attention" + ("_fp8" if fp8_blocks else ""),
  )(q_lat, q_rope, pool, slots)
  if split_out:
    return merge_splits_pallas(*outs, interpret=interpret)
  return outs[0]


def bytes_read(B: int, H: int, k: int, Dl: int, Dr: int, pool_dtype, q_dtype,
               kv_layout: str = "bf16") -> int:
  """Bytes a sparse decode step must read: the k selected rows of every request and the
  queries (what the attention benchmark divides by time). With ``kv_layout='fp8'`` a
  row is its fp8 bytes (``pool_dtype`` is then ignored)."""
  row = kv_layout_lib.row_width(kv_layout, Dl, Dr)
  row *= jnp.dtype(pool_dtype).itemsize if kv_layout == "bf16" else 1
  return B * k * row + B * H * (Dl + Dr) * jnp.dtype(q_dtype).itemsize


__all__ = ["AttentionConfig", "AttentionCost", "attention_cost", "bytes_read",
           "launch_seconds", "merge_splits", "merge_splits_pallas",
           "sparse_mla_attention_pallas"]
