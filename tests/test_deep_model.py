"""A deep model (a mixed first group, regular groups, a short last group) decodes the
same tokens through every memory system as ``resident`` and as the dense reference; and
the compiled decode step and prefill chunk do not grow with depth (the layer stack is a
loop over layer groups)."""

from __future__ import annotations

import functools

import pytest

from tests.engine_util import ROWS, TIGHT_SYSTEMS, make_requests, run_engine
from ula_jax.config import load_config
from ula_jax.models import transformer as tfm

# 14 layers, 3 dense, groups of 4: [D D D M] [M M M M] x 2 [M M]: three segments.
DEEP = ["model.num_layers=14", "model.num_dense_layers=3", "model.index_share=4"]
SYSTEMS = {
    "ula_pb_lru": TIGHT_SYSTEMS["ula"],
    "ula_tp_mod": ["memory.system=ula", "mesh.tp=2", "memory.layout=mod"],
    "hisparse": TIGHT_SYSTEMS["hisparse"],
    "far_tier": TIGHT_SYSTEMS["far_tier"],
}


@functools.lru_cache(maxsize=None)
def _requests():
  return make_requests(num=4, seed=77, prompt=(9, 40), output=(4, 9))


@functools.lru_cache(maxsize=None)
def _run(name: str):
  extra = {"resident": [], "resident_tp": ["mesh.tp=2"], **SYSTEMS}[name]
  tp = 2 if "mesh.tp=2" in extra else 1
  mesh = [f"mesh.dp={2 // tp}", f"mesh.tp={tp}"]
  heads = ["model.num_heads=4"] if tp > 1 else []
  return run_engine(DEEP + mesh + heads + [f"engine.max_batch={ROWS}"] + extra, _requests())


def _tokens(result):
  return {r.id: r.output_tokens for r in result.requests}


def test_deep_model_has_a_mixed_first_and_a_short_last_group():
  cfg = load_config("experiments/quickstart/config.yaml", ["model.preset=tiny", *DEEP]).model
  segs = tfm.group_segments(cfg)
  assert [(s.num_groups, s.dense) for s in segs] == [
      (1, (True, True, True, False)), (2, (False,) * 4), (1, (False, False))]


def test_resident_matches_the_dense_reference():
  result = _run("resident")
  cfg = load_config("experiments/quickstart/config.yaml", ["model.preset=tiny", *DEEP]).model
  model = tfm.Transformer(cfg)
  for req, got in zip(_requests(), result.requests):
    assert got.status == "finished"
    ref = tfm.generate_reference(model, req.prompt, req.max_new_tokens)
    assert got.output_tokens == ref.tolist(), req.id


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_every_system_decodes_residents_tokens(name):
  ref, got = _run("resident"), _run(name)
  assert [r.status for r in got.requests] == ["finished"] * len(got.requests)
  if "tp" in name:  # tp=2 sums heads in another order: compare on its own mesh
    ref = _run("resident_tp")
  assert _tokens(got) == _tokens(ref)
  if name.startswith("ula_") and "tp" not in name:
    assert got.summary["total_misses"] > 0 and got.summary["total_evictions"] > 0


def test_compiled_steps_do_not_grow_with_depth():
  from ula_jax.bench.compile import measure

  # resident and ula on CPU and on an H200 at 8 / 32 / 78 layers: RESULTS.md.
  out = measure("experiments/quickstart/config.yaml",
                ["model.preset=tiny", "mesh.dp=1", "mesh.platform=cpu",
                 "model.num_dense_layers=1", "model.index_share=2", "memory.host_pool=256"],
                ["ula"], [4, 24], batch=2, context=128, kinds=("decode",))
  for system, by_layers in out["systems"].items():
    for kind, r in by_layers[24].items():
      # Six times the layers, the same program: a few more ops for the extra segment at
      # most (a short last group), nothing per layer.
      assert r["ops_ratio"] <= 1.25, (system, kind, r)
