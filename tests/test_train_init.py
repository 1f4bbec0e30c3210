"""ula-jax train from a trained model (train.init_from) and training only the MTP block
(train.trainable: mtp): what is loaded, what stays frozen, and the config errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from ula_jax.cli.main import main
from ula_jax.config import ConfigError
from ula_jax.models import checkpoint
from ula_jax.models import transformer as tfm
from ula_jax.models.mtp import mtp_count
from ula_jax.train.config import load_train_config
from ula_jax.train.data import eval_windows, load_corpus
from ula_jax.train.loop import cast, evaluate, init_model, make_optimizer, train

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "experiments/train_small/tiny.yaml"
MTP_CONFIG = REPO / "experiments/train_small/train_mtp.yaml"
# A short sparse-only run of the MTP block alone.
MTP_RUN = ["train.trainable=mtp", "train.dense_steps=0", "train.sparse_steps=4",
           "train.warmup_steps=0", "train.checkpoint_every=2", "experiment.plots=false"]


def _leaves(model: tfm.Transformer) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))}


def _is_mtp(name: str) -> bool:
  return name.startswith("['mtp']")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """The tiny config's model drawn from another seed and scaled, saved whole (``full``) and without
  its MTP block (``no_mtp``, as checkpoints written before the block existed)."""
  root = tmp_path_factory.mktemp("init")
  cfg = load_train_config(TINY)
  model = tfm.Transformer(cfg.model.model_copy(update={"param_seed": 5}))
  # Scaled, so that the norms differ from a drawn model's too (they start at one).
  nnx.update(model, jax.tree.map(lambda x: x * 1.25, nnx.state(model)))
  checkpoint.save_params(model, root / "full")
  no_mtp = root / "no_mtp"
  no_mtp.mkdir()
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(no_mtp / checkpoint.PARAMS_DIR,
              nnx.state(model, nnx.Not(nnx.PathContains("mtp"))))
    ckpt.wait_until_finished()
  (no_mtp / checkpoint.CONFIG_FILE).write_text(model.cfg.model_dump_json())
  assert checkpoint.mtp_saved(root / "full") and not checkpoint.mtp_saved(no_mtp)
  return cfg, model, root


def test_init_from_loads_the_saved_parameters(saved):
  cfg, model, root = saved
  want, drawn = _leaves(model), _leaves(tfm.Transformer(cfg.model))
  assert all(not np.array_equal(want[k], drawn[k]) for k in want)
  got = _leaves(init_model(load_train_config(TINY, [f"train.init_from={root / 'full'}"])))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  # Without a saved MTP block the block keeps its model.param_seed values.
  got = _leaves(init_model(load_train_config(TINY, [f"train.init_from={root / 'no_mtp'}"])))
  for k in want:
    np.testing.assert_array_equal(got[k], drawn[k] if _is_mtp(k) else want[k], err_msg=k)


def test_the_committed_models_mtp_config_starts_from_it():
  cfg = load_train_config(MTP_CONFIG)
  t = cfg.train
  assert (t.trainable, t.dense_steps, t.init_from) == ("mtp", 0,
                                                       "experiments/train_small/model")
  assert t.mtp_weight > 0 and t.sparse_steps > 0
  committed = REPO / t.init_from
  assert checkpoint.mtp_saved(committed)  # its block trained by this config
  got = _leaves(init_model(cfg.model_copy(
      update={"train": t.model_copy(update={"init_from": str(committed)})})))
  want = _leaves(checkpoint.restore_params(cfg.model, committed))
  drawn = _leaves(tfm.Transformer(cfg.model))
  for k in want:  # every parameter the committed model's, its MTP block included
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert any(_is_mtp(k) and not np.array_equal(got[k], drawn[k]) for k in want)


def test_trainable_mtp_changes_only_the_mtp_block(saved, tmp_path):
  """From a model saved without its MTP block: four sparse steps, stopped after two and
  resumed; the main model stays bit for bit the saved one, the block learns."""
  _, model, root = saved
  cfg = load_train_config(TINY, [f"train.init_from={root / 'no_mtp'}", *MTP_RUN])
  start = init_model(cfg)
  run = tmp_path / "run"
  part = train(cfg, run, progress=False, stop_at=2)
  assert part.status == "stopped"
  done = train(cfg, resume=run, progress=False)
  assert done.status == "finished"

  rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["stage"]) for r in rows] == [(i, "sparse") for i in range(1, 5)]
  assert all(r["grad_norm"] > 0 and r["indexer_grad_norm"] == 0 for r in rows)
  # The result is a model directory like any run's, with the trained block.
  out = run / "model"
  assert checkpoint.mtp_saved(out)
  served = checkpoint.load_model(cfg.model.model_copy(update={"checkpoint": str(out)}))
  got, want, first = _leaves(served), _leaves(model), _leaves(start)
  for k in want:
    if _is_mtp(k):  # every parameter of the block moved
      assert not np.array_equal(got[k], first[k]), k
    else:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  s = done.summary["model"]
  assert s["trainable"] == "mtp" and s["init_from"] == str(root / "no_mtp")
  assert s["trained_params"] == sum(mtp_count(cfg.model).values())
  # Held out: the language model's loss is the saved model's exactly, the block's lower.
  heldout = eval_windows(load_corpus(cfg.data).heldout, cfg.eval.sequences,
                         cfg.train.seq_len)
  graphdef, params = nnx.split(start)
  before = evaluate(graphdef, cast(params, "float32"), heldout, cfg)
  after = done.summary["eval"]
  assert after["loss_sparse"] == before["loss_sparse"]
  assert after["loss_dense"] == before["loss_dense"]
  assert after["mtp_loss_sparse"] < before["mtp_loss_sparse"] - 0.1, (before, after)
  # No optimizer state for the frozen parameters: AdamW's two moments of the block.
  tx, _ = make_optimizer(cfg.train)
  state = jax.eval_shape(tx.init, cast(nnx.state(start), "float32"))
  assert sum(x.size for x in jax.tree.leaves(state)) <= 2 * s["trained_params"] + 8


def test_cli_trains_the_mtp_block_of_a_saved_model(saved, tmp_path, capsys):
  _, _, root = saved
  args = ["train", str(TINY), f"train.init_from={root / 'no_mtp'}", *MTP_RUN, "--no-progress"]
  assert main([*args, "--out", str(tmp_path / "run")]) == 0
  out = capsys.readouterr().out
  assert re.search(r"MTP block: held-out loss \d+\.\d+ nats/token", out), out
  assert checkpoint.mtp_saved(tmp_path / "run" / "model")
  assert main([*args, "model.hidden_size=32", "--out", str(tmp_path / "bad")]) == 2
  assert re.search(r"train.init_from=.*model.hidden_size: saved 64, given 32",
                   capsys.readouterr().err)


def test_init_from_with_another_geometry_is_an_error_naming_it(saved, tmp_path):
  cfg, _, root = saved
  bad = load_train_config(TINY, [f"train.init_from={root / 'full'}", "model.hidden_size=32"])
  with pytest.raises(ValueError, match=r"train.init_from=.*has another geometry: "
                                       r"model.hidden_size: saved 64, given 32"):
    train(bad, tmp_path / "run", progress=False)
  assert not (tmp_path / "run").exists()
  # Parameters saved with other shapes than the config says.
  other = tmp_path / "other"
  checkpoint.save_params(tfm.Transformer(cfg.model.model_copy(update={"hidden_size": 32})),
                         other)
  (other / checkpoint.CONFIG_FILE).write_text(cfg.model.model_dump_json())
  with pytest.raises(ValueError, match=r"train.init_from=.*parameter embed has shape "
                                       r"\(257, 32\), the model's is \(257, 64\)"):
    init_model(load_train_config(TINY, [f"train.init_from={other}"]))
  with pytest.raises(ConfigError, match=r"train.init_from=.*expected model_config.json"):
    train(load_train_config(TINY, [f"train.init_from={tmp_path / 'none'}"]),
          tmp_path / "run", progress=False)


@pytest.mark.parametrize("overrides, message", [
    (["train.trainable=mtp", "train.mtp_weight=0"],
     r"train.trainable='mtp' trains only the MTP block, from its loss: it needs "
     r"train.mtp_weight > 0"),
    (["train.trainable=indexer"], r"train.trainable='indexer'"),
    (["model.checkpoint=somewhere"], r"model.checkpoint='somewhere': .*use train.init_from"),
    (["train.init_from=''"], r"train.init_from"),
])
def test_config_errors(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_train_config(TINY, overrides)
  t = load_train_config(TINY).train
  assert (t.init_from, t.trainable) == (None, "all")
