"""``model.kv_layout``: entries stored in DeepSeek-V3.2's 656-B FP8 layout, indexer keys
in its 132-B FP8 rows.

The encodings are checked byte by byte on hand-computed values and against their error
bounds on random ones; fp8 rows go through every memory system's pools (prefill, decode
writes, eviction to host and fetch back) bit for bit; every system decodes the tokens
``resident`` and the memory-free reference decode with the fp8 layout; pools sized in
bytes hold 1152/656 times the tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from pydantic import ValidationError

from ula_jax.config import ConfigError, load_config
from ula_jax.config.schema import HiSparseConfig, MemoryConfig
from ula_jax.core import kv_layout
from ula_jax.core.kv_layout import EntryLayout, KeyLayout
from ula_jax.core.types import KVGeometry, MeshInfo
from ula_jax.engine import synthetic_prefill as sp
from ula_jax.kernels.sparse_attention import sparse_mla_attention
from ula_jax.memory import build_memory_system
from ula_jax.models import transformer as tfm
from ula_jax.models.config import ModelConfig
from ula_jax.models.layers import MLAttention
from tests.engine_util import BASE, ROWS, TIGHT_SYSTEMS, make_requests, run_engine
from tests.memory_util import CHUNK, Workload, local_state, prefill_fn, step_fn

BF16, F8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
FP8_MODEL = dict(kv_layout="fp8", kv_lora_rank=128)
# The tiny model with a latent of one fp8 block: rows of 128 + 4 + 2 * 16 = 164 bytes.
FP8 = ["model.kv_layout=fp8", "model.kv_lora_rank=128"]


def _scale(amax: float) -> np.float32:
  """The layout's block scale: amax times the float32 reciprocal of 448."""
  return np.float32(amax) * np.float32(1 / 448)


# ----------------------------------------------------------------------------------
# the encoding
# ----------------------------------------------------------------------------------


def test_row_sizes():
  assert EntryLayout("fp8", 512, 64).row_width == 656
  assert EntryLayout("fp8", 512, 64).row_bytes == 656
  assert EntryLayout("bf16", 512, 64, "bfloat16").row_bytes == 1152
  geo = ModelConfig(preset="glm5", kv_layout="fp8").kv_geometry()
  assert (geo.entry_width, geo.kv_dtype, geo.row_bytes) == (656, "uint8", 656)
  assert geo.token_bytes == 78 * 656
  assert (geo.index_dim, geo.index_dtype, geo.index_layout.dim) == (132, "uint8", 128)
  geo = ModelConfig(preset="glm5").kv_geometry()
  assert (geo.entry_width, geo.kv_dtype, geo.row_bytes) == (576, "bfloat16", 1152)
  assert (geo.index_dim, geo.index_dtype) == (128, "bfloat16")
  assert KeyLayout("fp8", 128).row_bytes == 132
  assert KeyLayout("bf16", 128, "bfloat16").row_bytes == 256


def test_fp8_bytes_hand_checked():
  """Two latent blocks and four rope values, every byte known: block 0 has amax 2
  (+-2 encode as +-448 = 0x7E / 0xFE, 0.5 as 112 = 0x6E), block 1 is zeros (scale 0)."""
  entry = np.zeros(256 + 4, np.float32)
  entry[:4] = [2.0, -2.0, 0.0, 0.5]
  entry[256:] = [1.0, -2.5, 1 / 3, 65504.0]
  row = np.asarray(kv_layout.quantize(jnp.asarray(entry), 256))
  assert row.dtype == np.uint8 and row.shape == (256 + 8 + 8,)
  assert row[:4].tolist() == [0x7E, 0xFE, 0x00, 0x6E]
  assert not row[4:256].any()
  assert row[256:260].tobytes() == _scale(2.0).astype("<f4").tobytes()
  assert row[260:264].tolist() == [0, 0, 0, 0]
  assert row[264:268].tolist() == [0x80, 0x3F, 0x20, 0xC0]  # 1.0, -2.5 in bf16, LE
  assert row[264:].tobytes() == entry[256:].astype(BF16).view("<u2").tobytes()
  back = np.asarray(kv_layout.dequantize(jnp.asarray(row), 256))
  assert back.dtype == np.float32 and back.shape == (260,)
  np.testing.assert_allclose(back[:4], [2.0, -2.0, 0.0, 0.5], rtol=1e-6)
  assert not back[4:256].any()
  np.testing.assert_array_equal(back[256:], entry[256:].astype(BF16).astype(np.float32))


def test_fp8_key_bytes_hand_checked():
  """One key of 128 values with amax 4 (+-4 encode as +-448, 1 as 112 = 0x6E), then the
  float32 scale 4 / 448; a key of zeros has scale 0 and decodes to zeros."""
  key = np.zeros((2, 128), np.float32)
  key[0, :3] = [4.0, -4.0, 1.0]
  rows = np.asarray(kv_layout.quantize_key(jnp.asarray(key)))
  assert rows.dtype == np.uint8 and rows.shape == (2, 132)
  assert rows[0, :3].tolist() == [0x7E, 0xFE, 0x6E] and not rows[0, 3:128].any()
  assert rows[0, 128:].tobytes() == _scale(4.0).astype("<f4").tobytes()
  assert not rows[1].any()
  back = np.asarray(KeyLayout("fp8", 128, "float32").decode(jnp.asarray(rows)))
  assert back.dtype == np.float32 and back.shape == (2, 128)
  np.testing.assert_allclose(back[0, :3], [4.0, -4.0, 1.0], rtol=1e-6)
  assert not back[0, 3:].any() and not back[1].any()
  # The bf16 layout stores the values themselves.
  np.testing.assert_array_equal(np.asarray(KeyLayout("bf16", 128, "float32").encode(
      jnp.asarray(key))), key)


def test_fp8_keys_round_trip_within_the_rounding_bound(rng):
  """Random keys of magnitudes 1e-3 .. 1e3: each value comes back within half an e4m3
  step of the key's scale; the bytes are the e4m3 rounding of key / scale."""
  mag = 10.0 ** rng.uniform(-3, 3, size=(6, 9, 1))
  x = (rng.standard_normal((6, 9, 128)) * mag).astype(np.float32)
  rows = np.asarray(jax.jit(kv_layout.quantize_key)(x))
  back = np.asarray(jax.jit(kv_layout.dequantize_key)(rows))
  scale = np.abs(x).max(axis=-1, keepdims=True) * np.float32(1 / 448)
  np.testing.assert_array_equal(rows[..., 128:].reshape(-1, 4).view("<f4").reshape(6, 9, 1),
                                scale)
  bound = np.abs(x) * (2.0**-4 + 1e-6) + scale * 2.0**-10 * 1.001
  assert (np.abs(back - x) <= bound).all()
  np.testing.assert_array_equal(rows[..., :128], (x / scale).astype(F8).view(np.uint8))


@pytest.mark.parametrize("lead", [(0,), (5, 7)])
def test_fp8_round_trip_within_the_rounding_bound(rng, lead):
  """Random entries of magnitudes 1e-3 .. 1e3 per row, some blocks all zero: each
  latent value comes back within half an e4m3 step (|x| 2^-4, or 2^-10 of the scale
  among subnormals), the rope part as its bf16 rounding exactly, the scale bytes as
  amax / 448 of the block."""
  C, R = 512, 64
  mag = 10.0 ** rng.uniform(-3, 3, size=(*lead, 1))
  x = (rng.standard_normal((*lead, C + R)) * mag).astype(np.float32)
  zero = rng.random((*lead, C // 128)) < 0.2
  x[..., :C].reshape(*lead, C // 128, 128)[zero] = 0.0
  rows = np.asarray(jax.jit(kv_layout.quantize, static_argnums=1)(x, C))
  assert rows.shape == (*lead, 656) and rows.dtype == np.uint8
  back = np.asarray(jax.jit(kv_layout.dequantize, static_argnums=1)(rows, C))
  assert back.shape == (*lead, C + R)
  blocks = x[..., :C].reshape(*lead, C // 128, 128)
  scale = np.abs(blocks).max(axis=-1) * np.float32(1 / 448)
  np.testing.assert_array_equal(rows[..., C:C + 16].reshape(-1, 4).view("<f4").reshape(
      scale.shape), scale)
  err = np.abs(back[..., :C] - x[..., :C]).reshape(blocks.shape)
  bound = np.abs(blocks) * (2.0**-4 + 1e-6) + scale[..., None] * 2.0**-10 * 1.001
  assert (err <= bound).all()
  assert not back[..., :C].reshape(blocks.shape)[zero].any()
  np.testing.assert_array_equal(back[..., C:], x[..., C:].astype(BF16).astype(np.float32))
  # The latent bytes are the float8_e4m3fn rounding of x / scale.
  want = (blocks / np.where(scale > 0, scale, 1)[..., None]).astype(F8)
  np.testing.assert_array_equal(rows[..., :C], want.view(np.uint8).reshape(*lead, C))


def test_errors_name_the_fields():
  with pytest.raises(ValueError, match=r"model.kv_layout='fp8' quantises the latent in "
                     r"blocks of 128 values.*model.kv_lora_rank=32 must be a multiple of 128"):
    ModelConfig(preset="tiny", kv_layout="fp8")
  with pytest.raises(ValidationError, match=r"kv_layout"):
    ModelConfig(preset="tiny", kv_layout="fp4")
  with pytest.raises(ValueError, match=r"model.kv_layout='fp4': expected one of \['bf16', "
                     r"'fp8'\]"):
    EntryLayout("fp4", 128, 16)
  with pytest.raises(ConfigError, match=r"kernels.attention='mosaic' reads "
                     r"model.kv_layout='bf16' rows only; with model.kv_layout='fp8' use "
                     r"kernels.attention='pallas' or 'xla'"):
    load_config(BASE, ["model.preset=tiny", "kernels.attention=mosaic"] + FP8)
  q_lat, q_rope = jnp.zeros((1, 2, 128)), jnp.zeros((1, 2, 16))
  slots, valid = jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3), bool)
  with pytest.raises(ValueError, match=r"kernels.attention='mosaic' reads "
                     r"model.kv_layout='bf16' rows only"):
    sparse_mla_attention(q_lat, q_rope, jnp.zeros((4, 164), jnp.uint8), slots, valid,
                         scale=1.0, impl="mosaic", kv_layout="fp8")
  with pytest.raises(ValueError, match=r"pool: got float32\[4, 144\], expected uint8 "
                     r"\[S, Dl \+ 4 Dl/128 \+ 2 Dr\] = \[S, 164\]"):
    sparse_mla_attention(q_lat, q_rope, jnp.zeros((4, 144)), slots, valid, scale=1.0,
                         kv_layout="fp8")
  with pytest.raises(ValueError, match=r"rows: got float32\[3, 164\], expected uint8"):
    kv_layout.dequantize(jnp.zeros((3, 164)), 128)
  with pytest.raises(ValueError, match=r"rows: got float32\[3, 132\], expected uint8 "
                     r"\[\.\.\., K \+ 4\]"):
    kv_layout.dequantize_key(jnp.zeros((3, 132)))
  with pytest.raises(ValueError, match=r"index_dim=128, index_dtype='uint8': expected the "
                     r"key layout's rows, 132 x uint8"):
    KVGeometry(num_layers=1, group_size=1, entry_width=4, index_dim=128, top_k=2,
               index_dtype="uint8", index_layout=KeyLayout("fp8", 128))
  with pytest.raises(ValueError, match=r"indexer keys: got float32\[2, 16\], expected rows "
                     r"of 20 x uint8 \(encode them with the model's key_layout\)"):
    geo = ModelConfig(preset="tiny", **FP8_MODEL).kv_geometry()
    s = build_memory_system(MemoryConfig(system="resident", device_pool=16), geo,
                            MeshInfo(1, 1), max_batch=2, page_size=4, max_context=8)
    s.write_index_keys(local_state(s), 0, jnp.zeros(2, jnp.int32), jnp.zeros((2, 16)))
  with pytest.raises(ValueError, match=r"entry_width=144, kv_dtype='float32': expected the "
                     r"layout's rows, 164 x uint8"):
    KVGeometry(num_layers=1, group_size=1, entry_width=144, index_dim=4, top_k=2,
               kv_dtype="float32", layout=EntryLayout("fp8", 128, 16))


def test_attention_reads_the_dequantised_rows(rng):
  """The xla kernel over fp8 rows equals it over the rows dequantised beforehand (the
  same float32 values after the gather), invalid slots and all."""
  B, H, C, R, S, k = 3, 4, 256, 16, 20, 6
  pool = np.asarray(kv_layout.quantize(jnp.asarray(rng.standard_normal((S, C + R))), C))
  q_lat = jnp.asarray(rng.standard_normal((B, H, C)), jnp.float32)
  q_rope = jnp.asarray(rng.standard_normal((B, H, R)), jnp.float32)
  slots = jnp.asarray(rng.integers(-1, S, (B, k)), jnp.int32)
  valid = (slots >= 0) & jnp.asarray(rng.random((B, k)) < 0.8)
  valid = valid.at[2].set(False)  # a row with nothing valid gives zeros
  attend = jax.jit(functools.partial(sparse_mla_attention, scale=0.3),
                   static_argnames="kv_layout")
  got = attend(q_lat, q_rope, jnp.asarray(pool), slots, valid, kv_layout="fp8")
  want = attend(q_lat, q_rope, kv_layout.dequantize(jnp.asarray(pool), C), slots, valid)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.asarray(got[2]).any()


def test_model_writes_quantised_entries(seed):
  """Same parameters with either layout; the fp8 layer's entry is the bf16 layer's
  entry quantised (bit for bit), and the fp8 workspaces hold rows of 164 bytes."""
  cfg = ModelConfig(preset="tiny", kv_lora_rank=128)
  f8_cfg = ModelConfig(preset="tiny", kv_lora_rank=128, kv_layout="fp8")
  bf, f8 = (MLAttention(c, rngs=nnx.Rngs(seed)) for c in (cfg, f8_cfg))
  x = jax.random.normal(jax.random.key(seed), (5, 64))
  pos = jnp.arange(5, dtype=jnp.int32)
  entry = jax.jit(lambda attn: attn.project(x, pos)[3])
  want, got = entry(bf), entry(f8)
  assert got.dtype == jnp.uint8 and got.shape == (5, 164)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(kv_layout.quantize(want, 128)))
  ws = tfm.init_workspace(f8_cfg, 8)
  assert ws.kv.dtype == jnp.uint8 and ws.kv.shape == (4 * 8, 164)
  # Indexer keys: 16 fp8 values and a float32 scale.
  assert ws.index_keys.dtype == jnp.uint8 and ws.index_keys.shape == (2, 8, 20)


def test_synthetic_prefill_writes_fp8_rows():
  """The generator's fp8 rows are its values rounded to bf16 and quantised by the
  function the model uses; chunks are as long as with the bf16 layout."""
  f32 = ModelConfig(preset="tiny", kv_lora_rank=128).kv_geometry()
  f8 = ModelConfig(preset="tiny", kv_lora_rank=128, kv_layout="fp8").kv_geometry()
  chunk = jax.jit(sp.synthetic_chunk, static_argnums=(0, 1, 4))
  e32, k32 = chunk(f32, 3, jnp.uint32(11), jnp.int32(5), 6)
  e8, k8 = chunk(f8, 3, jnp.uint32(11), jnp.int32(5), 6)
  assert e8.dtype == jnp.uint8 and e8.shape == (4, 6, 164)
  want = kv_layout.quantize(e32.astype(jnp.bfloat16), 128)
  np.testing.assert_array_equal(np.asarray(e8), np.asarray(want))
  assert k8.dtype == jnp.uint8 and k8.shape == (2, 6, 20)
  np.testing.assert_array_equal(np.asarray(k8), np.asarray(
      kv_layout.quantize_key(k32.astype(jnp.bfloat16))))
  chunks = [sp.chunk_len(ModelConfig(preset="glm5", kv_layout=layout).kv_geometry(), 256,
                         1 << 17) for layout in ("bf16", "fp8")]
  assert chunks == [8192, 8192]


# ----------------------------------------------------------------------------------
# pools
# ----------------------------------------------------------------------------------


def test_byte_sized_pools_hold_1152_over_656_the_tokens():
  """``memory.device_pool: 60GiB`` is 60 GiB / (656 B x 78 layers) tokens with fp8 (to
  a page), 1152/656 times the bf16 count."""
  tokens = {}
  for layout in ("bf16", "fp8"):
    geo = ModelConfig(preset="glm5", kv_layout=layout).kv_geometry()
    for system, cfg in {"resident": MemoryConfig(system="resident", device_pool="60GiB"),
                        "ula": MemoryConfig(system="ula", device_pool="60GiB",
                                            host_pool="100GiB")}.items():
      s = build_memory_system(cfg, geo, MeshInfo(1, 1), max_batch=8, page_size=64,
                              max_context=1 << 17)
      tokens[layout, system] = s.capacity_tokens if system == "resident" else s.device_slots
  assert tokens["fp8", "resident"] == (60 * 2**30 // (78 * 656)) // 64 * 64
  for system in ("resident", "ula"):
    np.testing.assert_allclose(tokens["fp8", system] / tokens["bf16", system], 1152 / 656,
                               rtol=1e-3)


LAYOUT = EntryLayout("fp8", 128, 16)
GEO = KVGeometry(num_layers=3, group_size=2, entry_width=LAYOUT.row_width, index_dim=4,
                 top_k=3, kv_dtype="uint8", index_dtype="float32", layout=LAYOUT)
POOL_SYSTEMS = {
    "resident": MemoryConfig(system="resident"),
    # 12 device slots for 2 rows of 20 entries: most live on the host and come back.
    "ula": MemoryConfig(system="ula", device_pool=12, host_pool=40),
    "hisparse": MemoryConfig(system="hisparse", hisparse=HiSparseConfig(
        device_buffer_size=4, host_to_device_ratio=10.0)),
    "far_tier": MemoryConfig(system="far_tier"),
}


class Fp8Workload(Workload):
  """``Workload`` whose rows are fp8 entries of random magnitudes."""

  _encode = staticmethod(jax.jit(LAYOUT.encode))

  def entries(self, n):
    mag = 10.0 ** self.rng.uniform(-2, 2, size=(self.L, n, 1))
    values = self.rng.standard_normal((self.L, n, LAYOUT.width)) * mag
    return np.asarray(self._encode(values.astype(np.float32)))


@pytest.mark.parametrize("name", sorted(POOL_SYSTEMS))
def test_fp8_rows_round_trip_through_pools(rng, name):
  """Prefill and decode writes of fp8 rows, then reads at ``base + res.slots``: every
  selected row comes back bit for bit, also after ula and hisparse evicted it to the
  host and fetched it back."""
  system = build_memory_system(POOL_SYSTEMS[name], GEO, MeshInfo(1, 1), max_batch=3,
                               page_size=4, max_context=24)
  state = local_state(system)
  assert state.index_keys.dtype == jnp.float32
  pools = [x for x in jax.tree.leaves(state) if x.ndim == 2 and x.shape[1] == 164]
  assert pools and all(p.dtype == jnp.uint8 for p in pools)
  step, prefill = jax.jit(step_fn(system)), jax.jit(prefill_fn(system))
  wl = Fp8Workload(system, rng, max_new=10)
  for row in range(2):
    for a, v, e in wl.admit(row, 2 * CHUNK - 3 + row):
      state = prefill(state, a, v, e, row)
  moved = {"misses": 0, "evictions": 0}
  for _ in range(8):
    sel, sel_valid, new_addr, active = wl.decode_inputs(GEO.top_k, p_inactive=0.0)
    new_e = wl.entries(system.max_batch)
    state, _, _, stats, reads = step(state, sel, sel_valid, new_addr, active, new_e)
    wl.commit(new_addr, active, new_e)
    wl.check_reads(sel, sel_valid, active, np.asarray(reads))
    for s in stats:
      for key in moved:
        moved[key] += int(s.get(key, 0))
  if name in ("ula", "hisparse"):
    assert moved["misses"] > 0 and moved["evictions"] > 0


# ----------------------------------------------------------------------------------
# exactness
# ----------------------------------------------------------------------------------


# Two dense layers in two layer groups (one scanned segment): half the compile time of
# the tiny preset's four, the same code paths.
SMALL = dict(kv_layout="fp8", kv_lora_rank=128, num_layers=2, num_dense_layers=2,
             index_share=1)
ENGINE_SYSTEMS = {
    **TIGHT_SYSTEMS,
    # ula TP mode: heads over 2 tp ranks, entries spread over their pools and fetched
    # from their host pools into the local buffer.
    "ula_tp": ["mesh.dp=1", "mesh.tp=2", "memory.system=ula", "memory.device_pool=48",
               "memory.host_pool=256"],
}


@functools.lru_cache(maxsize=None)
def _requests():
  return make_requests(num=4, seed=5, prompt=(9, 40), output=(3, 7))


@pytest.mark.parametrize("prefill, attention", [("compute", "xla"), ("synthetic", "xla"),
                                                ("compute", "pallas")])
def test_tokens_equal_across_systems_fp8(prefill, attention):
  """Greedy tokens with kv_layout fp8: every system decodes resident's tokens (with
  most steps missing and evicting; ula's TP mode with computed prefill); with computed
  prefill they are also the memory-free reference's (``generate_reference``: prefill
  and dense decode over the same fp8 rows). With the Pallas attention (fp8 rows decoded
  in the kernel; interpreted here) resident, ula and hisparse decode the same tokens."""
  # The all-hit fast path changes no token (tests/test_exactness.py); leaving it out
  # saves compile time.
  base = [f"model.{k}={v}" for k, v in SMALL.items()] + [
      f"workload.prefill={prefill}", "mesh.dp=2", f"engine.max_batch={ROWS}",
      "kernels.resolve_fast_path=false", f"kernels.attention={attention}"]
  tokens = {}
  # far_tier reads the rows its pool holds, which come back bit for bit
  # (test_fp8_rows_round_trip_through_pools); with synthetic prefill, resident against
  # ula (every system's synthetic tokens: tests/test_synthetic_prefill.py).
  systems = [n for n in ENGINE_SYSTEMS if n != "far_tier"
             and (prefill == "compute" or n in ("resident", "ula"))
             and (attention == "xla" or n in ("resident", "ula", "hisparse"))]
  for name in systems:
    result = run_engine(base + ENGINE_SYSTEMS[name], _requests())
    assert [r.status for r in result.requests] == ["finished"] * len(_requests())
    tokens[name] = {r.id: list(r.output_tokens) for r in result.requests}
    if name != "resident" and "far_tier" not in name:
      assert result.summary.get("total_misses", 0) > 0, name
    if name in ("ula", "hisparse"):
      assert result.summary.get("total_evictions", 0) > 0, name
  # The comparison means something only for a model that does not emit one token.
  assert len({tuple(v) for v in tokens["resident"].values()}) > 1
  for name in systems:
    assert tokens[name] == tokens["resident"], name
  if prefill == "compute" and attention == "xla":
    model = tfm.Transformer(ModelConfig(preset="tiny", **SMALL))
    for r in _requests():
      ref = tfm.generate_reference(model, r.prompt, r.max_new_tokens)
      assert tokens["resident"][r.id] == ref.tolist(), r.id
