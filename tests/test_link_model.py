"""The far-tier link model: SAC's latency ratios, on-demand vs full prefetch, contention."""

from __future__ import annotations

import numpy as np
import pytest

from ula_jax.memory.far_tier.link_model import (CXL_LATENCY_RATIO, LINK_PRESETS, RDMA_LATENCY_RATIO,
                                       REFERENCE_ROW_BYTES, FarTopology, LinkSpec, link_preset,
                                       modeled_run, transfer_time)

ONE = FarTopology(dp=1, tp=1, num_far_devices=1)


def test_presets_reproduce_sac_sparse_read_latency_ratios():
  """Seed 001: reading n scattered entries costs 1.04-1.64x local DRAM's time over CXL
  and 4-19.7x over RDMA; the ratios move monotonically between those ends with n."""
  dram, cxl, rdma = (LINK_PRESETS[n] for n in ("dram", "cxl", "rdma"))
  n = np.unique(np.logspace(0, 7, 50).astype(int))
  ratio = lambda link: np.array([link.read_time(x, REFERENCE_ROW_BYTES) /
                                 dram.read_time(x, REFERENCE_ROW_BYTES) for x in n])
  r_cxl, r_rdma = ratio(cxl), ratio(rdma)
  lo, hi = CXL_LATENCY_RATIO
  assert np.all((r_cxl >= lo - 1e-9) & (r_cxl <= hi + 1e-9))
  assert np.all(np.diff(r_cxl) <= 1e-12)  # latency-bound -> bandwidth-bound
  assert r_cxl[0] == pytest.approx(hi, rel=0.02) and r_cxl[-1] == pytest.approx(lo, rel=0.01)
  lo, hi = RDMA_LATENCY_RATIO
  assert np.all((r_rdma >= lo - 1e-9) & (r_rdma <= hi + 1e-9))
  assert np.all(np.diff(r_rdma) >= -1e-12)  # per-row work requests dominate as n grows
  assert r_rdma[0] == pytest.approx(lo, rel=0.02) and r_rdma[-1] == pytest.approx(hi, rel=0.01)


# A synthetic link with round numbers, and one request: prefix P rows, T decode steps.
SYN = LinkSpec("syn", latency_s=10e-6, bandwidth_Bps=10e9, port_bandwidth_Bps=10e9,
               op_overhead_s=0.0, gather_efficiency=0.5)
ROW, LAYERS, GROUPS, PREFIX, T = 1000, 4, 2, 8192, 32


def one_request_steps(mode: str, k: int) -> list[dict]:
  """Counters of one request: a prefill step, then T decode steps selecting k entries
  per group (what ``far_tier`` reports for this case)."""
  rows = PREFIX * LAYERS
  prefill = {"compute_s": 0.0, "decode_tokens": 0,
             "far_bulk_rows": rows * (2 if mode == "full_prefetch" else 1),
             "far_bulk_ops": 0}
  decode = {"compute_s": 0.0, "decode_tokens": 1, "far_write_rows": LAYERS,
            "far_write_ops": LAYERS}
  if mode == "on_demand":
    decode.update(far_read_rows=k * LAYERS, far_read_ops=k * LAYERS, far_rounds=GROUPS)
  return [prefill] + [dict(decode) for _ in range(T)]


def test_on_demand_beats_full_prefetch_only_when_little_of_the_kv_is_read():
  """SAC's qualitative result on one link. Fraction read f = T*k / PREFIX. Full prefetch
  pays PREFIX rows once at full bandwidth; on demand pays f*PREFIX rows at the gather
  efficiency plus one latency per group and step. By hand, on demand wins below
  f* = eff * (1 - T*G*lat*bw / (PREFIX*LAYERS*ROW))."""
  total = lambda mode, k: modeled_run(one_request_steps(mode, k), SYN, ONE, ROW)[
      "modeled_total_s"]
  f_star = SYN.gather_efficiency * (1 - T * GROUPS * SYN.latency_s * SYN.bandwidth_Bps /
                                    (PREFIX * LAYERS * ROW))
  assert 0.3 < f_star < 0.5  # the case is built so that the crossover is well inside (0, 1)
  k_for = lambda f: int(round(f * PREFIX / T))
  for f in (0.05, 0.21, 0.8 * f_star):
    assert total("on_demand", k_for(f)) < total("full_prefetch", k_for(f)), f
  for f in (1.2 * f_star, 0.9, 1.0):
    assert total("on_demand", k_for(f)) > total("full_prefetch", k_for(f)), f
  # the modeled difference is exactly the hand-computed one
  k = k_for(0.5)
  hand = (T * GROUPS * SYN.latency_s + T * k * LAYERS * ROW / (SYN.bandwidth_Bps * 0.5)
          - PREFIX * LAYERS * ROW / SYN.bandwidth_Bps)
  assert total("on_demand", k) - total("full_prefetch", k) == pytest.approx(hand, rel=1e-9)


def test_sac_case_cxl_on_demand_vs_rdma_full_prefetch():
  """A DeepSeek-V3.2-like request (128K context, 61 layers, k = 2048, 656-B rows, 1K
  output tokens, 20 ms of compute per step). SAC's per-link findings hold: CXL on-demand
  reaches the first token before RDMA full prefetch (the prefetch sits before decode),
  decodes within 10% of local DRAM's step time, and layer-wise on-demand fetch over RDMA
  is impractical (several times CXL's step time). Without a device cache the on-demand
  mode re-reads k entries per layer every step -- 16x the prefix over this request -- so
  over the whole request full prefetch moves fewer bytes and finishes first, as the
  crossover test predicts for a fraction read well above 1."""
  layers, prefix, out, row, k = 61, 131072, 1024, REFERENCE_ROW_BYTES, 2048

  def steps(mode):
    pre = {"compute_s": 0.5, "decode_tokens": 0, "far_bulk_rows": prefix * layers *
           (2 if mode == "full_prefetch" else 1), "far_bulk_ops": prefix // 64 * layers}
    dec = {"compute_s": 0.02, "decode_tokens": 1, "far_write_rows": layers,
           "far_write_ops": layers}
    if mode == "on_demand":
      dec.update(far_read_rows=k * layers, far_read_ops=k * layers, far_rounds=layers)
    return [pre] + [dict(dec) for _ in range(out)]

  req = [{"arrival_step": 0, "first_token_step": 1}]
  run = lambda mode, link: modeled_run(steps(mode), link_preset(link), ONE, row, req)
  cxl, dram, rdma_od = run("on_demand", "cxl"), run("on_demand", "dram"), run("on_demand", "rdma")
  rdma_full = run("full_prefetch", "rdma")
  assert cxl["modeled_ttft_s"] < rdma_full["modeled_ttft_s"]
  assert cxl["modeled_tbt_s"] < 1.1 * dram["modeled_tbt_s"]
  assert rdma_od["modeled_tbt_s"] > 2 * cxl["modeled_tbt_s"]
  assert rdma_full["modeled_total_s"] < cxl["modeled_total_s"]


def test_interleaving_and_contention():
  """Two dp ranks reading through one far device share its bandwidth; with two far
  devices (round-robin) each has its own. tp ranks of a rank all read the rows."""
  link = LinkSpec("l", latency_s=0.0, bandwidth_Bps=1e9, port_bandwidth_Bps=4e9)
  c = {"far_bulk_rows": np.array([1000, 1000])}
  one = transfer_time(link, FarTopology(2, 1, 1), c, 1000)
  two = transfer_time(link, FarTopology(2, 1, 2), c, 1000)
  assert one == pytest.approx(2 * 1000 * 1000 / 1e9)
  assert two == pytest.approx(1000 * 1000 / 1e9)
  assert FarTopology(4, 2, 3).far_device_of_rank().tolist() == [0, 1, 2, 0]
  assert FarTopology(4, 2, 3).sharers().tolist() == [4, 2, 2]
  tp2 = transfer_time(link, FarTopology(2, 2, 2), c, 1000)
  assert tp2 == pytest.approx(2 * 1000 * 1000 / 1e9)
  # unbalanced ranks: the step waits for the busiest; a scalar is a total spread evenly
  assert transfer_time(link, FarTopology(2, 1, 2), {"far_bulk_rows": np.array([3000, 0])},
                       1000) == pytest.approx(3e-3)
  assert transfer_time(link, FarTopology(2, 1, 2), {"far_bulk_rows": 3000},
                       1000) == pytest.approx(1.5e-3)


def test_modeled_run_ttft_tbt_throughput_by_hand():
  link = LinkSpec("l", latency_s=1e-3, bandwidth_Bps=1e6, port_bandwidth_Bps=1e6,
                  op_overhead_s=1e-4, gather_efficiency=0.5)
  steps = [
      {"step": 0, "compute_s": 0.1, "decode_tokens": 0, "far_bulk_rows": 100, "far_bulk_ops": 2},
      {"step": 1, "compute_s": 0.1, "decode_tokens": 2, "far_read_rows": 10, "far_read_ops": 10,
       "far_rounds": 1},
      {"step": 3, "compute_s": 0.2, "decode_tokens": 1},
  ]
  # bytes of 1000-B rows: 100 bulk rows = 0.1 s; 10 gathered rows at 0.5 efficiency = 0.02 s
  t0 = 0.1 + 1e-3 + 2 * 1e-4 + 0.1
  t1 = 0.1 + 1e-3 + 10 * 1e-4 + 0.02
  t2 = 0.2
  reqs = [{"arrival_step": 0, "first_token_step": 1}, {"arrival_step": 1, "first_token_step": 3},
          {"arrival_step": 2, "first_token_step": None}]
  out = modeled_run(steps, link, ONE, 1000, reqs)
  assert out["modeled_step_s"] == pytest.approx([t0, t1, t2])
  assert out["modeled_total_s"] == pytest.approx(t0 + t1 + t2)
  assert out["modeled_throughput_tok_s"] == pytest.approx(3 / (t0 + t1 + t2))
  assert out["modeled_tbt_s"] == pytest.approx((2 * t1 + t2) / 3)
  assert out["modeled_ttft_s_per_request"] == pytest.approx([t0 + t1, t1 + t2])
  assert out["modeled_ttft_s"] == pytest.approx((t0 + 2 * t1 + t2) / 2)
  assert all("modeled" in key for key in out)


@pytest.mark.parametrize("kwargs, match", [
    (dict(latency_s=-1.0), r"link 'x': latency_s=-1.0 must be >= 0"),
    (dict(bandwidth_Bps=0.0), r"link 'x': bandwidth_Bps=0.0 must be > 0"),
    (dict(gather_efficiency=1.5), r"link 'x': gather_efficiency=1.5 must be in \(0, 1\]"),
])
def test_link_spec_errors(kwargs, match):
  base = dict(latency_s=0.0, bandwidth_Bps=1.0, port_bandwidth_Bps=1.0)
  with pytest.raises(ValueError, match=match):
    LinkSpec("x", **{**base, **kwargs})


def test_lookup_and_shape_errors():
  with pytest.raises(ValueError, match=r"memory.far_tier.link='nvlink': expected one of "
                                       r"\['cxl', 'dram', 'rdma'\]"):
    link_preset("nvlink")
  with pytest.raises(ValueError, match=r"memory.far_tier.num_far_devices=0: must be >= 1"):
    FarTopology(2, 1, 0)
  with pytest.raises(ValueError, match=r"counter 'far_read_rows' has shape \(3,\): expected "
                                       r"a scalar or \[dp\]=\(2,\)"):
    transfer_time(SYN, FarTopology(2, 1, 1), {"far_read_rows": np.ones(3)}, 8)
