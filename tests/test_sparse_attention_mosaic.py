"""The Mosaic GPU sparse MLA attention against the jnp reference.

``TestSparseAttentionMosaicGpu`` runs the kernel on a Hopper GPU (fresh random inputs,
invalid and out-of-range slots, an empty row, every output checked finite and against
the reference). Mosaic GPU's interpret mode cannot run this kernel (no transposed
shared-memory operand, register operand or layout cast, and the producer is inline
Mosaic GPU code), so on CPU the tests check what can be checked there: that it lowers
for CUDA for every launch, its inputs' preparation and its configuration errors.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.probe_util import load_probe
from tests.test_sparse_attention_pallas import assert_close, make_inputs, reference
from ula_jax.kernels.sparse_attention import mosaic
from ula_jax.kernels.sparse_attention.mosaic import (MosaicAttentionConfig,
                                                     sparse_mla_attention_mosaic)

H, DL, DR = mosaic.HEADS, mosaic.LATENT, mosaic.ROPE
CONFIGS = [MosaicAttentionConfig(), MosaicAttentionConfig(num_splits=1),
           MosaicAttentionConfig(num_splits=3),
           MosaicAttentionConfig(num_splits=3, consumer_registers=232)]
config_id = lambda c: f"s{c.num_splits}-r{c.consumer_registers}"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_lowers_for_cuda(config):
  text = mosaic.lower_for_cuda(B=2, k=200, S=300, config=config)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_config_errors(value):
  with pytest.raises(ValueError, match="num_splits=.*: expected None or a positive integer"):
    MosaicAttentionConfig(num_splits=value)


@pytest.mark.parametrize("value", [160, 236, 248, 200.0, 201])
def test_register_split_errors(value):
  with pytest.raises(ValueError, match="consumer_registers=.*: expected a multiple of 8 "
                     "in \\[168, 240\\]"):
    MosaicAttentionConfig(consumer_registers=value)


@pytest.mark.parametrize("consumer, producer",
                         [(240, 24), (232, 40), (208, 88), (168, 168)])
def test_register_split_never_asks_for_more_than_the_launch_gives(consumer, producer):
  # 384 threads launch with 168 registers each; a setmaxnreg increase waits for free
  # registers, so the consumers' increase must be covered by the producer's decrease
  # (232 for the consumers with 48 for the producer hung on an H200).
  config = MosaicAttentionConfig(consumer_registers=consumer)
  assert config.producer_registers() == producer
  assert 2 * 128 * consumer + 128 * producer <= 168 * 3 * 128


def test_defaults_are_the_engine_launch():
  assert mosaic.FASTEST == MosaicAttentionConfig()
  assert mosaic.FASTEST.consumer_registers == 240 and mosaic.FASTEST.producer_registers() == 24
  assert MosaicAttentionConfig().splits(64) == 2 and MosaicAttentionConfig().splits(128) == 1
  assert MosaicAttentionConfig(num_splits=3).splits(256) == 3


def test_shared_memory_fits_an_h200_block():
  # Queries and two ring tiles (72 KB each), both warpgroups' probabilities (4 KB each)
  # and the meta buffer (slot lists, maxima, validity bits: 1 KB).
  assert mosaic.smem_bytes(1024) == 3 * 72 * 1024 + 9 * 1024
  # One split of the whole k (batch 128, k 2048): 64 more words of bits.
  assert mosaic.smem_bytes(2048) == 3 * 72 * 1024 + 9 * 1024 + 128
  assert mosaic.smem_bytes(16384) <= 227 * 1024


@pytest.mark.parametrize("config", [MosaicAttentionConfig(),
                                    MosaicAttentionConfig(num_splits=3)], ids=config_id)
def test_prepared_inputs(rng, config):
  """The kernel's inputs: the queries' latent and rope parts as given (bf16), slot lists
  clamped, 0 where not valid and padded to whole rounds of the ring per split; bit i of
  word w the validity of entry 32 w + i."""
  B, k, S = 2, 200, 50
  slots = rng.integers(-10, 2 * S, (B, k)).astype(np.int32)
  valid = rng.random((B, k)) < 0.7
  (q_lat, q_rope), sl, bits = mosaic._prepare(
      jnp.ones((B, H, DL)), jnp.zeros((B, H, DR)), S, jnp.asarray(slots),
      jnp.asarray(valid), config)
  splits, bk = config.splits(B), mosaic.BLOCK_K
  tiles = mosaic.STAGES * -(-k // (mosaic.STAGES * bk * splits))
  assert q_lat.dtype == q_rope.dtype == jnp.bfloat16
  assert q_lat.shape == (B, H, DL) and q_rope.shape == (B, H, DR)
  assert not np.asarray(q_rope).any() and np.asarray(q_lat == 1).all()
  assert sl.shape == (B, splits, tiles, bk)
  kp = splits * tiles * bk
  want = np.zeros((B, kp), np.int32)
  want[:, :k] = np.where(valid, np.clip(slots, 0, S - 1), 0)
  np.testing.assert_array_equal(np.asarray(sl).reshape(B, kp), want)
  words = np.asarray(bits).view(np.uint32)
  assert words.shape == (B, splits, mosaic._bit_words(kp // splits))
  padded = np.zeros((B, kp), bool)
  padded[:, :k] = valid
  per_split = padded.reshape(B, splits, kp // splits)
  for i in range(kp // splits):
    got = (words[:, :, i // 32] >> (i % 32)) & 1
    np.testing.assert_array_equal(got.astype(bool), per_split[:, :, i])


def test_shapes_are_checked():
  q = jnp.zeros((1, 32, DL), jnp.bfloat16)
  with pytest.raises(ValueError, match="takes 64 heads of 512 \\+ 64 columns"):
    sparse_mla_attention_mosaic(q, jnp.zeros((1, 32, DR), jnp.bfloat16),
                                jnp.zeros((8, DL + DR), jnp.bfloat16),
                                jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool),
                                scale=0.1)
  with pytest.raises(ValueError, match="pool.dtype=float32: the Mosaic kernel takes "
                     "bfloat16 pools"):
    sparse_mla_attention_mosaic(jnp.zeros((1, H, DL)), jnp.zeros((1, H, DR)),
                                jnp.zeros((8, DL + DR), jnp.float32),
                                jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool),
                                scale=0.1)


def test_probe_diagnostics_are_arguments():
  """The probes' diagnostics lower as arguments of ``sparse_mla_attention_probe``; the
  production entry points take none of them."""
  import inspect
  for fn in (mosaic.sparse_mla_attention_mosaic, mosaic.sparse_mla_attention_fastest):
    assert not {"ablation", "tile_step", "profile"} & set(inspect.signature(fn).parameters)
  for ablation in mosaic.ABLATIONS:
    assert "mosaic_gpu" in mosaic.lower_for_cuda(ablation=ablation)
  with pytest.raises(ValueError, match=r"ablation='noload': expected None or one of "
                     r"\['compute', 'gather'\]"):
    mosaic.lower_for_cuda(ablation="noload")


@pytest.mark.gpu
class TestSparseAttentionMosaicGpu:

  @pytest.mark.parametrize("config", CONFIGS, ids=config_id)
  @pytest.mark.parametrize("B, k, S", [(3, 200, 300), (8, 2048, 20000)])
  def test_matches_reference(self, rng, config, B, k, S):
    args = make_inputs(rng, B, H, DL, DR, S, k, jnp.bfloat16)
    scale = 1.0 / np.sqrt(DL + DR)
    got = sparse_mla_attention_mosaic(*args, scale=scale, config=config)
    assert_close(got, reference(*args, scale=scale), jnp.bfloat16)
    assert not np.asarray(got[1]).any()  # the empty row

  @pytest.mark.parametrize("B, k, S", [(3, 200, 300), (8, 2048, 20000)])
  def test_junk_where_not_valid(self, rng, B, k, S):
    """The engine's launch (``FASTEST``) with junk anywhere in int32 where not valid."""
    q_lat, q_rope, pool, slots, valid = make_inputs(rng, B, H, DL, DR, S, k, jnp.bfloat16)
    junk = rng.choice(np.asarray([-1, S, 2**31 - 1, -2**31, 1 << 20], np.int32), (B, k))
    slots = jnp.where(valid, slots, jnp.asarray(junk))
    args = (q_lat, q_rope, pool, slots, valid)
    got = sparse_mla_attention_mosaic(*args, scale=0.05, config=mosaic.FASTEST)
    assert_close(got, reference(*args, scale=0.05), jnp.bfloat16)
    assert not np.asarray(got[1]).any()  # the empty row

  def test_every_entry_valid(self, rng):
    args = make_inputs(rng, 4, H, DL, DR, 4096, 2048, jnp.bfloat16, p_valid=1.0,
                       empty_row=False)
    got = sparse_mla_attention_mosaic(*args, scale=0.05)
    assert_close(got, reference(*args, scale=0.05), jnp.bfloat16)


def test_gpu_diagnostic_scripts_lower_for_cuda():
  """The probe's partial tile steps and the TMA row gathers lower for CUDA; their modes
  and variants are checked. The probe sets nothing in the kernel's module."""
  import jax
  probe = load_probe("gpu_mosaic_probe")
  before = dict(vars(mosaic))
  assert probe.tile_step("full") is None  # the kernel's own
  for variant in probe.VARIANTS[1:]:
    for ablation in (None, "compute"):
      assert "mosaic_gpu" in mosaic.lower_for_cuda(tile_step=probe.tile_step(variant),
                                                   ablation=ablation)
  assert dict(vars(mosaic)) == before
  assert probe._parse_variant("scores_only+c") == ("scores_only", True)
  assert probe._parse_variant("full") == ("full", False)
  for bad in ("full+c+c", "full+qc", "full+f2", "rows"):
    with pytest.raises(ValueError, match="expected one of"):
      probe._parse_variant(bad)
  rate = load_probe("gpu_wgmma_rate")
  for source in ("rs", "ss"):
    f = jax.jit(rate.rate_kernel(source, 64, 2, calls=8, in_flight=1))
    text = f.trace(jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),
                   jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)).lower(
                       lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="'full\\+x': expected one of"):
    probe._parse_variant("full+x")
  gather = load_probe("gpu_row_gather")
  spec = jax.ShapeDtypeStruct
  for mode, issuers in zip(gather.MODES, (1, 4)):
    f = jax.jit(lambda p, s, mode=mode, n=issuers: gather.tma_gather(
        p, s, mode=mode, splits=2, issuers=n))
    text = f.trace(spec((4096, 576), jnp.bfloat16), spec((2, 512), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="mode='tiles'"):
    gather.tma_gather(jnp.zeros((8, 576), jnp.bfloat16), jnp.zeros((1, 256), jnp.int32),
                      mode="tiles", splits=1)
  with pytest.raises(ValueError, match="issuers=3: expected 1, 2 or 4"):
    gather.tma_gather(jnp.zeros((8, 576), jnp.bfloat16), jnp.zeros((1, 256), jnp.int32),
                      mode="row", splits=1, issuers=3)
  with pytest.raises(ValueError, match="k=192: expected a multiple of 256"):
    gather.tma_gather(jnp.zeros((8, 576), jnp.bfloat16), jnp.zeros((1, 192), jnp.int32),
                      mode="row", splits=2)


def test_probe_timeline_and_modes(capsys):
  """The probe's trace summary (``--timeline``) on a two-warpgroup trace, and its
  options' errors."""
  probe = load_probe("gpu_mosaic_probe")
  ev = lambda tid, name, ph, ts: {"tid": tid, "name": name, "ph": ph, "ts": ts, "pid": 1}
  events = [ev(1, "c_wait", "B", 100.0), ev(1, "c_wait", "E", 100.5),
            ev(1, "c_wait", "B", 101.0), ev(1, "c_wait", "E", 101.25),
            ev(2, "c_wait", "B", 100.002), ev(2, "c_wait", "E", 100.102)]
  rows = {r["scope"]: r for r in probe.trace_rows("auto", 64, 2048, events)}
  assert rows["(start spread)"]["ns"] == pytest.approx(2.0)
  wait = rows["c_wait"]
  assert wait["count"] == 3
  assert (wait["cycles_min"], wait["cycles_median"], wait["cycles_max"]) == pytest.approx(
      (100, 250, 500))
  assert wait["cycles_per_warpgroup_max"] == pytest.approx(750)
  assert "c_wait" in capsys.readouterr().out
  for argv, match in ((["--cupti", "64", "--ks", "0"], "--ks='0'"),
                      (["--variants", "full+nw"], "'full\\+nw': expected one of"),
                      (["--configs", "t1p1r240"], "--mosaic-configs: 't1p1r240'")):
    with pytest.raises(ValueError, match=match):
      probe.main(argv)


def test_engine_dispatch_refuses_mosaic_off_a_gpu():
  from ula_jax.kernels.sparse_attention import sparse_mla_attention
  args = (jnp.zeros((1, H, DL)), jnp.zeros((1, H, DR)), jnp.zeros((8, DL + DR), jnp.bfloat16),
          jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool))
  with pytest.raises(ValueError, match="kernels.attention='mosaic' runs on Hopper GPUs only"):
    sparse_mla_attention(*args, scale=0.1, impl="mosaic")


def test_ncu_summary_reads_both_pages(tmp_path, capsys):
  """The Nsight Compute summary of a report's two CSV pages: headline metrics, stall
  shares, opcodes and shared-memory wavefronts."""
  details = tmp_path / "details.csv"
  details.write_text('"ID","Section Name","Metric Name","Metric Unit","Metric Value"\n'
                     '"0","GPU Speed Of Light Throughput","Duration","us","105.82"\n'
                     '"0","Occupancy","Theoretical Occupancy","%","18.75"\n')
  sass = tmp_path / "sass.csv"
  head = ["Address", "Source", "Instructions Executed", "L1 Wavefronts Shared",
          "L1 Wavefronts Shared Ideal", "stall_short_sb", "stall_wait",
          "stall_wait (Not Issued)"]
  lines = ['"Kernel Name","k"', ",".join(f'"{h}"' for h in head),
           '"0x10","LDSM.16.M88.4 R4, [R2]","300","1,200","1,200","1","3","9"',
           '"0x20","@!P0 HGMMA.64x32x16.F32.BF16 R24, R76","100","200","200","6","0","9"']
  sass.write_text("\n".join(lines) + "\n")
  summary = load_probe("ncu_summary")
  assert summary.main([str(details), str(sass)]) == 0
  out = capsys.readouterr().out
  assert "Duration" in out and "105.82" in out and "Theoretical Occupancy" not in out
  assert "short_sb" in out and "70.0%" in out and "wait" in out and "30.0%" in out
  assert "LDSM" in out and "75.0%" in out  # of executed instructions
  assert "HGMMA.64x32x16.F32.BF16" in out and "1200" in out
  with pytest.raises(SystemExit):
    summary.main([])
  with pytest.raises(SystemExit):
    load_probe("gpu_mosaic_ncu").main(["t1"])
