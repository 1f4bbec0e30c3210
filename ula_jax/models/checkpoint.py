"""Saving and restoring model parameters with orbax.

A checkpoint is a directory::

    path/model_config.json   the ModelConfig it was saved with
    path/params/             the parameter state (orbax StandardCheckpointer)

Restoring checks that the given config has the same geometry (every field except
``preset``, ``param_seed`` and ``checkpoint``, which only say where the values came from,
and ``kv_layout``, which says how the KV cache is stored) and that every parameter is
saved with the model's shape (``check_checkpoint``). ``load_model`` builds the model a
config names: restored from ``cfg.checkpoint``, or drawn from ``cfg.param_seed``;
``restore_into`` loads a checkpoint into an existing model (``ula-jax train``'s
``train.init_from``).

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


def _leaf_key(path: tuple) -> tuple[str, ...]:
  """A parameter's path as names (a state's ``[0]`` and ``.value`` and the metadata's
  ``['0']`` and ``['value']`` alike)."""
  names = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                for k in path)
  return names[:-1] if names and names[-1] == "value" else names


def check_checkpoint(cfg: ModelConfig, path: str | pathlib.Path) -> pathlib.Path:
  """Checks that the checkpoint under ``path`` fits ``cfg``: written by ``save_params``
  (else FileNotFoundError), the same geometry (else a ValueError listing the fields that
  differ) and every parameter of ``cfg``'s model saved with its shape (else a ValueError
  naming the first that is missing or has another shape; the MTP block may be missing).
  Reads the config file and the metadata only; returns the absolute path."""
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
  with ocp.StandardCheckpointer() as ckpt:
    meta = ckpt.metadata(path / PARAMS_DIR).item_metadata
  shapes = {_leaf_key(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_leaves_with_path(meta)}
  want = nnx.state(nnx.eval_shape(lambda: Transformer(cfg)))
  for p, x in jax.tree_util.tree_leaves_with_path(want):
    key = _leaf_key(p)
    name = ".".join(key)
    if key not in shapes:
      if key[0] == _OPTIONAL:
        continue
      raise ValueError(f"checkpoint path={str(path)!r} has no parameter {name} (shape "
                       f"{tuple(x.shape)})")
    if shapes[key] != tuple(x.shape):
      raise ValueError(f"checkpoint path={str(path)!r}: parameter {name} has shape "
                       f"{shapes[key]}, the model's is {tuple(x.shape)}")
  return path


def _restore(path: pathlib.Path, state: nnx.State) -> nnx.State:
  """The values saved under ``path`` for the parameters of ``state`` (arrays or shapes)."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(path / PARAMS_DIR, abstract)


def restore_into(model: Transformer, path: str | pathlib.Path) -> bool:
  """Replaces ``model``'s parameters by those saved under ``path`` (checked by
  ``check_checkpoint`` against ``model.cfg``); a checkpoint without the MTP block leaves
  ``model``'s own. Returns whether the MTP block was saved."""
  path = check_checkpoint(model.cfg, path)
  if mtp_saved(path):
    nnx.update(model, _restore(path, nnx.state(model)))
    return True
  logging.getLogger(__name__).info(
      "checkpoint path=%r has no MTP block (model.mtp); the model's own is kept",
      str(path))
  nnx.update(model, _restore(path, nnx.state(model, nnx.Not(nnx.PathContains(_OPTIONAL)))))
  return False


def restore_params(cfg: ModelConfig, path: str | pathlib.Path) -> Transformer:
  """A ``Transformer`` for ``cfg`` with the parameters saved under ``path`` (checked by
  ``check_checkpoint``); without a saved MTP block, the block is drawn from
  ``cfg.param_seed``."""
  path = check_checkpoint(cfg, path)
  if not mtp_saved(path):
    logging.getLogger(__name__).info(
        "checkpoint path=%r has no MTP block (model.mtp); it is drawn from "
        "model.param_seed=%d", str(path), cfg.param_seed)
    model = Transformer(cfg)
    nnx.update(model, _restore(path, nnx.state(model, nnx.Not(nnx.PathContains(_OPTIONAL)))))
    return model
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg)))
  return nnx.merge(graphdef, _restore(path, abstract))


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
