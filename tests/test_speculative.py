"""Speculative decoding (``speculative.num_draft``): with 1, 2 and 3 MTP drafts per step,
every memory system decodes exactly the greedy tokens of plain decoding, request by
request; drafts are accepted where they are right (oracle drafts), the summary counts
them, nothing leaks, and impossible configurations are refused.

Every run decodes three requests, two at a time, on one dp rank of the tiny model cut to
two one-layer groups, with synthetic prompt KV (no prefill compute) and pools small
enough that entries miss and move. Drafts come from the model's (random) MTP block,
except where a test replaces them by the reference's own next tokens (``_oracle``): one
request with right drafts, one with its last draft wrong, one with the block's own.

Each (system, num_draft) pair compiles a verify step of its own (a few seconds on a CPU),
so the suite runs the pairs of ``MATRIX``: every system, every num_draft on at least two
systems, 3 drafts in TP mode. ``ULA_SPECULATIVE_MATRIX=full`` runs all fifteen.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from ula_jax.config import ConfigError, load_config
from ula_jax.core.types import INVALID
from ula_jax.engine import Engine, checkpoint, resolve_max_context
from ula_jax.memory import MeshInfo, system_class
from ula_jax.models.checkpoint import CONFIG_FILE, PARAMS_DIR, load_model, mtp_saved
from ula_jax.models.config import ModelConfig
from ula_jax.models.mtp import mtp_count
from ula_jax.models.transformer import Transformer

from tests.engine_util import BASE, TOP_K, make_requests, mesh_for

ROWS = 2  # decode rows (engine.max_batch)
MAX_ROWS = ROWS * (1 + 3) * (TOP_K + 1)  # one verify step's entries with 3 drafts: 72
COMMON = ["model.preset=tiny", "engine.progress=false", f"engine.max_batch={ROWS}",
          "model.num_layers=2", "model.index_share=1", "model.num_dense_layers=2",
          "engine.max_context=128", "engine.page_size=16", "engine.pack_state=false",
          "engine.report_every=1000", "workload.prefill=synthetic"]
# The same pools for every num_draft (sized for 3 drafts), so that one system's runs
# share their prefill and release programs.
SYSTEMS = {
    "resident": ["mesh.dp=1"],
    "ula": ["mesh.dp=1", "memory.system=ula", f"memory.device_pool={MAX_ROWS}",
            "memory.host_pool=512"],
    "ula_tp": ["mesh.dp=1", "mesh.tp=2", "memory.system=ula", "memory.layout=mod",
               f"memory.local_buffer={MAX_ROWS}", f"memory.device_pool={MAX_ROWS + 128}"],
    "hisparse": ["mesh.dp=1", "memory.system=hisparse",
                 f"memory.hisparse.device_buffer_size={(1 + 3) * (TOP_K + 1) - 1}",
                 "memory.hisparse.host_to_device_ratio=16"],
    "far_tier": ["mesh.dp=1", "memory.system=far_tier"],
    "resident_tp": ["mesh.dp=1", "mesh.tp=2"],  # TP mode's reference
}
REFERENCE = {"ula_tp": "resident_tp"}  # the plain decoding a system's tokens must equal
RIGHT, LAST_WRONG = "r1", "r2"  # requests whose drafts ``_oracle`` replaces
MATRIX = [("resident", 1), ("resident", 3), ("ula", 1), ("hisparse", 2), ("far_tier", 2),
          ("ula_tp", 3)]
if os.environ.get("ULA_SPECULATIVE_MATRIX") == "full":
  MATRIX = [(s, d) for s in ("resident", "ula", "ula_tp", "hisparse", "far_tier")
            for d in (1, 2, 3)]


@functools.lru_cache(maxsize=None)
def _requests():
  return make_requests(num=3, seed=2024, prompt=(50, 100), output=(6, 10))


def _tokens(result) -> dict:
  return {r.id: r.output_tokens for r in result.requests}


def _oracle(engine: Engine, truth: dict, check) -> None:
  """Replaces the drafts of ``RIGHT`` (every draft right) and ``LAST_WRONG`` (the last
  draft wrong) by ``truth``'s next tokens after each verify step, and calls
  ``check(engine)`` there."""
  verify_round = engine._verify_round

  def round_(rows, step):
    out = verify_round(rows, step)
    for l in (l for rank in rows for l in rank if l is not None):
      if l.req.id in (RIGHT, LAST_WRONG) and l.drafts:
        ahead = list(truth[l.req.id][len(l.generated):])[:engine.num_draft]
        drafts = ahead + [0] * (engine.num_draft - len(ahead))
        if l.req.id == LAST_WRONG:
          drafts[-1] = (drafts[-1] + 1) % engine.cfg.model.vocab_size
        l.drafts = drafts
    check(engine)
    return out

  engine._verify_round = round_


def _ula_consistent(engine: Engine) -> None:
  """ula DP: every stored address in one place, and each slot's owner maps back to it."""
  m = engine.state.meta
  table, dev, host = (np.asarray(x)[0] for x in (m.table, m.dev_owner, m.host_owner))
  Sd = dev.shape[1]
  for g in range(table.shape[0]):
    stored = np.flatnonzero(table[g] != INVALID)
    loc = table[g, stored]
    on_dev = loc < Sd
    assert np.array_equal(dev[g, loc[on_dev]], stored[on_dev])
    assert np.array_equal(host[g, loc[~on_dev] - Sd], stored[~on_dev])
    assert (dev[g] != INVALID).sum() + (host[g] != INVALID).sum() == stored.size


@functools.lru_cache(maxsize=None)
def _run(system: str, num_draft: int, oracle: bool = True):
  """(RunResult, the memory system's capacity report after the run); with ``oracle``,
  ``_oracle`` drafts for ``RIGHT`` and ``LAST_WRONG`` (and ula's tables checked after
  every step)."""
  cfg = load_config(BASE, COMMON + SYSTEMS[system] + [f"speculative.num_draft={num_draft}"])
  engine = Engine(cfg, mesh_for(cfg.mesh.dp, cfg.mesh.tp), max_context=resolve_max_context(cfg))
  if num_draft and oracle:
    ref = _run(REFERENCE.get(system, "resident"), 0)[0]
    _oracle(engine, _tokens(ref), _ula_consistent if system == "ula" else lambda e: None)
  result = engine.run(list(_requests()))
  return result, engine.mem.report(engine.state)


@pytest.mark.parametrize("system,num_draft", MATRIX)
def test_greedy_tokens_equal_plain_decoding(system, num_draft):
  ref = _run(REFERENCE.get(system, "resident"), 0)[0]
  got, after = _run(system, num_draft)
  assert [r.status for r in got.requests] == ["finished"] * len(_requests())
  assert _tokens(got) == _tokens(ref)
  s = got.summary
  # The right drafts were accepted, so some steps gained several tokens.
  assert 0 < s["total_accepted"] <= s["total_drafted"]
  assert s["acceptance_rate"] == s["total_accepted"] / s["total_drafted"]
  assert s["tokens_per_verify_step"] == pytest.approx(
      1 + s["total_accepted"] / s["verify_steps"])
  assert s["num_draft"] == num_draft and s["mtp_weights"] == "param_seed"
  assert s["steps"] < ref.summary["steps"]
  # Every entry was released: rejected drafts' entries included.
  assert after.distinct_total == 0
  if system != "far_tier":  # (far_tier's staging area counts the last step's rows)
    assert int(after.device_used.sum()) == 0 and int(after.host_used.sum()) == 0
  if system in ("ula", "ula_tp", "hisparse"):
    assert s["total_misses"] > 0  # entries really moved
  if system in ("ula", "ula_tp"):
    assert s["total_evictions"] > 0


def test_random_drafts_are_rarely_accepted_and_counted_per_step():
  got, _ = _run("resident", 3, oracle=False)
  ref = _run("resident", 0)[0]
  assert _tokens(got) == _tokens(ref)
  s = got.summary
  decode_steps = [m for m in got.steps if m.decode_tokens]
  assert s["total_drafted"] == sum(m.extra["drafted"] for m in decode_steps) > 0
  assert s["total_accepted"] == sum(m.extra["accepted"] for m in decode_steps)
  assert s["acceptance_rate"] < 0.2  # the MTP block is random
  # A request's first decode step has no drafts, and none past its last token.
  assert s["total_drafted"] < 3 * s["verify_steps"]
  # Every token came from a verify step (synthetic prefill computes no first token).
  assert sum(m.decode_tokens for m in decode_steps) == s["generated_tokens"]
  assert s["verify_steps"] == sum(m.running for m in decode_steps)


def test_a_checkpointed_run_resumes_with_its_drafts(tmp_path):
  whole, _ = _run("resident", 3, oracle=False)
  cfg = load_config(BASE, COMMON + SYSTEMS["resident"] + ["speculative.num_draft=3"])
  mesh, requests = mesh_for(1), list(_requests())

  def stop(m):
    if m.step == 4:
      raise KeyboardInterrupt

  first = Engine(cfg, mesh, max_context=resolve_max_context(cfg))
  first.run(requests, on_step=stop)
  drafts = [list(l.drafts) for rank in first.run_state.rows for l in rank if l is not None]
  assert any(drafts)  # the requests running at the stop hold the next step's drafts
  path = checkpoint.save(first, tmp_path / "checkpoint")
  engine = Engine(cfg, mesh, max_context=resolve_max_context(cfg))
  resumed = engine.run(requests, resume=checkpoint.restore(engine, path, requests))
  assert _tokens(resumed) == _tokens(whole)
  for key in ("steps", "total_drafted", "total_accepted", "verify_steps"):
    assert resumed.summary[key] == whole.summary[key], key


def _cfg(*overrides: str):
  return load_config(BASE, COMMON + ["mesh.dp=1"] + list(overrides))


@pytest.mark.parametrize("overrides,match", [
    (["speculative.num_draft=4"],
     r"speculative.num_draft=4: expected 0 \(off\), 1, 2 or 3 draft tokens"),
    (["speculative.num_draft=-1"], r"speculative.num_draft=-1: expected 0 \(off\)"),
    (["speculative.num_draft=true"], r"speculative.num_draft=True: expected 0 \(off\)"),
    (["speculative.drafts=2"], r"unknown field 'speculative.drafts'.*num_draft"),
    (["speculative.num_draft=1", "engine.record_trace=true"],
     r"speculative.num_draft=1 cannot be combined with engine.record_trace"),
    (["speculative.num_draft=2", "kernels.fast_path_mode=speculate"],
     r"speculative.num_draft=2 cannot be combined with kernels.fast_path_mode"),
    (["speculative.num_draft=1", "memory.system=hisparse",
      "memory.hisparse.device_buffer_size=8"],
     r"memory.hisparse.device_buffer_size=8: with speculative.num_draft=1 a request's "
     r"buffer .* = 2 x \(8 \+ 1\) = 18; use memory.hisparse.device_buffer_size >= 17"),
    (["speculative.num_draft=3", "memory.system=ula", "memory.device_pool=40"],
     r"memory.device_pool=40 holds 40 tokens per device, fewer than one decode step needs "
     r"on the device: engine.max_batch \* \(1 \+ speculative.num_draft\) \* \(top-k \+ 1\) "
     r"= 2 \* 4 \* \(8 \+ 1\) = 72"),
    (["speculative.num_draft=1", "memory.system=ula", "mesh.tp=2", "memory.local_buffer=20"],
     r"memory.local_buffer=20 is smaller than one decode step's selection: engine.max_batch "
     r"\* \(1 \+ speculative.num_draft\) \* \(top-k \+ 1\) = 36"),
    (["speculative.num_draft=1", "workload.kind=trace", "workload.trace=t.npz"],
     r"speculative.num_draft=1 cannot be combined with workload.kind"),
])
def test_impossible_speculative_configs_are_refused(overrides, match):
  with pytest.raises(ConfigError, match=match):
    _cfg(*overrides)


def test_memory_systems_check_a_verify_steps_entries():
  """The systems' own checks, for callers that size them without a config."""
  def system(name: str, step_rows: int, *overrides: str):
    cfg = _cfg(*overrides)
    return system_class(name)(cfg.memory, cfg.model.kv_geometry(), MeshInfo(1, 1),
                              max_batch=ROWS, page_size=16, max_context=128,
                              step_rows=step_rows)

  with pytest.raises(ValueError, match=r"memory.hisparse.device_buffer_size=8: with "
                     r"speculative.num_draft=1 .* = 18; use memory.hisparse.device_buffer_"
                     r"size >= 17"):
    system("hisparse", 2, "memory.system=hisparse",
           "memory.hisparse.device_buffer_size=8").validate()
  with pytest.raises(ValueError, match=r"fewer than one decode step needs on the device: "
                     r"engine.max_batch \* \(1 \+ speculative.num_draft\) \* \(top_k "
                     r"\+ 1\) = 2 \* 3 \* \(8 \+ 1\) = 54; use memory.device_pool >= 54"):
    system("ula", 3, "memory.system=ula", "memory.device_pool=40").validate()
  far = system("far_tier", 2, "memory.system=far_tier")
  state = jax.tree.map(lambda x: x[0], far.init_state(mesh_for(1)))
  with pytest.raises(ValueError, match=r"selection width k=17 and 2 new tokens exceed a "
                     r"request's staging area of 18 slots"):
    jax.eval_shape(lambda st: far.resolve_rows(
        st, 0, jnp.zeros((ROWS, 17), jnp.int32), jnp.ones((ROWS, 17), bool),
        jnp.zeros((ROWS, 2), jnp.int32), jnp.ones((ROWS, 2), bool)), state)


def test_every_preset_has_an_mtp_block_and_old_checkpoints_still_load(tmp_path):
  for preset in ("tiny", "small"):  # (the module is the same in every preset)
    cfg = ModelConfig(preset=preset)
    model = nnx.eval_shape(lambda cfg=cfg: Transformer(cfg))
    count = mtp_count(cfg)
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model.mtp))) == (
        count["matrix"] + count["vector"])
  # A checkpoint written before the MTP block: the block is drawn from param_seed.
  cfg = ModelConfig(preset="tiny", param_seed=3)
  path = tmp_path / "old"
  path.mkdir()
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path / PARAMS_DIR, nnx.state(Transformer(cfg), nnx.Not(nnx.PathContains("mtp"))))
    ckpt.wait_until_finished()
  (path / CONFIG_FILE).write_text(cfg.model_dump_json())
  assert not mtp_saved(path)
  old = ModelConfig(**{**cfg.model_dump(), "param_seed": 0, "checkpoint": str(path)})
  model, fresh = load_model(old), Transformer(old)
  np.testing.assert_array_equal(np.asarray(model.mtp.w_proj[...]),
                                np.asarray(fresh.mtp.w_proj[...]))
  assert not np.array_equal(np.asarray(model.embed[...]), np.asarray(fresh.embed[...]))
  # The committed trained model holds its trained block (experiments/train_small).
  path = "experiments/train_small/model"
  assert mtp_saved(path)
  saved = json.loads(Path(path, "model_config.json").read_text())
  cfg = ModelConfig(**{**saved, "checkpoint": path})
  model, fresh = load_model(cfg), Transformer(cfg)
  assert not np.array_equal(np.asarray(model.mtp.w_proj[...]),
                            np.asarray(fresh.mtp.w_proj[...]))
