"""Indexer scores as a Pallas kernel (Triton on GPU, interpret mode on CPU).

Same contract as ``blocked.index_scores_blocked``. One program per (``block_n`` rows,
``block_t`` positions) tile: it loads the tile's keys once and walks the indexer heads,
per head one tensor-core matmul ``[block_n, K] x [K, block_t]`` with float32
accumulation, whose ReLU times the head weight is added to a float32 accumulator in
registers, so the per-head products never reach memory (the jnp form writes and reads
``[N, I, block_t]`` per tile). A tile past every one of its rows' limits (a causal
prefill chunk's later positions) exits at once and writes nothing.

Operands as ``reference.score_operands``: bf16 queries and keys on the tensor cores with
the ``1 / sqrt(K)`` scale in the head weights; float32 ones at full precision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ula_jax.kernels.indexer.reference import low_precision, score_operands
from ula_jax.kernels.indexer.topk import ordered_key

F32 = jnp.float32


def _pow2(n: int) -> bool:
  return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
  """Launch of the Pallas indexer scores (static, hashable).

  block_n: rows per program (a power of 2 >= 16: the matmul's M)
  block_t: positions per program (a power of 2 >= 16: the matmul's N, the accumulator's
           width in registers)
  num_warps, num_stages: Triton's warps per program and software-pipelining stages (the
           per-head query loads run ahead of the matmuls)
  """

  block_n: int = 64
  block_t: int = 256
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_n", "block_t"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or not _pow2(v) or v < 16:
        raise ValueError(f"IndexerConfig.{name}={v!r}: expected a power of 2 >= 16")
    if not _pow2(self.num_warps):
      raise ValueError(f"IndexerConfig.num_warps={self.num_warps!r}: expected a power of 2")
    if self.num_stages < 1:
      raise ValueError(f"IndexerConfig.num_stages={self.num_stages!r}: expected >= 1")

  @property
  def label(self) -> str:
    """A short name of the launch, e.g. ``n64t256w8s3``."""
    return f"n{self.block_n}t{self.block_t}w{self.num_warps}s{self.num_stages}"

  @classmethod
  def parse(cls, token: str) -> IndexerConfig:
    """``label`` back into a config (fields left out keep their defaults): 'n64t128w4'."""
    import re
    m = re.fullmatch(r"(?:n(\d+))?(?:t(\d+))?(?:w(\d+))?(?:s(\d+))?", token.strip())
    if not token.strip() or not m:
      raise ValueError(f"indexer config {token!r}: expected e.g. 'n64t256w8s3' (n: block_n, "
                       "t: block_t, w: num_warps, s: num_stages; each optional)")
    names = ("block_n", "block_t", "num_warps", "num_stages")
    return cls(**{n: int(v) for n, v in zip(names, m.groups()) if v is not None})


def _scores_kernel(q_ref, w_ref, keys_ref, limit_ref, o_ref, *, heads: int, block_n: int,
                   block_t: int, precision):
  # q_ref: [I, N, K] queries by head; w_ref: [I, N] f32 head weights (scale folded in
  # where the operands are 16-bit); keys_ref: [T, K]; limit_ref: [N] int32
  # o_ref: [N, T] f32
  nb, tb = pl.program_id(0), pl.program_id(1)
  n0, t0 = nb * block_n, tb * block_t
  limit = plgpu.load(limit_ref.at[pl.ds(n0, block_n)])  # [bn]

  @pl.when(t0 < jnp.max(limit))
  def _():
    keys = plgpu.load(keys_ref.at[pl.ds(t0, block_t), :])  # [bt, K]

    def head(i, acc):
      q = plgpu.load(q_ref.at[i, pl.ds(n0, block_n), :])  # [bn, K]
      w = plgpu.load(w_ref.at[i, pl.ds(n0, block_n)])  # [bn]
      s = plgpu.dot(q, keys, trans_b=True, precision=precision)  # [bn, bt] f32
      return acc + w[:, None] * jnp.maximum(s, 0.0)

    acc = jax.lax.fori_loop(0, heads, head, jnp.zeros((block_n, block_t), F32))
    plgpu.store(o_ref.at[pl.ds(n0, block_n), pl.ds(t0, block_t)], acc)


def index_scores_pallas(q_nik: jax.Array, w_ni: jax.Array, keys_tk: jax.Array,
                        limit_n: jax.Array, *, config: IndexerConfig | None = None,
                        interpret: bool | None = None) -> jax.Array:
  """Indexer scores of rows against shared keys (Pallas); ``index_scores_blocked``'s
  contract.

  q_nik: [N, I, K] (K a power of 2 >= 16); w_ni: [N, I]; keys_tk: [T, K]
  limit_n: [N] int32: row n's candidates are the positions t < limit_n[n]
  config: the launch (``IndexerConfig``); rows and positions are padded to its blocks
  interpret: Pallas interpret mode (None: everywhere but on GPU)
  returns [N, T] float32: the scores at t < limit_n[n]; elsewhere unspecified
  """
  config = config or IndexerConfig()
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  N, I, K = q_nik.shape
  T = keys_tk.shape[0]
  if not _pow2(K) or K < 16:
    raise ValueError(f"q_nik.shape[-1]={K}: the Pallas indexer needs a power of 2 >= 16 "
                     "(use kernels.indexer='xla' otherwise)")
  if keys_tk.shape != (T, K) or w_ni.shape != (N, I) or limit_n.shape != (N,):
    raise ValueError(f"q_nik {tuple(q_nik.shape)}, w_ni {tuple(w_ni.shape)}, keys_tk "
                     f"{tuple(keys_tk.shape)}, limit_n {tuple(limit_n.shape)}: expected "
                     "[N, I, K], [N, I], [T, K] and [N]")
  if N == 0 or T == 0:
    return jnp.zeros((N, T), F32)
  q, w, keys = score_operands(q_nik, w_ni, keys_tk)
  precision = None if low_precision(q_nik, keys_tk) else jax.lax.Precision.HIGHEST
  Np = -(-N // config.block_n) * config.block_n
  Tp = -(-T // config.block_t) * config.block_t
  q_ink = jnp.pad(jnp.swapaxes(q, 0, 1), ((0, 0), (0, Np - N), (0, 0)))
  w_in = jnp.pad(w.T, ((0, 0), (0, Np - N)))
  keys = jnp.pad(keys, ((0, Tp - T), (0, 0)))
  limit = jnp.pad(limit_n.astype(jnp.int32), (0, Np - N))  # padded rows: no candidates
  kernel = functools.partial(_scores_kernel, heads=I, block_n=config.block_n,
                             block_t=config.block_t, precision=precision)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((Np, Tp), F32),
      grid=(Np // config.block_n, Tp // config.block_t),
      in_specs=[any_spec] * 4,
      out_specs=any_spec,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      name="ula_indexer_scores",
  )(q_ink, w_in, keys, limit)
  return out if (Np, Tp) == (N, T) else out[:N, :T]


# --- Radix select's counting passes -----------------------------------------------------

COUNT_BLOCK_T = 256  # positions per step of a counting program
COUNT_SEGMENT = 8192  # positions per counting program (a row's programs add up)


def _counts_kernel(scores_ref, limit_ref, thr_ref, o_ref, *, block_t: int, steps: int):
  # scores_ref: [N, T] f32; limit_ref: [N] int32 (candidates t < limit); thr_ref: [N, D]
  # int32 thresholds in the signed order of ``signed_key``; o_ref: [N, S, D] int32: how
  # many of segment s's keys are >= each threshold
  # A segment past the row's limit holds no candidate: it counts the keys of -inf, which
  # the caller adds (``prefix_kth_largest_pallas``), and reads nothing.
  n, seg = pl.program_id(0), pl.program_id(1)
  limit = plgpu.load(limit_ref.at[pl.ds(n, 1)])  # [1]
  thr = plgpu.load(thr_ref.at[n, :])  # [D]
  lanes = jnp.arange(block_t, dtype=jnp.int32)
  first = seg * steps * block_t
  live = first < jnp.max(limit)

  def step(j, acc):  # [bt, D]: per lane, summed across lanes once at the end
    t0 = first + j * block_t
    x = plgpu.load(scores_ref.at[n, pl.ds(t0, block_t)])  # [bt]
    x = jnp.where(t0 + lanes < limit, x, -jnp.inf)
    key = _signed_key(x)
    return acc + (key[:, None] >= thr[None, :]).astype(jnp.int32)

  @pl.when(live)
  def _():
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_t, thr.shape[0]), jnp.int32))
    plgpu.store(o_ref.at[n, seg, :], jnp.sum(acc, axis=0))

  @pl.when(jnp.logical_not(live))
  def _():
    plgpu.store(o_ref.at[n, seg, :], jnp.zeros(thr.shape, jnp.int32))


def _signed_key(x: jax.Array) -> jax.Array:
  """float32 -> int32 in the float's total order under signed comparison (the negative
  floats' magnitude bits flipped): ``topk.ordered_key`` with its top bit flipped."""
  i = jax.lax.bitcast_convert_type(x, jnp.int32)
  return i ^ (jax.lax.shift_right_arithmetic(i, 31) & 0x7FFFFFFF)


def _signed(key: jax.Array) -> jax.Array:
  """uint32 keys (``ordered_key``) as the int32 of ``_signed_key``: the same order."""
  return jax.lax.bitcast_convert_type(key ^ jnp.uint32(1 << 31), jnp.int32)


def prefix_kth_largest_pallas(scores_nt: jax.Array, limit_n: jax.Array, k: int, *,
                              radix_bits: int, interpret: bool | None = None,
                              segment: int = COUNT_SEGMENT) -> jax.Array:
  """``topk.kth_largest_key`` of the keys of ``scores_nt`` with candidates ``t <
  limit_n[n]`` (``topk.ordered_key`` of the scores, -inf elsewhere), its counting passes
  as Pallas kernels that read the scores once a pass and compute the keys on the fly.

  scores_nt: [N, T] float32 with T >= k (a multiple of 16, else padded: a copy);
  limit_n: [N] int32 in [0, T]; radix_bits: bits per pass (divides 32, at most 4)
  segment: positions per counting program (rounded to whole steps of the row)
  returns [N] uint32
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if 32 % radix_bits or radix_bits > 4:
    raise ValueError(f"radix_bits={radix_bits}: must divide 32 and be at most 4")
  N, T = scores_nt.shape
  if T % 16:  # padded positions are past every limit: never candidates
    scores_nt = jnp.pad(scores_nt, ((0, 0), (0, 16 - T % 16)))
    T = scores_nt.shape[1]
  block_t = min(COUNT_BLOCK_T, T & -T)  # the largest power of 2 dividing T, at most 256
  steps = max(1, min(segment // block_t, T // block_t))
  while (T // block_t) % steps:
    steps //= 2
  segments = T // block_t // steps
  D = 1 << radix_bits  # thresholds per pass and one ignored (a power of 2 for Triton)
  used = D - 1
  digits = jnp.arange(1, D + 1, dtype=jnp.uint32)
  kernel = functools.partial(_counts_kernel, block_t=block_t, steps=steps)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  count = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((N, segments, D), jnp.int32),
      grid=(N, segments),
      in_specs=[any_spec] * 3,
      out_specs=any_spec,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      name="ula_indexer_radix_counts",
  )
  limit = limit_n.astype(jnp.int32)
  # Keys of -inf in the segments past a row's limit, which its programs did not read.
  skipped = T - jnp.minimum(-(-limit // (steps * block_t)) * steps * block_t, T)
  minus_inf = ordered_key(jnp.float32(-jnp.inf))

  def one_pass(p, prefix):  # as ``topk.kth_largest_key``'s
    shift = (32 - radix_bits * (p + 1)).astype(jnp.uint32)
    thr = prefix[:, None] | (jnp.minimum(digits, used) << shift)[None, :]
    counts = jnp.sum(count(scores_nt, limit, _signed(thr)), axis=1)[:, :used]  # [N, D - 1]
    counts = counts + jnp.where(minus_inf >= thr[:, :used], skipped[:, None], 0)
    digit = jnp.sum(counts >= k, axis=1, dtype=jnp.int32).astype(jnp.uint32)
    return prefix | (digit << shift)

  return jax.lax.fori_loop(0, 32 // radix_bits, one_pass, jnp.zeros((N,), jnp.uint32))


__all__ = ["COUNT_BLOCK_T", "IndexerConfig", "index_scores_pallas",
           "prefix_kth_largest_pallas"]
