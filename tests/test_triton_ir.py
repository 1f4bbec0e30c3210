"""What the Pallas kernels compile to for a Hopper GPU, read without one
(``ula_jax.kernels.triton_ir``, ``ula-jax bench kernel_report``)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import pytest

from ula_jax.bench import kernel_report
from ula_jax.memory.ula.resolve.pallas import FUSED_CONFIG
from ula_jax.kernels.sparse_attention.pallas import (AttentionConfig,
                                                     sparse_mla_attention_pallas)
from ula_jax.kernels.triton_ir import (KernelReport, loop_summary, lowered_kernels,
                                       main_loop, sm90_report)

B, H, K, DL, DR = 4, 16, 1024, 64, 16  # 32 blocks of 16 per split: a loop


def lowered(config: AttentionConfig) -> dict:
  f = functools.partial(sparse_mla_attention_pallas, scale=0.1, config=config,
                        interpret=False)
  spec = jax.ShapeDtypeStruct
  return lowered_kernels(f, spec((B, H, DL), jnp.bfloat16), spec((B, H, DR), jnp.bfloat16),
                         spec((512, DL + DR), jnp.bfloat16), spec((B, K), jnp.int32),
                         spec((B, K), jnp.bool_))


def test_kernels_and_their_launch_are_read_from_a_lowered_module():
  kernels = lowered(AttentionConfig(num_splits=2, block_k=16, num_warps=8, num_stages=3))
  assert sorted(kernels) == ["ula_sparse_mla_attention", "ula_sparse_mla_attention_merge"]
  main, merge = kernels["ula_sparse_mla_attention"], kernels["ula_sparse_mla_attention_merge"]
  assert (main.num_warps, main.num_stages) == (8, 3)
  assert (merge.num_warps, merge.num_stages) == (4, 2)
  assert main.ir.startswith("module @ula_sparse_mla_attention") and "tt.dot" in main.ir


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/                   DEPBAR.LE SB0, 0x2 ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
        /*0040*/                   HGMMA.64x32x16.F32.BF16 R8, gdesc[UR8], RZ ;
        /*0050*/                   HGMMA.64x32x16.F32.BF16 R8, gdesc[UR8], R8 ;
        /*0060*/                   STL [R1+0x10], R5 ;
        /*0070*/                   DEPBAR.LE SB0, 0x0 ;
        /*0080*/               @P0 BRA 0x20 ;
        /*0090*/                   LDL R5, [R1+0x10] ;
        /*00a0*/               @P1 BRA 0x90 ;
        /*00b0*/                   EXIT ;
"""


def test_the_main_loop_is_the_longest_backward_branch():
  loop = main_loop(SASS)
  assert [ln.split()[0] for ln in loop] == [f"/*00{a}0*/" for a in "2345678"]
  assert loop_summary(loop) == dict(
      loop_instructions=7, loop_spills=1, loop_async_copies=1, loop_loads=0,
      loop_waits=(2, 0), loop_mma={"HGMMA.64x32x16": 2})
  assert main_loop("        /*0000*/   EXIT ;") == []


def test_report_shows_where_the_row_gathers_are_waited_for():
  """With the split's slots loaded up front the gathers are direct: three stages leave a
  step's copies in flight while it computes. Loaded in the loop, each step's gather hangs
  on a load of the same step, every wait waits for everything, and the slot loads
  remain in the loop."""
  ahead = sm90_report(lowered(AttentionConfig(
      num_splits=2, block_k=16, num_stages=3))["ula_sparse_mla_attention"])
  in_loop = sm90_report(lowered(AttentionConfig(
      num_splits=2, block_k=16, num_stages=3, preload_slots=0))["ula_sparse_mla_attention"])
  for r in (ahead, in_loop):
    assert 0 < r.registers <= 255 and r.shared_bytes > 0 and r.loop_async_copies > 0
    assert r.loop_mma and r.programs_per_sm() >= 1
  assert max(ahead.loop_waits) > 0 and ahead.loop_loads == 0
  assert in_loop.loop_waits and max(in_loop.loop_waits) == 0


def test_kernel_report_benchmark(tmp_path):
  out = tmp_path / "kr.json"
  assert kernel_report.main(["--batch", "2", "--heads", "16", "--k", "64", "--latent", "32",
                             "--rope", "16", "--configs", "auto,h16k16w4n3",
                             "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["batch"], r["config"]) for r in rows] == [(2, "auto"), (2, "h16k16w4n3")]
  assert rows[1]["block_k"] == 16 and rows[1]["num_warps"] == 4
  assert rows[1]["num_stages"] == 3 and rows[1]["registers"] > 0
  with pytest.raises(ValueError, match=r"--configs: 'x1'"):
    kernel_report.main(["--configs", "x1", "--out", str(out)])


def test_resolve_report_keeps_the_one_launch_resident():
  """The one-launch resolve's grid barriers need every program resident at once: its
  compiled registers and shared memory must allow the programs per SM that
  ``kernels.resolve=pallas_fused`` launches (``FUSED_CONFIG``: two of 4 warps) with
  memory.pb_lru_buckets's default ring (32). A launch with more programs than fit never
  passes its first barrier: the GPU hangs."""
  (row,) = kernel_report.resolve_reports(16, 256, 8192, fuse=True, num_sms=4)
  assert row["kernel"] == "ula_resolve_fused" and row["num_warps"] == 4
  assert row["config"] == "pool 8192 fused" and 0 < row["registers"] <= 255
  assert FUSED_CONFIG.resident_per_sm() == 2
  assert row["programs_per_sm"] >= FUSED_CONFIG.resident_per_sm()


@pytest.mark.parametrize("warps, regs, smem, want", [
    (4, 255, 0, 2),  # 65536 / (128 threads * 256 registers)
    (4, 16, 0, 16),  # 16 programs of 4 warps fill the SM's 64 warp slots
    (8, 255, 221440, 1),  # the sparse attention's launch: registers and shared memory
    (1, 8, 1024, 32),  # the SM's 32 block slots
])
def test_programs_per_sm(warps, regs, smem, want):
  r = KernelReport(name="k", num_warps=warps, num_stages=1, shared_bytes=smem,
                   registers=regs, spill_stores=0, spill_loads=0, loop_instructions=0,
                   loop_spills=0, loop_async_copies=0, loop_loads=0, loop_waits=(),
                   loop_mma={}, triton_version="3.6.0")
  assert r.programs_per_sm() == want
