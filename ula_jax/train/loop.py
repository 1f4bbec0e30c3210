"""Training end to end: data, the jitted steps, evaluation, checkpoints, the run directory.

The parameters are trained in float32 (optax AdamW keeps its moments in float32 too) and
cast to ``model.dtype`` for every forward, so a bfloat16 model computes in bfloat16 while
its updates are not lost to bfloat16 rounding. A run starts from ``model.param_seed``, or
from a trained model directory (``train.init_from``); ``train.trainable: mtp`` trains only
the MTP block on a frozen model. The run directory::

    config.yaml      the resolved training config (``--resume`` checks it)
    checkpoints/     orbax: float32 parameters and optimizer state, the last step kept
    metrics.jsonl    one line per step (stage, losses, learning rate, gradient norm, time)
    eval.jsonl       one line per held-out evaluation
    model/           the trained model in ``model.dtype`` (``checkpoint.save_params``) at
                     the last step run (also when stopped early: summary.json's status
                     and step say so): ``model.checkpoint: <run>/model`` serves it
    summary.json     status, corpus, cost, time, the last evaluation, unigram baseline
    curves.png       training and held-out loss, KL and captured attention over steps
    requests.jsonl   four requests of held-out text up to the trained length
                     (``workload.kind: file``) for serving the trained model
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import yaml
from flax import nnx
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from ula_jax.config.errors import ConfigError
from ula_jax.models.checkpoint import check_checkpoint, restore_into, save_params
from ula_jax.models.transformer import Transformer
from ula_jax.report.output import (RunDirError, RunInterrupted, StopRequest, check_out_dir,
                                   claim_dir, dumps, handle_signals, new_run_dir)
from ula_jax.train import cost
from ula_jax.train.config import TrainConfig, TrainSection, config_dict, validate_train
from ula_jax.train.data import (Corpus, eval_windows, heldout_requests, load_corpus,
                                start_windows, train_batch, unigram_log_probs, unigram_loss)
from ula_jax.train.forward import ForwardOptions, batch_terms, terms_summary

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
MODEL_DIR = "model"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"
REQUESTS_FILE = "requests.jsonl"

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------
# Optimizer and the jitted steps
# ----------------------------------------------------------------------------------


def _schedule(t: TrainSection, peak: float) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=t.warmup_steps,
      decay_steps=max(t.steps, t.warmup_steps + 1), end_value=peak * t.min_lr_ratio)


def _labels(params: Any, trainable: str = "all") -> Any:
  """Each parameter's optimizer: with ``trainable`` 'all', 'indexer' for the lightning
  indexers' parameters and 'model' for the rest; with 'mtp', 'model' for the MTP block's
  and 'frozen' for the rest."""

  def label(path, _) -> str:
    if trainable == "mtp":
      return "model" if getattr(path[0], "key", None) == "mtp" else "frozen"
    return "indexer" if "indexer" in jax.tree_util.keystr(path) else "model"
  return jax.tree_util.tree_map_with_path(label, params)


@functools.lru_cache(maxsize=8)
def make_optimizer(t: TrainSection) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Two AdamWs, one for the indexers (which learn only from the KL) at
  ``train.indexer_lr`` and one for the rest of the model (only from the language-model
  loss) at ``train.lr``, each clipping its own gradients' global norm; linear warm-up,
  then cosine decay to ``min_lr_ratio`` of the peak at the last step. Vectors (norm
  scales) are not decayed. With ``train.trainable: mtp``, one AdamW for the MTP block and
  ``optax.set_to_zero`` (no state) for every other parameter. Returns the transformation
  and the model's schedule.

  Cached: the same section gives the same (hashable) transformation, so the jitted step,
  which takes it as a static argument, compiles once per process."""
  decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)

  def adamw(peak: float) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(_schedule(t, peak), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                    mask=decay))

  labels = functools.partial(_labels, trainable=t.trainable)
  if t.trainable == "mtp":
    return optax.multi_transform({"model": adamw(t.lr), "frozen": optax.set_to_zero()},
                                 labels), _schedule(t, t.lr)
  indexer_lr = t.lr if t.indexer_lr is None else t.indexer_lr
  tx = optax.multi_transform({"model": adamw(t.lr), "indexer": adamw(indexer_lr)}, labels)
  return tx, _schedule(t, t.lr)


def cast(params: Any, dtype: str) -> Any:
  return jax.tree.map(lambda p: p.astype(dtype), params)


def _loss(params, graphdef, windows, opts: ForwardOptions, cfg: TrainConfig):
  if cfg.train.trainable != "all":
    # Frozen parameters carry no gradient: nothing that depends only on them (the main
    # model's layers, the language-model loss, the KL) has a backward pass.
    params = jax.tree.map(lambda p, l: jax.lax.stop_gradient(p) if l == "frozen" else p,
                          params, _labels(params, cfg.train.trainable))
  model = nnx.merge(graphdef, cast(params, cfg.model.dtype))
  s = terms_summary(batch_terms(model, windows, opts), cfg.train.seq_len,
                    cfg.model.index_topk)
  kl, spill = jnp.mean(s["kl"]), jnp.mean(s["spill"])
  loss = (s["lm"] + cfg.train.kl_weight * kl + cfg.train.mtp_weight * s["mtp"]
          + cfg.train.concentration_weight * spill)
  aux = {"lm": s["lm"], "kl": kl, "mtp": s["mtp"]}
  return loss, {**aux, "spill": spill} if opts.spill else aux


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(4, 5))
def train_step(graphdef, tx, opts: ForwardOptions, cfg: TrainConfig, params, opt_state,
               windows):
  """One optimizer step on [B, T + 1] windows; returns (params, opt_state, metrics).
  Frozen parameters (``train.trainable``) are returned as they came."""
  (loss, aux), grads = jax.value_and_grad(_loss, has_aux=True)(params, graphdef, windows,
                                                               opts, cfg)
  updates, opt_state = tx.update(grads, opt_state, params)
  tree_labels = _labels(params, cfg.train.trainable)
  params = jax.tree.map(
      lambda p, u, l: p if l == "frozen" else optax.apply_updates(p, u), params, updates,
      tree_labels)
  labels = jax.tree.leaves(tree_labels)

  def norm(name: str) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                        for g, l in zip(jax.tree.leaves(grads), labels) if l == name))
  return params, opt_state, {"loss": loss, **aux, "grad_norm": norm("model"),
                             "indexer_grad_norm": norm("indexer")}


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def eval_terms(graphdef, opts: ForwardOptions, dtype: str, params, windows):
  """``batch_terms`` of [B, T + 1] held-out windows (no gradient)."""
  return batch_terms(nnx.merge(graphdef, cast(params, dtype)), windows, opts)


# ----------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------


def evaluate(graphdef, params, windows: np.ndarray, cfg: TrainConfig) -> dict:
  """Held-out loss with dense and with sparse (top-k) attention, the indexer's KL in
  each, and the share of each layer's dense attention (averaged over heads) that the
  group's top-k holds, averaged over queries: all of them (``captured_mass``) and those
  with more than k candidates (``captured_mass_beyond_k``, the ones a selection can
  miss), beside the most any k positions could hold there (the attention's own top-k,
  ``attention_topk_mass_beyond_k``), and the MTP block's loss (``mtp_loss_dense`` /
  ``mtp_loss_sparse``: how well it predicts the token two places ahead, which decides
  how many speculative drafts are accepted). Windows are evaluated ``train.batch_size``
  at a time."""
  T, k, B = cfg.train.seq_len, cfg.model.index_topk, cfg.train.batch_size
  out = {}
  for mode, opts in (("dense", ForwardOptions(False, cfg.block, kl=True, measure=True)),
                     ("sparse", ForwardOptions(True, cfg.block, kl=True))):
    sums: dict[str, np.ndarray] = {}
    for i in range(0, windows.shape[0], B):
      chunk = windows[i:i + B]
      if chunk.shape[0] < B:  # the same compiled shape for every chunk
        chunk = np.concatenate([chunk, np.repeat(chunk[-1:], B - chunk.shape[0], 0)])
      terms = jax.device_get(eval_terms(graphdef, opts, cfg.model.dtype, params, chunk))
      n = min(B, windows.shape[0] - i)
      for name, v in terms.items():
        sums[name] = sums.get(name, 0.0) + np.sum(np.asarray(v, np.float64)[:n], axis=0)
    n = windows.shape[0]
    out[f"loss_{mode}"] = float(sums["lm"] / (n * T))
    out[f"bits_per_byte_{mode}"] = out[f"loss_{mode}"] / LN2
    out[f"kl_{mode}"] = float(np.mean(sums["kl"]) / (n * T))
    out[f"mtp_loss_{mode}"] = float(sums["mtp"] / (n * max(T - 1, 1)))
    if mode == "dense":
      per_layer = sums["mass"] / (n * T)
      far = sums["mass_far"] / max(n * (T - k), 1)
      out["captured_mass"] = float(np.mean(per_layer))
      out["captured_mass_per_layer"] = per_layer.tolist()
      if T > k:
        out["captured_mass_beyond_k"] = float(np.mean(far))
        out["captured_mass_beyond_k_per_layer"] = far.tolist()
        # The ceiling: the share of each query's attention its own k largest hold.
        best = sums["oracle_far"] / max(n * (T - k), 1)
        out["attention_topk_mass_beyond_k"] = float(np.mean(best))
        out["attention_topk_mass_beyond_k_per_layer"] = best.tolist()
  out["loss"] = out["loss_sparse"]  # as served: attention over the top-k
  out["bits_per_byte"] = out["bits_per_byte_sparse"]
  return out


# ----------------------------------------------------------------------------------
# The run directory
# ----------------------------------------------------------------------------------


def _append(path: Path, record: dict) -> None:
  with path.open("a") as f:
    f.write(dumps(record) + "\n")


def _truncate(path: Path, step: int) -> list[dict]:
  """Keeps the lines of ``path`` up to ``step`` (a resumed run rewrites the rest);
  returns them."""
  if not path.is_file():
    return []
  keep = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= step]
  path.write_text("".join(dumps(r) + "\n" for r in keep))
  return keep


def _config_differences(saved: dict, given: dict, prefix: str = "") -> list[str]:
  out = []
  for key in sorted(set(saved) | set(given)):
    a, b = saved.get(key), given.get(key)
    name = f"{prefix}{key}"
    if isinstance(a, dict) and isinstance(b, dict):
      out += _config_differences(a, b, f"{name}.")
    elif a != b:
      out.append(f"{name}: run has {a!r}, given {b!r}")
  return out


def _claim(cfg: TrainConfig, out_dir: str | Path | None, resume: str | Path | None):
  """The run directory and its lock. ``resume``: an existing training run whose
  ``config.yaml`` must equal ``cfg`` (ConfigError listing the differences)."""
  if resume is not None:
    run_dir = Path(resume).absolute()
    saved = run_dir / CONFIG_FILE
    if not saved.is_file():
      raise RunDirError(f"--resume {run_dir}: no {CONFIG_FILE} there; not a training run "
                        f"directory")
    saved_cfg = validate_train(yaml.safe_load(saved.read_text()), source=str(saved))
    diff = _config_differences(config_dict(saved_cfg), config_dict(cfg))
    if diff:
      raise ConfigError([f"--resume {run_dir}: the config differs from the run's "
                         f"({CONFIG_FILE}): " + "; ".join(diff)])
    return run_dir, claim_dir(run_dir, "--resume")
  if out_dir is None:
    run_dir = new_run_dir(cfg.experiment.out_dir, cfg.experiment.name)
  else:
    run_dir = check_out_dir(out_dir)
    run_dir.mkdir(exist_ok=True)
  lock = claim_dir(run_dir, "--out")
  (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(config_dict(cfg), sort_keys=False))
  return run_dir, lock


def _init_from_error(cfg: TrainConfig, e: Exception) -> ConfigError:
  return ConfigError([f"train.init_from={cfg.train.init_from!r}: {e}"])


def init_model(cfg: TrainConfig) -> Transformer:
  """The model a run starts from: drawn from ``model.param_seed``, then, with
  ``train.init_from``, the parameters saved there (those it does not hold, the MTP block
  of a model saved without one, keep their ``param_seed`` values). A directory that is
  missing or has another geometry is a ConfigError (a ValueError) naming
  ``train.init_from`` and the first field or parameter that differs."""
  model = Transformer(cfg.model, rngs=nnx.Rngs(cfg.model.param_seed))
  if cfg.train.init_from is not None:
    try:
      restore_into(model, cfg.train.init_from)
    except (FileNotFoundError, ValueError) as e:
      raise _init_from_error(cfg, e) from None
  return model


@dataclasses.dataclass
class TrainResult:
  """What ``train`` returns: the run directory, its status and summary."""

  run_dir: Path
  status: str  # finished | stopped (``stop_at``)
  summary: dict


def _progress(enabled: bool, console: Console | None) -> Progress:
  return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console or Console(stderr=True),
                  disable=not enabled)


def train(cfg: TrainConfig, out_dir: str | Path | None = None, *,
          resume: str | Path | None = None, progress: bool = True,
          console: Console | None = None, stop_at: int | None = None) -> TrainResult:
  """Trains the model of ``cfg``; returns the run directory and its summary.

  out_dir: a new run directory (refused when not empty); None =
    ``{experiment.out_dir}/{experiment.name}-{timestamp}``
  resume: continue the training run in this directory from its last checkpoint (its
    config must equal ``cfg``); the steps after that checkpoint are run again, with the
    same batches (``train.init_from`` is read only by a run without a checkpoint)
  stop_at: stop after this step, with a checkpoint, as an interruption would (status
    ``stopped``)

  SIGINT / SIGTERM stop the run after the current step: a checkpoint and the summary
  (status ``interrupted``) are written, then ``RunInterrupted`` is raised.
  """
  try:
    corpus = load_corpus(cfg.data)
    heldout = eval_windows(corpus.heldout, cfg.eval.sequences, cfg.train.seq_len)
    if cfg.data.start_token:
      heldout = start_windows(heldout)
    train_batch(corpus.train, 0, 1, cfg.train.seq_len, cfg.train.seed)  # text too short?
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError([str(e)]) from None
  if cfg.train.init_from is not None and resume is None:
    try:  # before the run directory exists (the parameters are read at step 0)
      check_checkpoint(cfg.model, cfg.train.init_from)
    except (FileNotFoundError, ValueError) as e:
      raise _init_from_error(cfg, e) from None
  run_dir, lock = _claim(cfg, out_dir, resume)
  try:
    return _train(cfg, corpus, heldout, run_dir, progress, console, stop_at)
  finally:
    lock.release()


def _train(cfg: TrainConfig, corpus: Corpus, heldout: np.ndarray, run_dir: Path,
           progress: bool, console: Console | None, stop_at: int | None) -> TrainResult:
  t = cfg.train
  manager = ocp.CheckpointManager(
      run_dir / CHECKPOINT_DIR,
      options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                           enable_async_checkpointing=False))
  start = manager.latest_step() or 0
  model = (init_model(cfg) if start == 0
           else Transformer(cfg.model, rngs=nnx.Rngs(cfg.model.param_seed)))
  graphdef, params = nnx.split(model)
  # Committed to one device, as restored arrays are: a resumed run then reuses the
  # compiled steps (committed and uncommitted arguments compile separately).
  device = jax.devices()[0]
  params = jax.device_put(cast(params, "float32"), device)
  tx, schedule = make_optimizer(cfg.train)
  opt_state = jax.device_put(tx.init(params), device)
  if start:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                            {"params": params, "opt_state": opt_state})
    restored = manager.restore(start, args=ocp.args.StandardRestore(abstract))
    params, opt_state = restored["params"], restored["opt_state"]
  metrics_path, eval_path = run_dir / METRICS_FILE, run_dir / EVAL_FILE
  history = _truncate(metrics_path, start)
  evals = _truncate(eval_path, start)

  log_p = unigram_log_probs(corpus.train, cfg.model.vocab_size)
  unigram = unigram_loss(log_p, heldout)
  estimate = cost.estimate(cfg)
  tokens_per_step = t.batch_size * t.seq_len
  opts = {s: ForwardOptions(s == "sparse", cfg.block, kl=True, mtp=t.mtp_weight > 0,
                            spill=s == "sparse" and t.concentration_weight > 0)
          for s in ("dense", "sparse")}
  timing = {"dense": [], "sparse": []}  # seconds of each step after the first of a stage
  first_step_s: dict[str, float] = {}

  saved = [start]

  def save(step: int) -> None:
    if saved[0] == step:
      return
    manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                 force=True)
    manager.wait_until_finished()
    saved[0] = step

  def run_eval(step: int) -> dict:
    record = {"step": step, "stage": t.stage(max(step - 1, 0)),
              **evaluate(graphdef, params, heldout, cfg)}
    _append(eval_path, record)
    evals.append(record)
    return record

  stop = StopRequest()
  status, step = "finished", start
  wall0 = time.perf_counter()
  with handle_signals(stop):
    with _progress(progress, console) as bar:
      task = bar.add_task(cfg.experiment.name, total=t.steps, completed=start, status="")
      while step < t.steps:
        stage = t.stage(step)
        windows = train_batch(corpus.train, step, t.batch_size, t.seq_len, t.seed)
        if cfg.data.start_token:
          windows = start_windows(windows)
        t0 = time.perf_counter()
        params, opt_state, m = train_step(graphdef, tx, opts[stage], cfg, params, opt_state,
                                          windows)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        dt = time.perf_counter() - t0
        if stage in first_step_s:
          timing[stage].append(dt)
        else:
          first_step_s[stage] = dt  # includes compiling the step
        step += 1
        record = {"step": step, "stage": stage, **m, "lr": float(schedule(step - 1)),
                  "step_time_s": dt, "tokens_per_s": tokens_per_step / dt}
        _append(metrics_path, record)
        history.append(record)
        spill = f"  spill {m['spill']:.3f}" if "spill" in m else ""
        line = (f"{stage}  loss {m['lm']:.3f}  kl {m['kl']:.3f}  mtp {m['mtp']:.3f}{spill}  "
                f"{tokens_per_step / dt:,.0f} tok/s")
        bar.update(task, completed=step, status=line)
        stage_end = step == t.dense_steps or step == t.steps
        if step % t.checkpoint_every == 0 or stage_end:
          save(step)
          if not progress:  # a line per checkpoint in logs
            (console or Console(stderr=True)).print(f"step {step}/{t.steps}  {line}",
                                                   highlight=False)
        if stage_end or (cfg.eval.every and step % cfg.eval.every == 0):
          ev = run_eval(step)
          if not progress:
            (console or Console(stderr=True)).print(
                f"step {step} held-out: loss {ev['loss']:.3f} (dense {ev['loss_dense']:.3f}, "
                f"unigram {unigram:.3f}) nats/token, top-k captures "
                f"{ev['captured_mass']:.1%} of the attention", highlight=False)
        if stop_at is not None and step >= stop_at and step < t.steps:
          save(step)
          status = "stopped"
          break
        if stop.signum is not None and step < t.steps:
          save(step)
          status = "interrupted"
          break
    # Signals while the results are written are noted, not raised (a second one
    # too): the run directory is never left half written.
    stop.finishing = True

    wall = time.perf_counter() - wall0
    # The model as it stands, also when the run stops early (its summary says at which
    # step); a resumed run replaces it.
    save_params(nnx.merge(graphdef, cast(params, cfg.model.dtype)), run_dir / MODEL_DIR,
                overwrite=True)
    if status == "finished":
      _write_requests(cfg, corpus, run_dir / REQUESTS_FILE)
    num_params = int(sum(x.size for x in jax.tree.leaves(params)))
    labels = jax.tree.leaves(_labels(params, t.trainable))
    trained_params = int(sum(x.size for x, l in zip(jax.tree.leaves(params), labels)
                             if l != "frozen"))
    summary = _summary(cfg, corpus, status, step, wall, timing, first_step_s, evals, unigram,
                       estimate, num_params, trained_params, run_dir)
    (run_dir / SUMMARY_FILE).write_text(dumps(summary, indent=1) + "\n")
    if cfg.experiment.plots:
      from ula_jax.train.plots import plot_curves
      plot_curves(history, evals, unigram, run_dir / CURVES_FILE, title=cfg.experiment.name)
    manager.close()
  if stop.signum is not None:
    raise RunInterrupted(stop.signum, run_dir=run_dir)
  return TrainResult(run_dir, status, summary)


def _write_requests(cfg: TrainConfig, corpus: Corpus, path: Path) -> None:
  """Four requests of held-out text up to the trained length (prompt and output), for
  ``workload.kind: file``: quarter, half, three quarters and all of ``train.seq_len``."""
  T = cfg.train.seq_len
  out = min(128, max(1, T // 8))
  lens = [max(1, T * i // 4 - out) for i in range(1, 5)]
  try:
    records = heldout_requests(corpus.heldout, lens, out, start_token=cfg.data.start_token)
  except ValueError:
    return  # held-out text shorter than the trained length: no request file
  path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def _summary(cfg: TrainConfig, corpus: Corpus, status: str, step: int, wall: float,
             timing: dict, first_step_s: dict, evals: list[dict], unigram: float,
             estimate: dict, num_params: int, trained_params: int, run_dir: Path) -> dict:
  t = cfg.train
  stages = {}
  for stage, times in timing.items():
    if times:
      mean = float(np.mean(times))
      stages[stage] = {"step_s": mean, "tokens_per_s": t.batch_size * t.seq_len / mean,
                       "first_step_s": first_step_s.get(stage)}
  dense, sparse = t.dense_steps, t.sparse_steps
  projected = sum(stages[s]["step_s"] * n for s, n in (("dense", dense), ("sparse", sparse))
                  if s in stages)
  return {
      "status": status, "step": step, "steps": t.steps,
      "stages": {"dense": dense, "sparse": sparse},
      "model": {"params": num_params, "trained_params": trained_params,
                "trainable": t.trainable, "dtype": cfg.model.dtype,
                "init_from": (None if t.init_from is None
                              else str(Path(t.init_from).absolute())),
                "checkpoint": str(run_dir / MODEL_DIR) if status == "finished" else None},
      "corpus": corpus.describe(),
      "unigram": {"loss": unigram, "bits_per_byte": unigram / LN2},
      "eval": evals[-1] if evals else None,
      "evals": evals,
      "time": {"wall_s": wall, "stages": stages,
               "projected_training_s": projected or None},
      "cost": estimate,
      "machine": {"python": platform.python_version(), "jax": jax.__version__,
                  "device": str(jax.devices()[0].device_kind),
                  "platform": jax.devices()[0].platform},
  }

