"""Capacity at equal device memory on 8 tp ranks: ``resident`` stores a full copy of the
history on every rank, ``ula`` (layout ``mod``) spreads it, so it admits about 8x the
long requests, less only by the local buffers carved out of the same budget."""

from __future__ import annotations

import functools

from tests.engine_util import DENSE, make_requests, run_engine

DEVICE = 960  # memory.device_pool: tokens per device, the same for both systems
ROWS = 24  # decode rows: more than either system admits
# model.index_topk, the entries a decode step selects: 4, not the tiny preset's 8, so that
# the buffers, and with them the requests whose counts make the ratio, are shorter.
TOP_K = 4
BUFFER = ROWS * (TOP_K + 1)  # ula's default local buffer: 120 tokens per device
PAGE = 64
# Every request needs 304-315 prompt + 2-3 output tokens: 5 pages = 320 tokens.
NEED = 320
COMMON = [*DENSE, "mesh.dp=1", "mesh.tp=8", "model.num_heads=8", f"model.index_topk={TOP_K}",
          f"engine.max_batch={ROWS}", f"engine.page_size={PAGE}", "engine.prefill_chunk=1024",
          f"engine.max_context={NEED}", f"memory.device_pool={DEVICE}"]


@functools.lru_cache(maxsize=None)
def _requests():
  return make_requests(num=22, seed=3, prompt=(304, 316), output=(2, 4))


@functools.lru_cache(maxsize=None)
def _peak(system: str, num: int):
  seen = []
  res = run_engine(COMMON + [f"memory.system={system}"], _requests()[:num],
                   on_step=seen.append)
  assert all(r.status == "finished" for r in res.requests), [
      (r.id, r.reason) for r in res.requests if r.status != "finished"]
  return max(m.admitted for m in seen), res


def test_ula_tp8_mod_admits_about_8x_resident():
  # resident admits 3 at a time: 5 of the requests show its peak (and its tokens, which
  # ula's must equal) in two waves where all 22 would take eight.
  resident, r_res = _peak("resident", 5)
  ula, u_res = _peak("ula", len(_requests()))
  # resident: 960 tokens per device, a full copy on each: 3 requests of 320 tokens.
  assert r_res.summary["capacity_tokens_per_rank"] == DEVICE
  assert resident == 3
  # ula: 960 - 120 = 840 pool tokens per device, x 8 ranks = 6720 = 105 pages of 64:
  # 21 requests of 5 pages. 8 x 3 = 24 less what the buffers take: 8 x 120 tokens.
  assert u_res.summary["capacity_tokens_per_rank"] == 8 * (DEVICE - BUFFER)
  assert ula == 21
  assert 7 * resident <= ula < 8 * resident
  assert ula == 8 * (DEVICE - BUFFER) // PAGE // (NEED // PAGE)
  # At their peaks resident holds 12.5% distinct history; ula's only copies are buffers.
  assert r_res.capacity["distinct_fraction"] == 0.125
  assert u_res.capacity["layout"] == "mod"
  assert u_res.capacity["duplicates"] == 8 * sum(u_res.capacity["buffer_used"])
  assert u_res.capacity["distinct_fraction"] > 0.9
  # Same device memory per rank, and the same tokens.
  assert u_res.capacity["device_bytes_per_rank"] == DEVICE * _token_bytes()
  assert r_res.capacity["device_bytes_per_rank"] == DEVICE * _token_bytes()
  assert [r.output_tokens for r in u_res.requests[:5]] == [r.output_tokens for r in r_res.requests]


def _token_bytes() -> int:
  # The tiny preset: 4 layers x (kv_lora 32 + rope 16) float32 values.
  return 4 * (32 + 16) * 4
