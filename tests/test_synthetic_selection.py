"""``workload.selections='synthetic'``: decode steps rank positions by seeded scores of
stated locality (``kernels.indexer.synthetic``).

The scores depend only on (seed, group, position, the row's length), so every memory
system selects the same positions and greedy tokens still agree across systems; the
indexer's scores stay in the program but never change the ranking; at GLM-5 geometry
the defaults give a trained model's step-to-step overlap.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.config import ConfigError, load_config
from ula_jax.kernels.indexer import synthetic as syn
from tests.engine_util import BASE, DENSE, ROWS, TIGHT_SYSTEMS, make_requests, run_engine

SPEC = syn.SyntheticSelection()


def _selections(spec, group, lengths, k) -> list[set[int]]:
  """The positions the top-k takes for rows whose new tokens sit at ``lengths``."""
  L = jnp.asarray(lengths, jnp.int32)
  width = int(max(lengths)) + 1
  pos = jnp.arange(width, dtype=jnp.int32)[None, :]
  s = syn.selection_scores(spec, group, pos, L)
  s = jnp.where(pos <= L[:, None], s, -jnp.inf)
  return [set(row.tolist()) for row in np.asarray(jax.lax.top_k(s, k)[1])]


# ----------------------------------------------------------------------------------
# the scores
# ----------------------------------------------------------------------------------


def test_window_is_always_on_top_and_draws_are_units():
  L = jnp.asarray([100, 5000], jnp.int32)
  pos = jnp.arange(6000, dtype=jnp.int32)[None, :]
  s = np.asarray(syn.selection_scores(SPEC, 3, pos, L))
  for b, length in enumerate([100, 5000]):
    recent = (np.arange(6000) > length - SPEC.window) & (np.arange(6000) <= length)
    assert np.all(s[b, recent] == 2.0)
    older = np.arange(6000) <= length - SPEC.window
    assert np.all((s[b, older] >= 0.0) & (s[b, older] < 1.0))
    assert len(np.unique(s[b, older])) > 0.95 * older.sum()  # draws, not a constant


def test_scores_depend_on_group_seed_and_length_only():
  pos = jnp.arange(4096, dtype=jnp.int32)[None, :]
  one = lambda spec, g, L: np.asarray(syn.selection_scores(spec, g, pos, jnp.asarray([L])))
  a = one(SPEC, 0, 3000)
  np.testing.assert_array_equal(a, one(SPEC, 0, 3000))  # deterministic
  assert not np.array_equal(a, one(SPEC, 1, 3000))  # another group
  assert not np.array_equal(a, one(syn.SyntheticSelection(seed=1), 0, 3000))
  # A row's scores do not depend on the other rows of the batch.
  both = np.asarray(syn.selection_scores(SPEC, 0, pos, jnp.asarray([3000, 17])))
  np.testing.assert_array_equal(both[0], a[0])
  # Columns given as [B, T] positions (ula TP's compacted columns) score alike.
  perm = np.random.default_rng(0).permutation(4096).astype(np.int32)[None, :]
  got = np.asarray(syn.selection_scores(SPEC, 0, jnp.asarray(perm), jnp.asarray([3000])))
  np.testing.assert_array_equal(got[0], a[0, perm[0]])


def test_override_keeps_the_synthetic_ranking_whatever_the_indexer_scores():
  rng = np.random.default_rng(1)
  T, k = 8192, 512
  L = jnp.asarray([T - 1, 5000], jnp.int32)
  pos = jnp.arange(T, dtype=jnp.int32)[None, :]
  synth = syn.selection_scores(SPEC, 2, pos, L)
  model = jnp.asarray(rng.normal(0, 1e3, (2, T)), jnp.float32)
  model = model.at[1, 5001:].set(-jnp.inf)  # unscored positions stay out
  got = syn.override(SPEC, model, 2, pos, L)
  assert np.all(np.isneginf(np.asarray(got[1, 5001:])))
  np.testing.assert_array_equal(np.asarray(jax.lax.top_k(got[0], k)[1]),
                                np.asarray(jax.lax.top_k(synth[0], k)[1]))
  assert syn.override(None, model, 2, pos, L) is model


def test_bad_spec_names_the_field():
  for kw, field in [({"period": 0}, "selection_period"), ({"salience": 1.5},
                    "selection_salience"), ({"window": 0}, "selection_window")]:
    with pytest.raises(ValueError, match=field):
      syn.SyntheticSelection(**kw)


def _lru_miss_rate(steps: list[set[int]], capacity: int) -> float:
  """Exact LRU over a per-request buffer: a step's hits are touched, then its misses
  enter (evicting the least recently used); the first step (cold) is not counted."""
  buf: collections.OrderedDict = collections.OrderedDict()
  miss = total = 0
  for i, sel in enumerate(steps):
    new = [p for p in sel if p not in buf]
    for p in sel:
      if p in buf:
        buf.move_to_end(p)
    for p in new:
      buf[p] = None
      if len(buf) > capacity:
        buf.popitem(last=False)
    if i:
      miss, total = miss + len(new), total + len(sel)
  return miss / total


def test_glm5_geometry_locality_like_the_trained_models():
  """Top-k 2048 over a 64K-token history, the defaults: consecutive steps share about
  87% of the selection (the trained small model: 0.874), and a per-request LRU buffer of
  2k misses far less than one of k (HiSparse's sizing result)."""
  k, L0, n = 2048, 65536, 32
  steps = _selections(SPEC, 0, [L0 + t for t in range(n)], k)
  overlap = np.mean([len(steps[t] & steps[t - 1]) / k for t in range(1, n)])
  assert 0.85 <= overlap <= 0.90, overlap
  assert all(L0 + t in steps[t] for t in range(n))  # the new token's own position
  miss_k, miss_2k = _lru_miss_rate(steps, k), _lru_miss_rate(steps, 2 * k)
  assert 0.10 <= miss_k <= 0.15 and miss_2k < 0.5 * miss_k, (miss_k, miss_2k)
  # Without salience and with a long period: a slowly drifting, fresh selection.
  drift = syn.SyntheticSelection(period=16, salience=0.0)
  steps = _selections(drift, 0, [L0 + t for t in range(n)], k)
  assert np.mean([len(steps[t] & steps[t - 1]) / k for t in range(1, n)]) > 0.9


# ----------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------

# The tiny model selects 8 entries per group: a window of 2 leaves 6 drawn.
SELECT = ["workload.selections=synthetic", "workload.selection_window=2",
          "workload.prefill=synthetic", "kernels.resolve_fast_path=false"] + DENSE
ENGINE_SYSTEMS = {
    **{n: ["mesh.dp=2", f"engine.max_batch={ROWS}"] + TIGHT_SYSTEMS[n]
       for n in ("resident", "ula")},
    # ula's TP mode scores each rank's share of the keys and merges the top-k.
    "ula_tp": ["mesh.dp=1", "mesh.tp=2", f"engine.max_batch={ROWS}", "memory.system=ula",
               "memory.device_pool=48", "memory.host_pool=256"],
}


@functools.lru_cache(maxsize=None)
def _requests():
  return make_requests(num=4, seed=7, prompt=(20, 60), output=(4, 8))


@functools.lru_cache(maxsize=None)
def _run(name: str, selections: str = "synthetic"):
  over = SELECT if selections == "synthetic" else SELECT[2:]
  return run_engine(over + ENGINE_SYSTEMS[name], _requests())


# hisparse and far_tier select through the same ``MemorySystem.select`` as ula; ula TP
# scores its own share of the keys and merges.
@pytest.mark.parametrize("name", ["ula", "ula_tp"])
def test_every_system_decodes_residents_tokens(name):
  ref, got = _run("resident"), _run(name)
  assert [r.status for r in got.requests] == ["finished"] * len(_requests())
  tokens = lambda res: {r.id: list(r.output_tokens) for r in res.requests}
  assert tokens(got) == tokens(ref)
  assert got.summary.get("total_misses", 0) > 0


def test_summary_records_the_selections():
  s = _run("resident").summary
  assert s["selections"] == {"kind": "synthetic", "period": 4, "salience": 0.9,
                             "window": 2, "seed": 0}
  assert "not a trained model's" in s["selections_note"]
  assert _run("ula", "model").summary["selections"] == {"kind": "model"}


def test_selections_change_what_ula_hits():
  """The same requests with the indexer's ranking and with the synthetic one: different
  selections, so different hit counts (the tokens may differ too)."""
  a, b = _run("ula").summary, _run("ula", "model").summary
  assert (a["total_hits"], a["total_misses"]) != (b["total_hits"], b["total_misses"])


def test_bad_values_name_the_field():
  with pytest.raises(ConfigError, match="workload.selection_window=8 must be below"):
    load_config(BASE, ["model.preset=tiny", "workload.selections=synthetic",
                       "workload.selection_window=8"])
  with pytest.raises(ConfigError, match="workload.selections='synthetic' ranks a live"):
    load_config(BASE, ["model.preset=tiny", "workload.selections=synthetic",
                       "workload.selection_window=2", "workload.kind=trace",
                       "workload.trace=x.npz"])
  with pytest.raises(ConfigError, match="selection_period"):
    load_config(BASE, ["workload.selections=synthetic", "workload.selection_period=0"])
  with pytest.raises(ConfigError, match="selections"):
    load_config(BASE, ["workload.selections=learned"])


def test_the_indexers_products_stay_in_the_compiled_step():
  """The indexer's scores are added at 2**-60, so the step still computes them: the
  compiled decode step has as many matrix products as with the indexer's ranking."""
  import re

  from ula_jax.engine import Engine
  from ula_jax.mesh import build_mesh

  def dots(selections: str) -> int:
    cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false", "mesh.dp=1",
                             f"engine.max_batch={ROWS}", f"workload.selections={selections}",
                             "workload.selection_window=2"] + DENSE)
    return len(re.findall(r"= \S+ dot\(", Engine(cfg, build_mesh(cfg)).decode_hlo()))

  model = dots("model")
  assert model > 0 and dots("synthetic") == model
