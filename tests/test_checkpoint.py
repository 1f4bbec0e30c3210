"""Orbax save/restore of model parameters."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from ula_jax.models import checkpoint
from ula_jax.models import transformer as tfm
from ula_jax.models.config import ModelConfig

CFG = ModelConfig(preset="tiny")


def _assert_same_params(a: tfm.Transformer, b: tfm.Transformer) -> None:
  sa, sb = nnx.state(a), nnx.state(b)
  assert jax.tree.structure(sa) == jax.tree.structure(sb)
  for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_gives_identical_params_and_tokens(tmp_path, rng):
  model = tfm.Transformer(CFG)
  # Restored arrays are committed to a device; committing the original too lets both
  # models share one compilation of the jitted steps.
  nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
  path = checkpoint.save_params(model, tmp_path / "ckpt")
  assert (path / checkpoint.CONFIG_FILE).is_file()
  restored = checkpoint.restore_params(CFG, path)
  _assert_same_params(model, restored)
  prompt = rng.integers(0, CFG.vocab_size, 9).astype(np.int32)
  tokens = tfm.generate_reference(model, prompt, 6, chunk=8, capacity=32)
  np.testing.assert_array_equal(
      tfm.generate_reference(restored, prompt, 6, chunk=8, capacity=32), tokens)


def test_overwrite_and_provenance_fields(tmp_path):
  path = tmp_path / "ckpt"
  checkpoint.save_params(tfm.Transformer(CFG), path)
  with pytest.raises(FileExistsError, match=r"checkpoint path=.*ckpt' exists; pass overwrite=True"):
    checkpoint.save_params(tfm.Transformer(CFG), path)
  bf16 = ModelConfig(preset="tiny", num_layers=2, index_share=1, dtype="bfloat16",
                     kv_dtype="bfloat16", param_seed=7)
  model = tfm.Transformer(bf16)
  checkpoint.save_params(model, path, overwrite=True)
  # param_seed and preset say where values came from, not the geometry: a config that
  # differs only there restores the saved values.
  restored = checkpoint.restore_params(bf16.model_copy(update={"param_seed": 0}), path)
  _assert_same_params(model, restored)


def test_restore_errors(tmp_path):
  path = checkpoint.save_params(tfm.Transformer(CFG), tmp_path / "ckpt")
  with pytest.raises(ValueError, match=r"has another geometry: model.hidden_size: saved 64, "
                                       r"given 32; model.v_head_dim: saved 16, given 8"):
    checkpoint.restore_params(ModelConfig(preset="tiny", hidden_size=32, v_head_dim=8), path)
  with pytest.raises(FileNotFoundError, match=r"expected model_config.json and params/ "
                                              r"written by save_params"):
    checkpoint.restore_params(CFG, tmp_path / "missing")
