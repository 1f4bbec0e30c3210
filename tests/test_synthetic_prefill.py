"""``workload.prefill='synthetic'``: prompt KV from a seeded generator, no model compute.

Every memory system gets the same entries, so greedy tokens still agree token for token
across systems; the entries depend on the seed, the request and the position only (not
on the chunking, the dp rank or the model's parameters).
"""

from __future__ import annotations

import functools
import logging
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.config import ConfigError, load_config
from ula_jax.engine import Engine, Request, resolve_max_context
from ula_jax.engine import synthetic_prefill as sp
from ula_jax.models import transformer as tfm
from ula_jax.models.config import ModelConfig
from tests.engine_util import BASE, DENSE, ROWS, TIGHT_SYSTEMS, make_requests, mesh_for

# The resolve's all-hit fast path is left out: it changes no token (tests/test_exactness.py
# runs it) and takes a third of the compile time of these runs. The MLPs are dense
# (``DENSE``): what synthetic prefill stores and the tokens compared across systems do not
# depend on the kind of MLP.
SYNTHETIC = ["workload.prefill=synthetic", "model.preset=tiny", "engine.progress=false",
             "kernels.resolve_fast_path=false", *DENSE]

SYSTEMS = TIGHT_SYSTEMS


@functools.lru_cache(maxsize=None)
def _requests() -> tuple[Request, ...]:
  # Prompts of one and two tokens too: nothing to generate, and a chunk of one position.
  edge = (Request("one", np.asarray([7], np.int32), 3),
          Request("two", np.asarray([9, 4], np.int32), 1))
  return make_requests(num=6, seed=99, prompt=(9, 70), output=(3, 8)) + edge


def _engine(overrides: list[str]) -> Engine:
  cfg = load_config(BASE, SYNTHETIC + list(overrides))
  return Engine(cfg, mesh_for(cfg.mesh.dp, cfg.mesh.tp), max_context=resolve_max_context(cfg))


@functools.lru_cache(maxsize=None)
def _run(name: str):
  engine = _engine(["mesh.dp=2", f"engine.max_batch={ROWS}"] + SYSTEMS[name])
  return engine.run(list(_requests()))


def _tokens(result) -> dict[str, list[int]]:
  return {r.id: list(r.output_tokens) for r in result.requests}


def _geo():
  return ModelConfig(preset="tiny").kv_geometry()


# ----------------------------------------------------------------------------------
# the generator
# ----------------------------------------------------------------------------------


# One compiled generator per (geometry, seed, chunk length): eager dispatch would compile
# every random primitive for every shape.
_chunk = jax.jit(sp.synthetic_chunk, static_argnums=(0, 1, 4))


def test_any_split_into_chunks_gives_the_same_bits(rng):
  geo, rid = _geo(), jnp.int32(rng.integers(-2**31, 2**31))
  entries, keys = _chunk(geo, 3, rid, jnp.int32(0), 64)
  assert entries.shape == (geo.num_layers, 64, geo.entry_width)
  assert keys.shape == (geo.num_groups, 64, geo.index_dim)
  parts = [_chunk(geo, 3, rid, jnp.int32(a), 16) for a in range(0, 64, 16)]
  np.testing.assert_array_equal(np.concatenate([p[0] for p in parts], axis=1), entries)
  np.testing.assert_array_equal(np.concatenate([p[1] for p in parts], axis=1), keys)
  # An unaligned chunk, and one that runs past the prompt (the engine's last chunk).
  a = int(rng.integers(1, 48))
  shifted, shifted_keys = _chunk(geo, 3, rid, jnp.int32(a), 16)
  np.testing.assert_array_equal(shifted, entries[:, a:a + 16])
  np.testing.assert_array_equal(shifted_keys, keys[:, a:a + 16])
  past, _ = _chunk(geo, 3, rid, jnp.int32(56), 16)
  np.testing.assert_array_equal(past[:, :8], entries[:, 56:])


def test_values_have_the_models_scale_and_depend_on_seed_request_and_position():
  geo = _geo()
  entries, keys = _chunk(geo, 3, jnp.int32(1), jnp.int32(0), 64)
  # Standard normals, as the model's normed latent, rope key and indexer key (std ~1).
  assert abs(float(entries.std()) - 1) < 0.05 and abs(float(keys.std()) - 1) < 0.1
  assert abs(float(entries.mean())) < 0.05
  other_req, _ = _chunk(geo, 3, jnp.int32(2), jnp.int32(0), 64)
  other_seed, _ = _chunk(geo, 2**40 + 3, jnp.int32(1), jnp.int32(0), 64)  # past 32 bits
  for other in (other_req, other_seed):
    assert not np.any(np.asarray(other) == np.asarray(entries))
  # Positions and layers are independent draws (no built-in locality).
  assert not np.any(np.asarray(entries[:, 1:]) == np.asarray(entries[:, :-1]))
  assert not np.any(np.asarray(entries[1:]) == np.asarray(entries[:-1]))


def test_stored_dtypes_are_the_models():
  geo = ModelConfig(preset="small").kv_geometry()
  entries, keys = _chunk(geo, 0, jnp.int32(0), jnp.int32(0), 4)
  assert entries.dtype == jnp.bfloat16 and keys.dtype == jnp.dtype(geo.index_dtype)


def test_chunk_len_fits_the_byte_budget():
  glm5 = ModelConfig(preset="glm5").kv_geometry()
  assert sp.token_bytes(glm5) == 78 * 576 * 2 + 20 * 128 * 2
  assert sp.chunk_len(glm5, 4096, 163840) == 8192
  assert sp.chunk_len(glm5, 16384, 163840) == 16384  # never below engine.prefill_chunk
  assert sp.chunk_len(glm5, 4096, 6144) == 6144  # never beyond the context
  assert sp.chunk_len(glm5, 1, 10**6, budget_bytes=1) == 1


def test_request_key_is_a_stable_32_bit_hash():
  assert sp.request_key("req-0001") == sp.request_key("req-0001")
  assert sp.request_key("req-0001") != sp.request_key("req-0002")
  assert all(0 <= sp.request_key(f"r{i}") < 2**32 for i in range(100))


# ----------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(set(SYSTEMS) - {"resident"}))
def test_greedy_tokens_equal_across_systems(name):
  ref, got = _run("resident"), _run(name)
  assert [r.status for r in got.requests] == ["finished"] * len(_requests()), [
      (r.id, r.reason) for r in got.requests if r.status != "finished"]
  assert _tokens(got) == _tokens(ref)
  for r, req in zip(got.requests, _requests()):
    assert len(r.output_tokens) == req.max_new_tokens
    assert r.first_token_step is not None and r.ttft_s is not None
  if name != "far_tier":  # the small pools really moved entries
    assert got.summary.get("total_misses", 0) > 0


def test_tokens_are_not_degenerate():
  toks = _tokens(_run("resident"))
  assert len({tuple(v) for v in toks.values()}) > 1
  assert len({t for v in toks.values() for t in v}) > 3


def test_decode_rounds_are_timed_apart_from_the_chunks():
  """A step that ran a synthetic chunk waited for it before its decode round (the
  chunk's device work is not in ``decode_time_s``); other steps did not wait."""
  res = _run("resident")
  chunked = [m for m in res.steps if m.prefilling]
  assert chunked and all(m.prefill_wait_s >= 0 for m in chunked)
  assert all(m.prefill_wait_s == 0 for m in res.steps if not m.prefilling)
  assert all(m.prefill_wait_s + m.decode_time_s <= m.step_time_s for m in res.steps)
  assert res.summary["prefill_wait_s"] == sum(m.prefill_wait_s for m in res.steps)


def test_summary_says_synthetic(caplog):
  s = _run("resident").summary
  assert s["prefill"] == "synthetic" and "not a trained model's" in s["prefill_note"]
  with caplog.at_level(logging.WARNING):
    _engine(["mesh.dp=2"])
  assert "selections over synthetic keys are not a trained model's" in caplog.text
  assert sp.NOTE.startswith("workload.prefill='synthetic'")


def _no_prefill(*args, **kwargs):
  raise AssertionError("synthetic prefill ran the model's prefill_chunk")


@functools.lru_cache(maxsize=None)
def _first_step(param_seed: int = 0, chunk: int | None = None):
  """One request (on dp rank 0) run until its first decode step, which comes in the step
  of its last prefill chunk, with the model's prefill replaced by an error; the mesh and
  rows of ``_run``, so the decode program is shared.
  Returns (rank 0's pool [L, S, W], tokens, prompt length, engine)."""
  req = make_requests(num=1, seed=5, prompt=(40, 41), output=(4, 5))
  P = req[0].prompt_len
  steps = 1 if chunk is None else -(-(P - 1) // chunk)
  with mock.patch.object(tfm, "prefill_chunk", _no_prefill):
    engine = _engine(["mesh.dp=2", f"engine.max_batch={ROWS}", f"engine.max_steps={steps}",
                      f"model.param_seed={param_seed}"])
    if chunk is not None:
      engine.chunk = chunk
    result = engine.run(list(req))
  geo = engine.geo
  pool = np.asarray(engine.state.pools)[0].reshape(geo.num_layers, -1, geo.entry_width)
  return pool, result.requests[0].output_tokens, P, engine


def test_chunking_does_not_change_entries_or_tokens():
  whole, tok_whole, P, engine = _first_step()
  assert engine.chunk >= P  # the default synthetic chunk holds the whole prompt
  split, tok_split, _, _ = _first_step(chunk=7)
  np.testing.assert_array_equal(split, whole)
  assert tok_split == tok_whole and len(tok_whole) == 1
  # Positions [0, P-1) are the generator's; position P-1 was decoded by the model.
  want, _ = _chunk(engine.geo, 0, jnp.uint32(sp.request_key("r0")), jnp.int32(0), P - 1)
  np.testing.assert_array_equal(whole[:, :P - 1], np.asarray(want))
  assert np.any(whole[:, P - 1] != 0)
  assert not np.any(whole[:, P:])


def test_no_model_compute_and_entries_do_not_depend_on_the_parameters():
  # (``_first_step`` runs with the model's prefill replaced by an error.)
  a, _, P, _ = _first_step(param_seed=0)
  b, _, _, _ = _first_step(param_seed=1)
  np.testing.assert_array_equal(a[:, :P - 1], b[:, :P - 1])
  # The prompt's last position is the model's own entry: the parameters show there.
  assert np.any(a[:, P - 1] != b[:, P - 1])


def test_prefill_program_has_no_matrix_products():
  # The compute path's prefill multiplies by the model's weights; the synthetic one only
  # generates and stores.
  compute = Engine(load_config(BASE, ["model.preset=tiny", "mesh.dp=2"]), mesh_for(2))
  assert "dot_general" in compute.lower_step("prefill").as_text()
  assert "dot_general" not in _engine(["mesh.dp=2"]).lower_step("prefill").as_text()


def test_bad_value_names_the_field():
  with pytest.raises(ConfigError, match=r"workload.prefill='model': expected one of "
                     r"'compute' or 'synthetic'"):
    load_config(BASE, ["workload.prefill=model"])
  assert load_config(BASE, []).workload.prefill == "compute"
  with pytest.raises(ValueError, match=r"workload.seed=-1: must be >= 0"):
    sp.synthetic_chunk(_geo(), -1, jnp.int32(0), jnp.int32(0), 1)


def test_a_synthetic_chunk_that_does_not_fit_is_halved_and_the_tokens_stay(monkeypatch, caplog):
  """On a GPU the step-memory check sets each program's working memory against the free
  bytes (given here): a synthetic chunk is halved until it fits, below
  engine.prefill_chunk too, and the run decodes the same tokens."""
  from ula_jax.engine import engine as engine_module
  overrides = ["mesh.dp=1", "engine.max_batch=2"]
  requests = list(_requests())[:3]
  want = _tokens(_engine(overrides + ["engine.prefill_chunk=8"]).run(requests))

  # The chunk the user asked for (as the summarisation experiments set
  # engine.prefill_chunk: 32768), halved below it.
  chunk = _engine(overrides).chunk
  engine = _engine(overrides + [f"engine.prefill_chunk={chunk}"])
  assert engine.chunk == chunk
  need = lambda step: sum(engine.working_memory(step))
  decode, prefill = need("decode"), need("prefill")
  engine.chunk = chunk // 2
  half = need("prefill")
  engine.chunk = chunk
  assert chunk // 2 >= 8 and max(decode, half) < prefill, (decode, half, prefill)
  limit = 79 * 2**30
  monkeypatch.setattr(engine_module, "memory_stats", lambda device: {
      "bytes_in_use": limit - max(decode, half), "bytes_limit": limit})
  with caplog.at_level(logging.WARNING):
    result = engine.run(requests)
  assert engine.chunk == chunk // 2
  assert result.summary["prefill_chunk"] == chunk // 2
  assert result.summary["step_memory"]["prefill_need_bytes"] == half
  assert (f"chunk of {chunk} positions (engine.prefill_chunk={chunk}) did not fit beside "
          f"the pools; chunks of {chunk // 2} positions are used") in caplog.text
  assert _tokens(result) == want
