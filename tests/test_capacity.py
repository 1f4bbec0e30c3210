"""Capacity: what each system admits for the same memory, and who may use the device pool."""

from __future__ import annotations

import numpy as np

from ula_jax.engine import Request
from tests.engine_util import DENSE, make_requests, run_engine

DEVICE, HOST = 256, 512  # tokens per dp rank


def _peak_admitted(overrides, reqs):
  seen = []
  res = run_engine(DENSE + ["mesh.dp=1", "engine.max_batch=16", "engine.page_size=32"]
                   + overrides, reqs, on_step=seen.append)
  assert all(r.status == "finished" for r in res.requests)
  return max(m.admitted for m in seen), res, seen


def test_ula_admits_resident_plus_what_the_host_holds():
  # Every request needs 2 pages of 32 tokens: resident fits 256/64 = 4 at once,
  # ula (256 device + 512 host tokens) fits 4 + 512/64 = 12.
  reqs = make_requests(num=14, seed=11, prompt=(40, 48), output=(10, 16))
  resident, r_res, _ = _peak_admitted([f"memory.device_pool={DEVICE}"], reqs)
  ula, u_res, seen = _peak_admitted(
      ["memory.system=ula", f"memory.device_pool={DEVICE}", f"memory.host_pool={HOST}"], reqs)
  assert r_res.summary["capacity_tokens_per_rank"] == DEVICE
  assert u_res.summary["capacity_tokens_per_rank"] == DEVICE + HOST
  assert resident == 4
  assert ula == resident + HOST // 64
  # Exclusive tiers: nothing is stored twice.
  assert u_res.capacity["duplicates"] == 0
  assert max(m.host_used for m in seen) > 0
  assert [r.output_tokens for r in u_res.requests] == [r.output_tokens for r in r_res.requests]


def test_a_lone_request_uses_the_whole_device_pool():
  # One request as large as the device pool: no per-request quota keeps it on host.
  req = Request(id="lone", prompt=np.arange(DEVICE - 16, dtype=np.int32) % 200,
                max_new_tokens=12)
  _, res, seen = _peak_admitted(
      ["memory.system=ula", f"memory.device_pool={DEVICE}", f"memory.host_pool={HOST}"], [req])
  assert max(m.host_used for m in seen) == 0
  assert res.summary.get("total_misses", 0) == 0
  assert res.summary["total_hits"] > 0
  groups = res.capacity["device_capacity"][0][0] // DEVICE
  # Every entry is on device. Reports come at the end of a step, and the last decode
  # step's entry is written and released in that step: the peak report holds the prompt
  # and all generated tokens but the last two.
  assert max(m.device_used for m in seen) == (req.prompt_len + req.max_new_tokens - 2) * groups
