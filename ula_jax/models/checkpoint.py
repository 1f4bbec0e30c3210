"""Saving and restoring model parameters with orbax.

A checkpoint is a directory::

    path/model_config.json   the ModelConfig it was saved with
    path/params/             the parameter state (orbax StandardCheckpointer)

Restoring checks that the given config has the same geometry (every field except
``preset``, ``param_seed`` and ``checkpoint``, which only say where the values came from,
and ``kv_layout``, which says how the KV cache is stored).
``load_model`` builds the model a config names: restored from ``cfg.checkpoint``, or
drawn from ``cfg.param_seed``.

A checkpoint saved without the MTP block (``Transformer.mtp``, the speculative drafts'
block; checkpoints written before it existed) still loads: the block is drawn from
``param_seed`` (logged; a speculative run warns and its summary says so), and
``mtp_saved`` tells which it was.
"""

from __future__ import annotations

import json
import logging
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ula_jax.models.config import ModelConfig
from ula_jax.models.transformer import Transformer

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
_PROVENANCE = ("preset", "param_seed", "checkpoint")
# How KV entries are stored shapes no parameter: saved with one model.kv_layout, the
# parameters decode with either.
_STORAGE = ("kv_layout",)
# The module a checkpoint may lack (it is drawn from param_seed then).
_OPTIONAL = "mtp"


def save_params(model: Transformer, path: str | pathlib.Path, *,
                overwrite: bool = False) -> pathlib.Path:
  """Writes ``model``'s parameters and config under ``path`` (a directory); returns it."""
  path = pathlib.Path(path).absolute()
  if path.exists():
    if not overwrite:
      raise FileExistsError(f"checkpoint path={str(path)!r} exists; pass overwrite=True "
                            "to replace it")
  path.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path / PARAMS_DIR, nnx.state(model), force=overwrite)
    ckpt.wait_until_finished()
  (path / CONFIG_FILE).write_text(model.cfg.model_dump_json(indent=2))
  return path


def restore_params(cfg: ModelConfig, path: str | pathlib.Path) -> Transformer:
  """A ``Transformer`` for ``cfg`` with the parameters saved under ``path``."""
  path = pathlib.Path(path).absolute()
  if not (path / CONFIG_FILE).is_file() or not (path / PARAMS_DIR).is_dir():
    raise FileNotFoundError(f"checkpoint path={str(path)!r}: expected {CONFIG_FILE} and "
                            f"{PARAMS_DIR}/ written by save_params")
  saved = json.loads((path / CONFIG_FILE).read_text())
  given = cfg.model_dump()
  diff = [f"model.{k}: saved {saved.get(k)!r}, given {given[k]!r}"
          for k in given if k not in _PROVENANCE + _STORAGE and saved.get(k) != given[k]]
  if diff:
    raise ValueError(f"checkpoint path={str(path)!r} has another geometry: "
                     + "; ".join(diff))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if not mtp_saved(path):
    logging.getLogger(__name__).info(
        "checkpoint path=%r has no MTP block (model.mtp); it is drawn from "
        "model.param_seed=%d", str(path), cfg.param_seed)
    model = Transformer(cfg)
    saved_part = nnx.state(model, nnx.Not(nnx.PathContains(_OPTIONAL)))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), saved_part)
    with ocp.StandardCheckpointer() as ckpt:
      nnx.update(model, ckpt.restore(path / PARAMS_DIR, abstract))
    return model
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg)))
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
  with ocp.StandardCheckpointer() as ckpt:
    state = ckpt.restore(path / PARAMS_DIR, abstract)
  return nnx.merge(graphdef, state)


def mtp_saved(path: str | pathlib.Path) -> bool:
  """Whether the checkpoint under ``path`` holds the MTP block's parameters (read from
  its metadata; nothing is restored)."""
  with ocp.StandardCheckpointer() as ckpt:
    tree = ckpt.metadata(pathlib.Path(path).absolute() / PARAMS_DIR).item_metadata
  return _OPTIONAL in tree


def load_model(cfg: ModelConfig) -> Transformer:
  """The model ``cfg`` names: restored from ``cfg.checkpoint`` when set, else drawn from
  ``cfg.param_seed``. A checkpoint that is missing or has another geometry is a
  ValueError naming ``model.checkpoint``."""
  if cfg.checkpoint is None:
    return Transformer(cfg, rngs=nnx.Rngs(cfg.param_seed))
  try:
    return restore_params(cfg, cfg.checkpoint)
  except (FileNotFoundError, ValueError) as e:
    raise ValueError(f"model.checkpoint={cfg.checkpoint!r}: {e}") from None
