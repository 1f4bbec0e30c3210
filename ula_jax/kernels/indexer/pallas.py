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

from ula_jax.kernels import byte_offsets_overflow
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


# --- A decode step's scores, page by page ----------------------------------------------


def _fp8_keys(keys_ref, row0, page: int, K: int, dtype):
  """Rows ``row0 .. row0 + page`` of an fp8 key table (``kv_layout.quantize_key``'s K
  e4m3 bytes, then a little-endian float32 scale) decoded as ``KeyLayout.decode`` does:
  [page, K] in ``dtype``."""
  codes = plgpu.load(keys_ref.at[pl.ds(row0, page), pl.ds(0, K)])  # [page, K] uint8
  word = jnp.zeros((page, 1), jnp.int32)
  for i in range(4):  # the scale's bytes, one column each
    byte = plgpu.load(keys_ref.at[pl.ds(row0, page), pl.ds(K + i, 1)]).astype(jnp.int32)
    word = word | jax.lax.shift_left(byte, jnp.int32(8 * i))
  scale = jax.lax.bitcast_convert_type(word, F32)  # [page, 1]
  values = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(F32)
  return (values * scale).astype(dtype)


def _page_scores_kernel(q_ref, w_ref, keys_ref, pt_ref, len_ref, grp_ref, o_ref, *,
                        page: int, pages_per: int, num_logical: int, f32_keys: bool,
                        precision, fp8_dim: int | None, key_dtype):
  # q_ref: [B, I, K] queries by row (I padded to >= 16 with zero weights); w_ref: [B, I]
  # f32 head weights; keys_ref: [G * N, K] every group's keys by logical address (fp8:
  # [G * N, K + 4] bytes, ``fp8_dim`` = K, decoded into ``key_dtype``);
  # pt_ref: [B, P] int32 page ids; len_ref: [B] int32 positions to score; grp_ref: [1]
  # int32 the layer group; o_ref: [B, P * page] f32
  b, j = pl.program_id(0), pl.program_id(1)
  block = pages_per * page
  t0 = j * block
  length = jnp.max(plgpu.load(len_ref.at[pl.ds(b, 1)]))
  lanes = jnp.arange(page, dtype=jnp.int32)

  @pl.when(t0 < length)
  def _():
    base = jnp.max(plgpu.load(grp_ref.at[pl.ds(0, 1)])) * num_logical
    q = plgpu.load(q_ref.at[b, :, :])  # [I, K]
    w = plgpu.load(w_ref.at[b, :])  # [I]
    for m in range(pages_per):  # static: a few pages per program
      page_id = jnp.max(plgpu.load(pt_ref.at[b, pl.ds(j * pages_per + m, 1)]))
      row0 = base + jnp.maximum(page_id, 0) * page
      if fp8_dim is not None:
        keys = _fp8_keys(keys_ref, row0, page, fp8_dim, key_dtype)
      else:
        keys = plgpu.load(keys_ref.at[pl.ds(row0, page), :])  # [page, K]
      if f32_keys:
        keys = keys.astype(F32)
      s = plgpu.dot(q, keys, trans_b=True, precision=precision)  # [I, page] f32
      scores = jnp.sum(w[:, None] * jnp.maximum(s, 0.0), axis=0)  # [page]
      t = t0 + m * page + lanes
      plgpu.store(o_ref.at[b, pl.ds(t0 + m * page, page)],
                  jnp.where(t < length, scores, -jnp.inf))

  @pl.when(t0 >= length)
  def _():
    plgpu.store(o_ref.at[b, pl.ds(t0, block)], jnp.full((block,), -jnp.inf, F32))


def pages_fit(page_size: int, index_dim: int) -> bool:
  """Whether ``page_scores_pallas`` (``kernels.decode_scores='pages'``) takes pages of
  ``page_size`` positions and keys of ``index_dim`` values: both powers of 2 >= 16."""
  return all(_pow2(n) and n >= 16 for n in (page_size, index_dim))


PAGES_PER_PROGRAM = 2  # pages one decode-scores program reads (128 positions at 64 a page)


def page_scores_pallas(q_bik: jax.Array, w_bi: jax.Array, keys_gnk: jax.Array,
                       group: jax.Array | int, page_table: jax.Array, length: jax.Array,
                       page_size: int, *, pages_per: int = PAGES_PER_PROGRAM,
                       fp8_keys: bool = False, key_dtype=None,
                       interpret: bool | None = None) -> jax.Array:
  """A decode step's indexer scores, each row over its own pages (Pallas): one program
  per (row, ``pages_per`` pages); a program past its row's length writes -inf and reads
  nothing, so the work follows the rows' lengths with no loop on the host's side (no
  trip count to read back) and no gathered copy of the keys.

  q_bik: [B, I, K] index queries (K a power of 2 >= 16); w_bi: [B, I] float32 weights
  keys_gnk: [G, N, K] every group's keys by logical address (``page * page_size + o``);
            with ``fp8_keys`` [G, N, K + 4] uint8 rows of ``kv_layout.quantize_key``,
            decoded in the kernel into ``key_dtype`` (None: the queries') as
            ``KeyLayout.decode`` does
  group: [] int32 the layer group; page_table: [B, P] int32 page ids (-1: none)
  length: [B] int32 positions to score per row (0: idle); page_size a power of 2 >= 16
  returns [B, P * page_size] float32: ``index_scores`` of the row's keys at positions
          < length (products as ``score_operands``; the heads summed in another order, so
          a few ulp from the jnp form), -inf elsewhere
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  B, I, K = q_bik.shape
  G, N, _ = keys_gnk.shape
  P = page_table.shape[1]
  if not pages_fit(page_size, K):
    raise ValueError(f"index keys of {K} values, engine.page_size={page_size}: the page "
                     "scores kernel needs powers of 2 >= 16 (use "
                     "kernels.decode_scores='lengths' otherwise)")
  if fp8_keys and keys_gnk.dtype != jnp.uint8:
    raise ValueError(f"keys_gnk: got {keys_gnk.dtype}, expected uint8 fp8 key rows")
  if fp8_keys and not interpret and byte_offsets_overflow(keys_gnk):  # wrong keys read
    raise ValueError(
        f"fp8 key table of {keys_gnk.size} bytes ({keys_gnk.size / 2**30:.2f} GiB): the "
        "page scores kernel cannot index byte tables of 2-4 GiB (32-bit element offsets); "
        "use kernels.decode_scores='lengths' or pools that put the table outside that range")
  if keys_gnk.shape[-1] != K + (4 if fp8_keys else 0) or w_bi.shape != (B, I) \
      or page_table.shape[0] != B or length.shape != (B,):
    raise ValueError(f"q_bik {tuple(q_bik.shape)}, w_bi {tuple(w_bi.shape)}, keys_gnk "
                     f"{tuple(keys_gnk.shape)}, page_table {tuple(page_table.shape)}, "
                     f"length {tuple(length.shape)}: expected [B, I, K], [B, I], "
                     "[G, N, K], [B, P] and [B]")
  # What the products read: the stored keys, or the fp8 keys decoded.
  key_dtype = (jnp.dtype(key_dtype or q_bik.dtype) if fp8_keys else keys_gnk.dtype)
  low = low_precision(q_bik, jax.ShapeDtypeStruct((), key_dtype))
  scale = K ** -0.5
  q, w = ((q_bik, w_bi.astype(F32) * scale) if low
          else (q_bik.astype(F32) * scale, w_bi.astype(F32)))
  Ip = max(16, 1 << (I - 1).bit_length())  # the matmul's M: a power of 2 >= 16
  q = jnp.pad(q, ((0, 0), (0, Ip - I), (0, 0)))
  w = jnp.pad(w, ((0, 0), (0, Ip - I)))  # padded heads weigh nothing
  pages_per = max(1, min(pages_per, P))
  Pp = -(-P // pages_per) * pages_per
  pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, Pp - P)), constant_values=-1)
  n = jnp.clip(length.astype(jnp.int32), 0, P * page_size)
  grp = jnp.reshape(jnp.asarray(group, jnp.int32), (1,))
  kernel = functools.partial(_page_scores_kernel, page=page_size, pages_per=pages_per,
                             num_logical=N, f32_keys=not low,
                             precision=None if low else jax.lax.Precision.HIGHEST,
                             fp8_dim=K if fp8_keys else None, key_dtype=key_dtype)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((B, Pp * page_size), F32),
      grid=(B, Pp // pages_per),
      in_specs=[any_spec] * 6,
      out_specs=any_spec,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      name="ula_indexer_page_scores",
  )(q, w, keys_gnk.reshape(G * N, keys_gnk.shape[-1]), pt, n, grp)
  return out[:, :P * page_size]


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


__all__ = ["COUNT_BLOCK_T", "PAGES_PER_PROGRAM", "IndexerConfig", "index_scores_pallas",
           "page_scores_pallas", "pages_fit", "prefix_kth_largest_pallas"]
