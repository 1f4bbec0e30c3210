"""A decode step's indexer scores over each row's own history (``kernels.indexer.decode``)
against the whole-window reference (``index_scores`` of every row's gathered keys)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.core.types import INVALID
from ula_jax.kernels.indexer import index_scores, select_topk
from ula_jax.kernels.indexer.decode import length_scores


def _case(seed, B, T, I, K, dtype, idle_frac=0.3, n_keys=None):
  rng = np.random.default_rng(seed)
  n_keys = n_keys or 2 * T
  keys = jnp.asarray(rng.standard_normal((n_keys, K)), dtype)
  q = jnp.asarray(rng.standard_normal((B, I, K)), dtype)
  w = jnp.asarray(rng.standard_normal((B, I)), jnp.float32)
  # Each row's history: distinct addresses for its positions, INVALID past its pages.
  length = rng.integers(1, T + 1, B)
  length[rng.random(B) < idle_frac] = 0
  addr = np.full((B, T), INVALID, np.int32)
  for b in range(B):
    pages = -(-max(length[b], 1) // 16) * 16
    addr[b, :min(pages, T)] = rng.permutation(n_keys)[:min(pages, T)]
  return q, w, jnp.asarray(addr), jnp.asarray(length, jnp.int32), keys


def _gather(keys):
  return lambda a: keys[jnp.clip(a, 0, keys.shape[0] - 1)]


@pytest.mark.parametrize("B,T,block_rows,block_t,dtype", [
    (5, 300, 2, 64, jnp.bfloat16),    # neither axis a multiple of its block
    (8, 256, 8, 256, jnp.float32),    # one block each way
    (3, 1000, 4, 128, jnp.bfloat16),  # more rows per block than rows
    (16, 512, 3, 100, jnp.float32),
])
def test_length_scores_match_the_whole_window(B, T, block_rows, block_t, dtype):
  q, w, addr, length, keys = _case(B * T, B, T, I=4, K=32, dtype=dtype)
  fn = jax.jit(lambda *a: length_scores(*a, _gather(keys), block_rows=block_rows,
                                        block_t=block_t))
  got = np.asarray(fn(q, w, addr, length))
  full = np.asarray(index_scores(q, w, _gather(keys)(addr)))
  n = np.asarray(length)
  scored = np.arange(T)[None, :] < n[:, None]
  assert scored.any() and (~scored).any()
  # The same products; a GEMM of another shape may round differently by a few ulp.
  np.testing.assert_allclose(got[scored], full[scored], rtol=1e-5, atol=1e-5)
  # The top-k over each row's history: the same positions in the same order.
  active, positions = jnp.asarray(n > 0), jnp.asarray(n - 1)
  cand = (addr >= 0) & (jnp.arange(T)[None, :] <= positions[:, None]) & active[:, None]
  for k in (1, 7, T // 3):
    np.testing.assert_array_equal(np.asarray(select_topk(jnp.asarray(got), cand, k)[0]),
                                  np.asarray(select_topk(jnp.asarray(full), cand, k)[0]))


def test_a_rows_scores_do_not_depend_on_the_other_rows():
  # The same row, alone or among others, first or last, longest or not: the same bits
  # (so memory systems and batches agree, whatever else runs).
  B, T = 7, 600
  q, w, addr, length, keys = _case(3, B, T, I=4, K=32, dtype=jnp.bfloat16, idle_frac=0.0)
  fn = jax.jit(lambda *a: length_scores(*a, _gather(keys), block_rows=3, block_t=128))
  base = np.asarray(fn(q, w, addr, length))
  perm = np.random.default_rng(0).permutation(B)
  shuffled = np.asarray(fn(q[perm], w[perm], addr[perm], length[perm]))
  alone = np.asarray(fn(q, w, addr, jnp.where(jnp.arange(B) == 2, length, 0)))
  n = np.asarray(length)
  for b in range(B):
    np.testing.assert_array_equal(shuffled[np.argsort(perm)[b], :n[b]], base[b, :n[b]])
  np.testing.assert_array_equal(alone[2, :n[2]], base[2, :n[2]])


def test_every_row_idle_scores_nothing():
  q, w, addr, _, keys = _case(0, 4, 64, I=2, K=16, dtype=jnp.float32)
  out = length_scores(q, w, addr, jnp.zeros(4, jnp.int32), _gather(keys))
  assert out.shape == (4, 64) and np.all(np.asarray(out) == -np.inf)


def test_only_the_blocks_some_row_needs_are_gathered():
  # One row of 10 positions among idle rows: a single (row block, column block) is read.
  B, T = 6, 400
  q, w, addr, _, keys = _case(1, B, T, I=2, K=16, dtype=jnp.float32)
  length = jnp.asarray([0, 0, 10, 0, 0, 0], jnp.int32)
  shapes = []

  def gather(a):
    jax.debug.callback(lambda x: shapes.append(x.shape), a)
    return keys[jnp.clip(a, 0)]

  jax.block_until_ready(length_scores(q, w, addr, length, gather, block_rows=2, block_t=64))
  assert [s for s in shapes if s != (1, 1)] == [(2, 64)]  # (1, 1): the type probe


def test_bad_blocks_are_refused():
  q, w, addr, length, keys = _case(2, 2, 32, I=2, K=8, dtype=jnp.float32)
  with pytest.raises(ValueError, match="block_rows=0"):
    length_scores(q, w, addr, length, lambda a: keys[a], block_rows=0)


def _serve_each(base, systems, requests, *, decode_scores):
  """Each of ``systems`` (name -> overrides after ``base``) serves ``requests``: every
  request finishes, the summary states ``decode_scores``, every system but resident
  misses. Returns ({name: {request id: tokens}}, {name: summary})."""
  from tests.engine_util import run_engine
  tokens, summaries = {}, {}
  for name, over in systems.items():
    result = run_engine(base + over, requests)
    assert all(r.status == "finished" for r in result.requests), name
    tokens[name] = {r.id: r.output_tokens for r in result.requests}
    summaries[name] = result.summary
    assert result.summary["decode_scores"] == decode_scores, name
    if name != "resident":
      assert result.summary.get("total_misses", 0) > 0, name
  return tokens, summaries


def test_systems_scoring_by_length_decode_residents_tokens(monkeypatch):
  """Engines with kernels.decode_scores=lengths and blocks far smaller than the window
  (2 rows x 16 positions; rows of different lengths, idle rows, evicting pools): ula
  and hisparse decode resident's tokens. ula takes its top-k by the radix select and
  runs three decode steps per dispatch (the scoring loops inside the dispatch's device
  loop), resident and hisparse by the sort: the same picks in the same order."""
  from ula_jax.kernels.indexer import decode
  from tests.engine_util import DENSE, make_requests
  monkeypatch.setattr(decode, "BLOCK_ROWS", 2)
  monkeypatch.setattr(decode, "BLOCK_T", 16)
  requests = make_requests(num=6, seed=7, prompt=(9, 70), output=(4, 10))
  base = DENSE + ["mesh.dp=1", "engine.max_batch=3", "kernels.decode_scores=lengths"]
  systems = {
      "resident": [],
      "ula": ["memory.system=ula", "memory.device_pool=40", "memory.host_pool=1024",
              "kernels.decode_topk=radix", "engine.steps_per_dispatch=3"],
      "hisparse": ["memory.system=hisparse", "memory.hisparse.device_buffer_size=8",
                   "memory.hisparse.host_to_device_ratio=32"],
  }
  tokens, summaries = _serve_each(base, systems, requests, decode_scores="lengths")
  for name, summary in summaries.items():  # what the summary states ('auto': sort on a CPU)
    assert summary["decode_topk"] == ("radix" if name == "ula" else "sort"), name
  assert tokens["ula"] == tokens["resident"]
  assert tokens["hisparse"] == tokens["resident"]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_radix_and_sort_topk_return_the_same_arrays(impl):
  from ula_jax.kernels.indexer.decode import decode_topk
  B, T, k = 6, 700, 64
  q, w, addr, length, keys = _case(11, B, T, I=4, K=32, dtype=jnp.float32)
  scores = index_scores(q, w, _gather(keys)(addr))
  n = np.asarray(length)
  cand = jnp.asarray(np.arange(T)[None, :] < n[:, None])
  sp, sv = decode_topk(scores, cand, length, k, mode="sort")
  rp, rv = decode_topk(scores, cand, length, k, mode="radix", impl=impl)
  # (On the CPU select_prefix takes the sort's picks; the radix passes themselves run
  # where the platform is a GPU, and in tests/test_sparse_prefill.py.)
  sp, sv, rp, rv = map(np.asarray, (sp, sv, rp, rv))
  np.testing.assert_array_equal(sp, rp)  # the same positions in the same order
  np.testing.assert_array_equal(sv, rv)
  full = np.asarray(scores)
  for b in range(B):
    m = int(rv[b].sum())
    assert m == min(k, int(n[b]))
    assert rv[b, :m].all() and not rv[b, m:].any() and np.all(np.diff(rp[b, :m]) > 0)
    # The picks are the row's k best candidates: none left out scores above the worst.
    left = np.setdiff1d(np.arange(n[b]), rp[b, :m])
    if m and left.size:
      assert full[b, left].max() <= full[b, rp[b, :m]].min()
  with pytest.raises(ValueError, match="decode_topk='heap'"):
    decode_topk(scores, cand, length, k, mode="heap")


def test_topk_mode_auto_is_radix_on_a_gpu_only():
  from ula_jax.kernels.indexer.decode import topk_mode
  assert topk_mode("auto", "gpu") == "radix"
  assert topk_mode("auto", "cpu") == "sort"
  assert topk_mode("sort", "gpu") == "sort" and topk_mode("radix", "cpu") == "radix"
  with pytest.raises(ValueError, match="decode_topk='heap'"):
    topk_mode("heap", "gpu")


def test_scores_mode_auto_is_pages_on_one_gpu_rank_with_power_of_2_sizes():
  """kernels.decode_scores=auto: pages on a GPU with mesh.tp = 1, bf16 keys and pages
  and keys the kernel takes; elsewhere lengths past one column block, window within it (whatever the
  memory system: the mesh and model decide). Explicit modes stay as given."""
  from ula_jax.kernels.indexer.decode import BLOCK_T, scores_mode
  long, short = 4 * BLOCK_T, BLOCK_T // 2
  mode = lambda m, window=long, platform="gpu", tp=1, page=64, dim=128: scores_mode(
      m, window, platform=platform, tp=tp, page_size=page, index_dim=dim)
  assert mode("auto") == "pages" and mode("auto", window=short) == "pages"
  assert mode("auto", platform="cpu") == "lengths"
  assert mode("auto", platform="cpu", window=short) == "window"
  assert mode("auto", tp=2) == "lengths" and mode("auto", tp=2, window=short) == "window"
  assert mode("auto", page=48) == "lengths" and mode("auto", dim=96) == "lengths"
  # fp8 keys: lengths for every system alike (some pool sizes put one system's fp8 key
  # table at 2-4 GiB, which the page kernel refuses).
  assert scores_mode("auto", long, platform="gpu", tp=1, page_size=64, index_dim=128,
                     kv_layout="fp8") == "lengths"
  assert mode("lengths") == "lengths" and mode("window") == "window"
  assert mode("pages", platform="cpu") == "pages"
  with pytest.raises(ValueError, match="decode_scores='rows'"):
    mode("rows")


def _paged_case(seed, B, P, page, I, K, dtype, G=3):
  """Rows of different lengths (some idle) over distinct pages of a [G, N, K] key
  table, as an engine's page tables hold them."""
  rng = np.random.default_rng(seed)
  N = page * (B * P + 3)
  keys = jnp.asarray(rng.standard_normal((G, N, K)), dtype)
  q = jnp.asarray(rng.standard_normal((B, I, K)), dtype)
  w = jnp.asarray(rng.standard_normal((B, I)), jnp.float32)
  length = rng.integers(1, P * page + 1, B)
  length[rng.random(B) < 0.3] = 0
  length[0] = P * page  # one row fills its window
  free = iter(rng.permutation(N // page))
  table = np.full((B, P), INVALID, np.int32)
  for b in range(B):
    for p in range(-(-length[b] // page)):
      table[b, p] = next(free)
  return q, w, keys, jnp.asarray(table), jnp.asarray(length, jnp.int32)


@pytest.mark.parametrize("B,P,page,I,dtype,pages_per", [
    (5, 7, 16, 4, jnp.float32, 2),   # pages not a multiple of the program's
    (4, 6, 32, 20, jnp.bfloat16, 1),  # heads padded to a power of 2
    (3, 5, 16, 16, jnp.bfloat16, 4),
])
def test_page_scores_kernel_matches_the_gathered_reference(B, P, page, I, dtype, pages_per):
  """kernels.decode_scores=pages: the Pallas kernel (interpret mode) against
  ``index_scores`` of the row's gathered keys, -inf past each row's length, idle rows
  all -inf; the top-k picks agree."""
  from ula_jax.core.addressing import all_addrs
  from ula_jax.kernels.indexer.pallas import page_scores_pallas
  q, w, keys, table, length = _paged_case(B * P + I, B, P, page, I, 32, dtype)
  g = 1
  got = np.asarray(jax.jit(lambda *a: page_scores_pallas(
      *a, page, pages_per=pages_per, interpret=True))(q, w, keys, jnp.int32(g), table,
                                                       length))
  addr = all_addrs(table, page)
  want = np.asarray(index_scores(q, w, keys[g][jnp.clip(addr, 0, keys.shape[1] - 1)]))
  n = np.asarray(length)
  T = P * page
  assert got.shape == (B, T)
  scored = np.arange(T)[None, :] < n[:, None]
  assert scored.any() and (~scored).any()
  np.testing.assert_allclose(got[scored], want[scored], rtol=1e-5, atol=1e-5)
  assert np.isneginf(got[~scored]).all()
  active, positions = jnp.asarray(n > 0), jnp.asarray(n - 1)
  cand = (addr >= 0) & (jnp.arange(T)[None, :] <= positions[:, None]) & active[:, None]
  for k in (1, 9, T // 3):
    np.testing.assert_array_equal(np.asarray(select_topk(jnp.asarray(got), cand, k)[0]),
                                  np.asarray(select_topk(jnp.asarray(want), cand, k)[0]))


def test_page_scores_kernel_reads_fp8_keys(dtype=jnp.bfloat16):
  """fp8 key rows (``kv_layout.quantize_key``) decoded in the kernel as
  ``KeyLayout.decode`` decodes them: the scores of the decoded keys."""
  from ula_jax.core.addressing import all_addrs
  from ula_jax.core.kv_layout import KeyLayout, quantize_key
  from ula_jax.kernels.indexer.pallas import page_scores_pallas
  page, K = 16, 64
  q, w, keys, table, length = _paged_case(21, 4, 5, page, 8, K, jnp.float32)
  # Keys of very different magnitudes, so the scale bytes matter.
  mag = jnp.asarray(np.random.default_rng(2).uniform(-3, 3, keys.shape[:2] + (1,)))
  rows = quantize_key(keys * 10.0 ** mag)
  assert rows.dtype == jnp.uint8 and rows.shape[-1] == K + 4
  layout = KeyLayout("fp8", K, jnp.dtype(dtype).name)
  q = q.astype(dtype)
  got = np.asarray(jax.jit(lambda *a: page_scores_pallas(
      *a, page, fp8_keys=True, key_dtype=dtype, interpret=True))(
          q, w, rows, jnp.int32(2), table, length))
  addr = all_addrs(table, page)
  want = np.asarray(index_scores(q, w, layout.decode(rows[2][jnp.clip(addr, 0,
                                                                       rows.shape[1] - 1)])))
  n = np.asarray(length)
  scored = np.arange(got.shape[1])[None, :] < n[:, None]
  np.testing.assert_allclose(got[scored], want[scored], rtol=1e-5, atol=1e-5)
  assert np.isneginf(got[~scored]).all()
  with pytest.raises(ValueError, match="expected uint8 fp8 key rows"):
    page_scores_pallas(q, w, keys, 0, table, length, page, fp8_keys=True, interpret=True)


def test_page_scores_kernel_refuses_fp8_key_tables_of_2_to_4_gib_on_a_gpu():
  """An fp8 key table between 2 and 4 GiB (3 GiB here, traced, not made) is refused
  where the kernel compiles for a GPU: Pallas's Triton lowering indexes arrays up to
  4 GiB with 32-bit element offsets, which byte elements past 2**31 overflow. 1 and 5
  GiB tables trace; interpret mode takes any size."""
  from ula_jax.kernels.indexer.pallas import page_scores_pallas
  B, I, K, page, G = 2, 16, 128, 64, 20
  rest = (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((B, 8), jnp.int32),
          jax.ShapeDtypeStruct((B,), jnp.int32))
  qw = (jax.ShapeDtypeStruct((B, I, K), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, I), jnp.float32))
  table = lambda gib: jax.ShapeDtypeStruct(
      (G, gib * 2**30 // (G * (K + 4)) // page * page, K + 4), jnp.uint8)
  scores = lambda gib, interpret=False: jax.eval_shape(
      lambda *a: page_scores_pallas(*a, page, fp8_keys=True, interpret=interpret),
      *qw, table(gib), *rest)
  with pytest.raises(ValueError, match=r"fp8 key table of \d+ bytes \(3.00 GiB\).*"
                     r"kernels.decode_scores='lengths'"):
    scores(3)
  for ok in (scores(1), scores(5), scores(3, interpret=True)):
    assert ok.shape == (B, 8 * page)


def test_systems_scoring_by_pages_decode_residents_tokens():
  """kernels.decode_scores=pages (the Pallas kernel, interpret mode) with fp8 keys
  decoded in the kernel: ula (also three decode steps per dispatch) and hisparse,
  missing and evicting, decode resident's tokens (keys stored as values: the kernel tests
  above); the config refuses it where keys are not by logical address or the sizes do
  not fit the kernel."""
  from ula_jax.config import ConfigError, load_config
  from tests.engine_util import BASE, DENSE, make_requests
  requests = make_requests(num=5, seed=3, prompt=(20, 90), output=(4, 9))
  base = DENSE + ["mesh.dp=1", "engine.max_batch=3", "engine.page_size=16",
                  "kernels.decode_scores=pages"]
  fp8 = ["model.kv_layout=fp8", "model.kv_lora_rank=128"]
  runs = {
      "resident": fp8,
      "ula": fp8 + ["memory.system=ula", "memory.device_pool=64", "memory.host_pool=1024"],
      "hisparse": fp8 + ["memory.system=hisparse", "memory.hisparse.device_buffer_size=8",
                         "memory.hisparse.host_to_device_ratio=32"],
  }
  # The kernel inside a dispatch's device loop of three decode steps too.
  runs["ula_dispatch3"] = runs["ula"] + ["engine.steps_per_dispatch=3"]
  tokens, _ = _serve_each(base, runs, requests, decode_scores="pages")
  assert len({tuple(v) for v in tokens["resident"].values()}) > 1
  for name in ("ula", "ula_dispatch3", "hisparse"):
    assert tokens[name] == tokens["resident"], name
  with pytest.raises(ConfigError, match=r"decode_scores='pages' needs engine.page_size "
                     r"and model.index_head_dim powers of 2 >= 16; got 8 and 16"):
    load_config(BASE, ["kernels.decode_scores=pages", "engine.page_size=8"])
  with pytest.raises(ConfigError, match=r"ula with mesh.tp=2 shards them over ranks"):
    load_config(BASE, ["kernels.decode_scores=pages", "memory.system=ula", "mesh.dp=1",
                       "mesh.tp=2"])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_keys", "fp8_keys"])
def test_gpu_page_scores_kernel_matches_the_gathered_reference(fp8):
  """The page-scores kernel compiled by Triton at a decode step's sizes (32 rows, 64
  indexer heads of 128, pages of 64, rows up to 16K positions): the scores of the
  gathered (decoded) keys, -inf past each row's length."""
  from ula_jax.core.addressing import all_addrs
  from ula_jax.core.kv_layout import KeyLayout, quantize_key
  from ula_jax.kernels.indexer.pallas import page_scores_pallas
  page = 64
  q, w, keys, table, length = _paged_case(5, 32, 256, page, 64, 128, jnp.bfloat16, G=2)
  rows = quantize_key(keys) if fp8 else keys
  got = np.asarray(jax.jit(lambda *a: page_scores_pallas(*a, page, fp8_keys=fp8))(
      q, w, rows, jnp.int32(1), table, length))
  addr = all_addrs(table, page)
  gathered = rows[1][jnp.clip(addr, 0, rows.shape[1] - 1)]
  if fp8:
    gathered = KeyLayout("fp8", 128, "bfloat16").decode(gathered)
  want = np.asarray(jax.jit(index_scores)(q, w, gathered))
  n = np.asarray(length)
  scored = np.arange(got.shape[1])[None, :] < n[:, None]
  np.testing.assert_allclose(got[scored], want[scored], rtol=1e-3, atol=1e-3)
  assert np.isneginf(got[~scored]).all()
