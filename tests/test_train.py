"""ula-jax train: the data split, the training forward against the served model, both
stages, checkpoints and resume, serving a trained model, and config errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ula_jax.cli.main import main
from ula_jax.config import ConfigError
from ula_jax.models import checkpoint
from ula_jax.models import transformer as tfm
from ula_jax.models.config import ModelConfig
from ula_jax.train import cost
from ula_jax.train.config import DataConfig, load_train_config
from ula_jax.train.data import (BOS, ByteTokenizer, eval_windows, is_heldout, list_files,
                                load_corpus, train_batch, unigram_log_probs, unigram_loss)
from ula_jax.kernels.indexer import index_scores, select_topk
from ula_jax.train.forward import (ForwardOptions, IndexerInputs, _kl_rows, layer_attention,
                                   pack_bits, read_selections, selection_bits, sequence_terms,
                                   unpack_bits)
from ula_jax.train.loop import train

from tests.engine_util import run_engine

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "experiments/train_small/tiny.yaml"


def _params(path: Path, cfg: ModelConfig) -> list[np.ndarray]:
  return [np.asarray(x) for x in
          jax.tree.leaves(nnx.state(checkpoint.restore_params(cfg, path)))]


def _metrics(run_dir: Path) -> list[dict]:
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """The tiny config trained straight through (3 dense + 3 sparse steps)."""
  cfg = load_train_config(TINY)
  result = train(cfg, tmp_path_factory.mktemp("train") / "run", progress=False)
  return cfg, result


# ----------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------


def test_data_split_is_deterministic_and_the_held_out_files_are_disjoint():
  cfg = DataConfig(heldout_fraction=0.1, max_bytes=200_000)
  a, b = load_corpus(cfg), load_corpus(cfg)
  assert a.sha1 == b.sha1 and a.train_files == b.train_files
  np.testing.assert_array_equal(a.train, b.train)
  np.testing.assert_array_equal(a.heldout, b.heldout)
  assert a.heldout_files and a.train_files
  assert not set(a.train_files) & set(a.heldout_files)
  assert all(is_heldout(f, 0.1) for f in a.heldout_files)
  assert not any(is_heldout(f, 0.1) for f in a.train_files)
  # Over the whole library the held-out share is close to the fraction, by file count.
  files = list_files(a.root, (".py",))
  share = np.mean([is_heldout(f, 0.1) for f in files])
  assert 0.05 < share < 0.15, share
  assert not any("site-packages" in f for f in files)
  # Each file is a separator and its bytes.
  first = (a.root / a.train_files[0]).read_bytes()
  assert a.train[0] == BOS
  assert bytes(a.train[1:1 + len(first)].astype(np.uint8)) == first
  # Training windows depend only on (seed, step); held-out windows are fixed.
  np.testing.assert_array_equal(train_batch(a.train, 5, 3, 64, 0), train_batch(b.train, 5, 3, 64, 0))
  assert not np.array_equal(train_batch(a.train, 5, 3, 64, 0), train_batch(a.train, 6, 3, 64, 0))
  w = eval_windows(a.heldout, 4, 64)
  assert w.shape == (4, 65) and w.dtype == np.int32
  with pytest.raises(ValueError, match=r"fewer than one window of train.seq_len \+ 1"):
    eval_windows(a.heldout[:10], 4, 64)
  with pytest.raises(ValueError, match=r"data.root='/nonexistent': not a directory"):
    load_corpus(DataConfig(root="/nonexistent"))


def test_byte_tokenizer_and_unigram_baseline():
  tok = ByteTokenizer()
  ids = tok.encode("é = 1\n")
  assert ids[0] == BOS and tok.decode(ids) == "é = 1\n".encode()
  assert tok.vocab_size == 257
  # Hand-checked: tokens 0, 0, 1 (+1 smoothing over 3 ids) -> p = 3/6, 2/6, 1/6.
  log_p = unigram_log_probs(np.array([0, 0, 1], np.uint16), 3)
  np.testing.assert_allclose(np.exp(log_p), [0.5, 1 / 3, 1 / 6])
  windows = np.array([[2, 0, 1]])  # targets 0 and 1
  assert unigram_loss(log_p, windows) == pytest.approx(-(np.log(0.5) + np.log(1 / 3)) / 2)


def test_start_token_replaces_each_windows_first_token_only():
  from ula_jax.train.data import heldout_requests, start_windows, train_batch
  tokens = np.arange(1000, dtype=np.uint16) % 200
  plain = train_batch(tokens, 3, 4, 63, 0)
  started = start_windows(plain)
  assert np.all(started[:, 0] == BOS)
  np.testing.assert_array_equal(started[:, 1:], plain[:, 1:])  # the targets are unchanged
  assert not np.all(plain[:, 0] == BOS)  # (the input was not changed in place)
  recs = heldout_requests(tokens, [10, 30], 5, start_token=True)
  plain_recs = heldout_requests(tokens, [10, 30], 5)
  for r, p in zip(recs, plain_recs):
    assert r["prompt"][0] == BOS and r["prompt"][1:] == p["prompt"][1:]
    assert len(r["prompt"]) == len(p["prompt"])


# ----------------------------------------------------------------------------------
# the training forward
# ----------------------------------------------------------------------------------


def test_kl_rows_hand_checked():
  p = jnp.array([[0.5, 0.5, 0.0]])
  mask = jnp.array([[True, True, False]])
  log_q = jnp.log(jnp.array([[0.25, 0.75, 1.0]]))
  want = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
  np.testing.assert_allclose(_kl_rows(p, log_q, mask), [want], rtol=1e-6)
  assert float(_kl_rows(p, jnp.log(p + (p == 0)), mask)[0]) == 0.0


def test_bit_rows_round_trip(rng):
  for T in (1, 31, 32, 70):
    mask = rng.random((5, T)) < 0.4
    words = pack_bits(jnp.asarray(mask))
    assert words.shape == (5, -(-T // 32)) and words.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(unpack_bits(words, T)), mask)


def _picked_sets_from_select_topk(q_I, w, keys, k):
  """Each query's top-k over the positions up to itself, by ``select_topk``."""
  T = keys.shape[0]
  cand = np.arange(T)[None, :] <= np.arange(T)[:, None]
  pos, valid = select_topk(index_scores(q_I, w, keys), jnp.asarray(cand), k)
  return [set(np.asarray(pos)[n][np.asarray(valid)[n]].tolist()) for n in range(T)]


@pytest.mark.parametrize("ties", [False, True])
def test_selection_bits_are_select_topks_picks(rng, ties):
  """The training's selection, as bit rows, is serving's ``select_topk`` set for every
  query, by radix select and by the sort alike (ties: many equal scores, the lower
  positions win)."""
  T, I, K, k = 48, 2, 8, 5  # 6 blocks of 8 in 2 key segments; T not a multiple of 32
  q_I = jnp.asarray(rng.standard_normal((T, I, K)), jnp.float32)
  keys = rng.standard_normal((T, K)).astype(np.float32)
  if ties:
    keys = np.round(keys)
  keys = jnp.asarray(keys)
  w = jnp.asarray(rng.random((T, I)), jnp.float32)
  want = _picked_sets_from_select_topk(q_I, w, keys, k)
  for radix in (True, False, None):
    bits = jax.jit(lambda q, w_, kk, r=radix: selection_bits(q, w_, kk, k, 8, radix=r))(
        q_I, w, keys)
    assert bits.shape == (T, 2)
    got = np.asarray(unpack_bits(bits, T))
    assert [set(np.flatnonzero(row).tolist()) for row in got] == want, radix


def test_training_step_with_the_gpus_radix_selection_equals_the_cpus(monkeypatch, seed):
  """The sparse stage's loss and gradients, batched and jitted, are the same whether the
  selection is the radix select (a GPU's default) or ``lax.top_k`` (a CPU's): the same
  picks (``test_selection_bits_are_select_topks_picks``), the two programs fused apart
  (float32 rounding)."""
  from ula_jax.train import forward
  cfg = ModelConfig(preset="tiny", vocab_size=257, num_layers=1, index_share=1,
                    num_dense_layers=1, index_topk=16, param_seed=seed % 1000)
  graphdef, params = nnx.split(tfm.Transformer(cfg))
  windows = jnp.asarray(np.random.default_rng(seed).integers(0, 257, (2, 97)), jnp.int32)

  def step():
    def loss(p):
      t = forward.batch_terms(nnx.merge(graphdef, p), windows, ForwardOptions(True, 32))
      return t["lm"].sum() + t["kl"].sum()
    return jax.jit(jax.value_and_grad(loss))(params)

  want = step()
  picks = forward._picks
  monkeypatch.setattr(forward, "_picks", lambda s, c, k, radix: picks(s, c, k, True))
  got = step()
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    a, b = np.asarray(a), np.asarray(b)
    # Relative to the leaf's largest entry: another pick would move it by its own size.
    assert np.max(np.abs(a - b), initial=0.0) <= 1e-4 * np.max(np.abs(a), initial=0.0) + 1e-7


def test_layer_attention_terms_against_a_hand_computation(rng):
  """One layer's sparse attention, KL and captured mass, against numpy on the picked
  positions: attention softmax over the picks, the heads' mean p, the indexer's softmax q
  over the picks, KL(p || q) summed over queries; the dense attention's mass on the picks."""
  cfg = ModelConfig(preset="tiny", vocab_size=257, num_layers=1, index_share=1,
                    num_dense_layers=1, index_topk=5)
  layer = tfm.DecoderLayer(cfg, True, rngs=nnx.Rngs(0))
  T, k, I, K = 48, 5, 2, 8
  attn = layer.attn
  H, dn = attn.w_uk[...].shape[0], attn.w_uk[...].shape[2]
  C, dr = attn.kv_lora_rank, cfg.qk_rope_head_dim
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  proj = tfm.Projection(f(T, cfg.hidden_size), f(T, 4), f(T, H, dn), f(T, H, dr), f(T, C + dr))
  q_I, w, keys = f(T, I, K), jnp.asarray(rng.random((T, I)), jnp.float32), f(T, K)
  bits = selection_bits(q_I, w, keys, k, 8)
  ix = IndexerInputs(q_I, w, keys, bits, k)
  scale = cfg.softmax_scale
  picks = _picked_sets_from_select_topk(q_I, w, keys, k)

  # numpy, float64
  e = np.asarray(proj.entry, np.float64)
  kk = np.einsum("tc,hcd->thd", e[:, :C], np.asarray(attn.w_uk[...], np.float64))
  s = (np.einsum("qhd,thd->hqt", np.asarray(proj.q_nope, np.float64), kk)
       + np.einsum("qhr,tr->hqt", np.asarray(proj.q_rope, np.float64), e[:, C:])) * scale
  iscore = np.asarray(index_scores(q_I, w, keys), np.float64)

  def softmax_over(x, cols):
    z = np.exp(x[..., cols] - x[..., cols].max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)

  kl = mass = spill = 0.0
  for n in range(T):
    sel = sorted(picks[n])
    p = softmax_over(s[:, n], sel).mean(0)  # the heads' mean over the picks
    q = softmax_over(iscore[n], sel)
    kl += float(np.sum(p * np.log(p / q)))
    p_heads = softmax_over(s[:, n], list(range(n + 1)))  # [H, n + 1] dense, per head
    mass += float(p_heads.mean(0)[sel].sum())
    spill += float(np.mean(-np.log(p_heads[:, sel].sum(-1))))  # 0 while n < k
  assert spill > 0

  sparse = layer_attention(layer, proj, ix, scale, ForwardOptions(True, 8, spill=True))[1]
  np.testing.assert_allclose(float(sparse["kl"]), kl, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(float(sparse["spill"]), spill, rtol=1e-4)
  dense = layer_attention(layer, proj, ix, scale, ForwardOptions(False, 8, kl=False,
                                                                 measure=True))[1]
  np.testing.assert_allclose(float(dense["mass"]), mass, rtol=1e-5)


def test_sparse_training_forward_is_the_served_function(seed):
  """Stage 2 trains what serving computes: the sparse training forward's loss at every
  position equals the loss of the logits the served prefill gives there (float32),
  with query blocks smaller than the sequence. With k >= T the top-k captures all of
  the dense attention."""
  cfg = ModelConfig(preset="tiny", vocab_size=257, num_layers=2, index_topk=4,
                    param_seed=seed % 1000)
  model = tfm.Transformer(cfg)
  T = 32  # 4 blocks of 8 in 4 key segments
  tokens = np.random.default_rng(seed).integers(0, 257, T + 1).astype(np.int32)
  got = jax.jit(lambda x, y: sequence_terms(model, x, y, ForwardOptions(True, 8)))(
      tokens[:-1], tokens[1:])
  graphdef, params = nnx.split(model)
  ws = tfm.init_workspace(cfg, T)
  losses = []
  for t in range(T):
    _, _, logits, ws = tfm.prefill_chunk_jit(graphdef, params, ws, jnp.asarray(tokens[t:t + 1]),
                                             jnp.int32(t), jnp.int32(1))
    losses.append(float(jax.nn.logsumexp(logits) - logits[tokens[t + 1]]))
  np.testing.assert_allclose(float(got["lm"]), sum(losses), rtol=2e-5)
  assert np.all(np.asarray(got["kl"]) >= -1e-5)

  model = tfm.Transformer(cfg.model_copy(update={"index_topk": T}))
  dense = jax.jit(lambda x, y: sequence_terms(model, x, y, ForwardOptions(False, 8, measure=True)))(
      tokens[:-1], tokens[1:])
  np.testing.assert_allclose(np.asarray(dense["mass"]) / T, 1.0, rtol=1e-5)


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_learns_only_from_the_kl_and_the_model_only_from_the_lm_loss(sparse, seed):
  cfg = ModelConfig(preset="tiny", vocab_size=257, num_layers=1, index_share=1,
                    num_dense_layers=1, index_topk=4, param_seed=seed % 1000)
  graphdef, params = nnx.split(tfm.Transformer(cfg))
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 257, 17), jnp.int32)
  opts = ForwardOptions(sparse, 16, spill=sparse)
  names = ("lm", "kl", "mtp") + (("spill",) if sparse else ())

  def term(name):
    return lambda p: sequence_terms(nnx.merge(graphdef, p), tokens[:-1], tokens[1:],
                                    opts)[name].sum()

  g_lm, g_kl, g_mtp, *g_spill = jax.jit(lambda p: tuple(jax.grad(term(t))(p)
                                                       for t in names))(params)
  spills = jax.tree.leaves(g_spill[0]) if sparse else [None] * len(jax.tree.leaves(g_lm))
  for (path, lm), kl, mtp, spill in zip(jax.tree_util.tree_leaves_with_path(g_lm),
                                        jax.tree.leaves(g_kl), jax.tree.leaves(g_mtp),
                                        spills):
    name = jax.tree_util.keystr(path)
    if "indexer" in name:
      assert not np.any(np.asarray(lm)), name
      assert np.any(np.asarray(kl)), name
      assert not np.any(np.asarray(mtp)), name
      assert spill is None or not np.any(np.asarray(spill)), name  # the main model's term
    else:
      assert not np.any(np.asarray(kl)), name
    if spill is not None and re.search(r"w_uk|w_kr|w_uq", name):  # the attention's scores
      assert np.any(np.asarray(spill)), name
    if "mtp" in name:  # the MTP block learns from its own loss only
      assert not np.any(np.asarray(lm)), name
      assert np.any(np.asarray(mtp)), name


def test_read_selections_are_each_positions_top_k_and_import_as_a_trace(tmp_path, seed):
  """Teacher-forced selections: each position's picks are min(k, p + 1) distinct earlier
  positions (all of them while p < k), and the rows import as SGLang arrays into a trace
  whose locality statistics count every decode step."""
  from ula_jax.memory.traces.format import load_traces
  from ula_jax.memory.traces.sglang import import_sglang
  from ula_jax.memory.traces.stats import locality_stats

  cfg = ModelConfig(preset="tiny", vocab_size=257, num_layers=2, index_share=1,
                    num_dense_layers=2, index_topk=6, param_seed=seed % 1000)
  model = tfm.Transformer(cfg)
  T, first, k = 32, 0, cfg.index_topk
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 257, T), jnp.int32)
  sel = np.asarray(jax.jit(lambda t: read_selections(model, t, first, 8))(tokens))
  assert sel.shape == (T - first, cfg.num_groups, k)
  for j in range(T - first):
    p = first + j
    for g in range(cfg.num_groups):
      got = sel[j, g][sel[j, g] >= 0]
      assert len(got) == min(k, p + 1) == len(set(got.tolist())) and got.max() <= p
      if p < k:
        assert set(got.tolist()) == set(range(p + 1))
  assert np.array_equal(sel[8:], np.asarray(read_selections(model, tokens, 8, 8)))

  prompt = 16
  np.save(tmp_path / "r0.npy", sel[prompt:])
  (tmp_path / "manifest.json").write_text(json.dumps({"requests": [
      {"id": "r0", "file": "r0.npy", "prompt_len": prompt, "first_position": prompt}]}))
  out = import_sglang(tmp_path, tmp_path / "trace.npz", cfg.kv_geometry(), page_size=8,
                      prefill_chunk=16)
  stats = locality_stats(load_traces(out))
  assert stats["trace"]["steps"] == T - prompt
  assert 0 <= stats["overlap"]["mean"] <= 1


def test_concentration_term_enters_the_sparse_steps_loss(tmp_path):
  """``train.concentration_weight``: sparse steps log the spill and add it to the loss
  with its weight; dense steps have none."""
  cfg = load_train_config(TINY, ["train.concentration_weight=2.5", "train.dense_steps=1",
                                 "train.sparse_steps=2", "experiment.plots=false"])
  train(cfg, tmp_path / "run", progress=False)
  steps = _metrics(tmp_path / "run")
  assert [("spill" in r) for r in steps] == [False, True, True]
  t = cfg.train
  for r in steps[1:]:
    assert r["spill"] > 0
    want = r["lm"] + t.kl_weight * r["kl"] + t.mtp_weight * r["mtp"] + 2.5 * r["spill"]
    assert r["loss"] == pytest.approx(want, rel=1e-5)


def test_cost_counts_every_parameter():
  for m in (ModelConfig(preset="tiny"), ModelConfig(preset="small", vocab_size=257)):
    model = nnx.eval_shape(lambda m=m: tfm.Transformer(m))
    assert cost.all_params(m) == sum(x.size for x in jax.tree.leaves(nnx.state(model)))


# ----------------------------------------------------------------------------------
# training, checkpoints, resume
# ----------------------------------------------------------------------------------


def test_tiny_training_runs_both_stages_and_learns(trained):
  cfg, result = trained
  run = result.run_dir
  assert result.status == "finished"
  rows = _metrics(run)
  assert [r["stage"] for r in rows] == ["dense"] * 3 + ["sparse"] * 3
  assert [r["step"] for r in rows] == list(range(1, 7))
  assert rows[-1]["lm"] < rows[0]["lm"] - 0.5, [r["lm"] for r in rows]
  assert all(np.isfinite(r["kl"]) and r["kl"] >= 0 for r in rows)
  assert rows[-1]["mtp"] < rows[0]["mtp"], [r["mtp"] for r in rows]  # the draft block learns
  evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
  assert all(e["mtp_loss_sparse"] > 0 and e["mtp_loss_dense"] > 0 for e in evals)
  assert [e["step"] for e in evals] == [3, 6]  # the end of each stage
  s = json.loads((run / "summary.json").read_text())
  ev = s["eval"]
  assert s["status"] == "finished" and s["step"] == 6
  assert ev["loss"] == ev["loss_sparse"] and ev["bits_per_byte"] == pytest.approx(
      ev["loss"] / np.log(2))
  assert 0 < ev["captured_mass_beyond_k"] <= ev["captured_mass"] <= 1
  assert len(ev["captured_mass_per_layer"]) == cfg.model.num_layers
  assert s["unigram"]["loss"] > 0 and s["corpus"]["heldout_files"] > 0
  assert (run / "curves.png").stat().st_size > 0
  assert (run / "model" / checkpoint.CONFIG_FILE).is_file()
  assert (run / "config.yaml").is_file()
  assert load_train_config(run / "config.yaml") == cfg


def test_interrupted_training_resumes_to_the_same_parameters(trained, tmp_path):
  cfg, whole = trained
  run = tmp_path / "run"
  part = train(cfg, run, progress=False, stop_at=4)
  assert part.status == "stopped" and part.summary["step"] == 4
  # A stopped run leaves the model at its last step (a resumed run replaces it).
  assert (run / "model").exists() and not (run / "requests.jsonl").exists()
  with pytest.raises(ConfigError, match=r"--resume .*the config differs from the run's "
                                        r"\(config.yaml\): train.lr: run has 0.003, given 0.01"):
    train(load_train_config(TINY, ["train.lr=0.01"]), resume=run, progress=False)
  done = train(cfg, resume=run, progress=False)
  assert done.status == "finished"
  for a, b in zip(_params(whole.run_dir / "model", cfg.model), _params(run / "model", cfg.model)):
    np.testing.assert_array_equal(a, b)
  strip = lambda rows: [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k}
                        for r in rows]
  assert strip(_metrics(run)) == strip(_metrics(whole.run_dir))


def test_cli_train_and_its_refusals(trained, tmp_path, capsys):
  _, result = trained
  assert main(["train", str(TINY), "--no-progress", "--out", str(tmp_path / "run")]) == 0
  out = capsys.readouterr().out
  assert re.search(r"held-out loss \d+\.\d+ nats/token \(\d+\.\d+ bits/byte; unigram baseline "
                   r"\d+\.\d+ nats/token", out), out
  assert f"training run directory: {tmp_path / 'run'} (status finished)" in out
  assert main(["train", str(TINY), "--out", "x", "--resume", "y"]) == 2
  assert "not both" in capsys.readouterr().err
  assert main(["train", str(TINY), "--no-progress", "--out", str(result.run_dir)]) == 2
  assert "exists and is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("train.seq_lne=64", r"unknown field 'train.seq_lne' \(did you mean 'seq_len'\?\)"),
    ("train.batch_size=0", r"train.batch_size=0: must be >= 1"),
    ("train.attention_block=48", r"train.seq_len=64 is not a multiple of "
                                 r"train.attention_block=48"),
    ("model.vocab_size=256", r"model.vocab_size=256: the byte-level tokenizer needs >= 257"),
    ("model.checkpoint=somewhere", r"model.checkpoint='somewhere': training starts from "
                                   r"model.param_seed"),
    ("data.heldout_fraction=1.5", r"data.heldout_fraction=1.5: must be < 1"),
    ("train.dense_steps=true", r"train.dense_steps=True: expected an integer, not a boolean"),
    ("train.seq_len=512", r"train.seq_len=512 is beyond model.max_position=256"),
    ("train.concentration_weight=-1", r"train.concentration_weight=-1: must be >= 0"),
])
def test_bad_config_fields_are_named(override, message):
  with pytest.raises(ConfigError, match=message):
    load_train_config(TINY, [override])


@pytest.mark.parametrize("name, layers", [("train", 4), ("train_start", 4), ("train_deep", 8),
                                          ("train_mtp", 4), ("train_v32", 4)])
def test_the_shipped_training_configs_validate(name, layers):
  """Every training run of experiments/train_small loads: the real MLA entry and top-k,
  16K windows except the MTP block's, one indexer per layer."""
  cfg = load_train_config(TINY.parent / f"{name}.yaml")
  m = cfg.model
  assert (m.num_layers, m.num_dense_layers, m.index_share) == (layers, layers, 1)
  assert (m.kv_lora_rank + m.qk_rope_head_dim, m.index_topk) == (576, 2048)
  assert cfg.train.seq_len == (1024 if name == "train_mtp" else 16384)


# ----------------------------------------------------------------------------------
# model.checkpoint: serving the trained model
# ----------------------------------------------------------------------------------


def test_model_checkpoint_makes_a_run_use_the_trained_parameters(trained):
  cfg, result = trained
  model_dir = result.run_dir / "model"
  m = cfg.model
  geometry = [f"model.{k}={'null' if v is None else v}" for k, v in m.model_dump().items()
              if k not in ("preset", "checkpoint", "param_seed")]
  prompt = ByteTokenizer().encode("def f(x):\n    return x")
  from ula_jax.engine import Request
  reqs = [Request(id="r0", prompt=prompt, max_new_tokens=8)]
  common = ["mesh.dp=1", "engine.max_batch=1", "engine.max_context=64", "workload.num_requests=1",
            "workload.length_scale=1.0", "workload.prompt_len=[8,16]",
            "workload.output_len=[4,8]", *geometry]
  served = run_engine([*common, f"model.checkpoint={model_dir}"], reqs)
  tokens = served.requests[0].output_tokens
  trained_model = checkpoint.restore_params(m, model_dir)
  np.testing.assert_array_equal(tokens, tfm.generate_reference(trained_model, prompt, 8))
  untrained = tfm.Transformer(m)
  # Committed to a device as restored arrays are, so both share the compiled programs.
  nnx.update(untrained, jax.device_put(nnx.state(untrained), jax.devices()[0]))
  assert not np.array_equal(tokens, tfm.generate_reference(untrained, prompt, 8))
  with pytest.raises(ValueError, match=r"model.checkpoint=.*has another geometry: "
                                       r"model.hidden_size: saved 64, given 32"):
    run_engine([*common, "model.hidden_size=32", f"model.checkpoint={model_dir}"], reqs)
