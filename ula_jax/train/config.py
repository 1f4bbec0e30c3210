"""The training config (``ula-jax train CONFIG``): one frozen pydantic schema per section.

A training file has the sections ``model`` (``ModelConfig``, with building blocks as in
an experiment file: ``defaults: {model: small}``), ``data``, ``train``, ``eval`` and
``experiment``; it is composed by the experiment loader (building blocks, then the file,
then ``a.b=value`` overrides) and validated here, every problem naming its dotted field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import Field, ValidationError, field_validator, model_validator

from ula_jax.config.errors import ConfigError, format_validation_error
from ula_jax.config.loader import compose
from ula_jax.config.schema import Section, check_model_bools, check_run_name
from ula_jax.models.config import ModelConfig

BYTE_VOCAB = 257
"""Token ids of the byte-level tokenizer: the 256 byte values and one document separator
(``data.BOS``); ``model.vocab_size`` must be at least this."""


class DataConfig(Section):
  """The text the model learns: files of a directory, split into training and held-out
  files by a hash of each file's path."""

  root: str | None = Field(
      None, description="directory of text files (searched recursively); None = the "
      "running Python's standard library (sysconfig's 'stdlib' path, without "
      "site-packages)")
  extensions: tuple[str, ...] = Field(
      (".py",), description="file name endings that are read")
  heldout_fraction: float = Field(
      0.03, gt=0, lt=1, description="share of files held out for evaluation (chosen by a "
      "hash of the path relative to data.root, so the split never depends on the order)")
  max_bytes: int | None = Field(
      None, ge=1, description="read files (in sorted path order) until about this many "
      "bytes, shared by the splits in proportion; None = every file")
  start_token: bool = Field(
      False, description="every training and held-out window starts with the document "
      "separator (its first token replaced), as a served prompt starts at a document's "
      "start: one token at position 0 that attention can rest on (an attention sink), so "
      "heads need not spread what they do not use over the whole window; false = windows "
      "start wherever their offset falls")

  @field_validator("extensions", mode="before")
  @classmethod
  def _extensions(cls, v: Any) -> Any:
    if isinstance(v, str):
      v = [v]
    if (not isinstance(v, (list, tuple)) or not v
        or not all(isinstance(e, str) and e for e in v)):
      raise ValueError(f"data.extensions={v!r}: expected a non-empty list of file name "
                       f"endings such as ['.py']")
    return tuple(v)


class TrainSection(Section):
  """Steps, sequences and the optimizer (optax AdamW, linear warm-up then cosine decay)."""

  seq_len: int = Field(16384, ge=2, description="tokens per training sequence")
  batch_size: int = Field(1, ge=1, description="sequences per step")
  dense_steps: int = Field(
      100, ge=0, description="stage 1: dense causal attention; the indexer learns the "
      "main attention's distribution by KL")
  sparse_steps: int = Field(
      300, ge=0, description="stage 2: each query attends over the indexer's top-k; the "
      "KL is restricted to the selected positions")
  lr: float = Field(1e-3, gt=0, description="peak learning rate")
  indexer_lr: float | None = Field(
      None, gt=0, description="peak learning rate of the indexers' own AdamW (they learn "
      "only from the KL); None = train.lr")
  min_lr_ratio: float = Field(
      0.1, ge=0, le=1, description="final learning rate as a fraction of train.lr")
  warmup_steps: int = Field(30, ge=0, description="steps of linear learning-rate warm-up")
  weight_decay: float = Field(
      0.1, ge=0, description="AdamW weight decay (matrices and embeddings; not norms)")
  b1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
  b2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
  grad_clip: float = Field(
      1.0, gt=0, description="global gradient norm clip (the indexers' and the rest's "
      "gradients each)")
  kl_weight: float = Field(
      1.0, gt=0, description="weight of the indexer's KL loss (it reaches only the indexer)")
  mtp_weight: float = Field(
      0.3, ge=0, description="weight of the MTP block's loss (DeepSeek-V3's lambda): the "
      "cross-entropy of predicting the token two places ahead from the final hidden state "
      "and the next token's embedding; the speculative drafts' block (speculative.num_draft) "
      "learns from it, and the model through it as well; 0 = the block is not trained")
  concentration_weight: float = Field(
      0.0, ge=0, description="sparse stage: weight of the attention's spill, the part of "
      "each head's dense attention (over every earlier position) that falls outside the "
      "indexer's picks, as -log of the share the picks hold, per query and head. The "
      "positions not picked carry no language-model gradient in the sparse stage, so "
      "nothing else shapes how much of the dense attention they would take; this term "
      "asks the attention to keep its mass where the indexer looks (the KL asks the "
      "reverse). It reaches the main model only, not the indexer; 0 = off, DeepSeek-V3.2's "
      "recipe")
  attention_block: int = Field(
      512, ge=1, description="query rows per attention block: the [heads, block, seq_len] "
      "scores of one block are what the attention holds at once")
  seed: int = Field(0, ge=0, description="seed of the training windows' positions")
  checkpoint_every: int = Field(
      100, ge=1, description="steps between orbax checkpoints (the last one is kept)")
  init_from: str | None = Field(
      None, min_length=1, description="a trained model directory (``model/`` of a training "
      "run, what model.checkpoint serves; relative to the working directory) the run's "
      "parameters start from, its geometry equal to the model section's; parameters it "
      "does not hold (the MTP block of a model saved without one) keep their "
      "model.param_seed values. Read at step 0 only: --resume restores the run's own "
      "checkpoint. None = every parameter from model.param_seed")
  trainable: Literal["all", "mtp"] = Field(
      "all", description="the parameters that learn: 'all', or 'mtp': only the MTP block "
      "(the speculative drafts' block), every other parameter frozen bit for bit, without "
      "a backward pass through the main model or optimizer state for it (the language-model "
      "loss and the KL are still computed, for the logs); needs train.mtp_weight > 0")

  @property
  def steps(self) -> int:
    return self.dense_steps + self.sparse_steps

  def stage(self, step: int) -> str:
    """'dense' or 'sparse': the stage of (0-based) ``step``."""
    return "dense" if step < self.dense_steps else "sparse"


class EvalConfig(Section):
  """Held-out evaluation."""

  every: int = Field(
      100, ge=0, description="steps between held-out evaluations (0 = only at the end "
      "of each stage)")
  sequences: int = Field(
      8, ge=1, description="held-out windows of train.seq_len tokens (fewer when the "
      "held-out files are shorter)")


class TrainInfo(Section):
  """Name and output of a training run (the ``experiment`` section)."""

  name: str = Field(description="run name (run directories are named after it)")
  description: str = Field("", description="free text, kept in the run directory")
  out_dir: str = Field("runs", description="parent directory of training run directories")
  plots: bool = Field(True, description="write the loss curves (curves.png)")

  @field_validator("name")
  @classmethod
  def _name(cls, v: str) -> str:
    return check_run_name(v)


class TrainConfig(Section):
  """A whole training run: every section, validated together."""

  model: ModelConfig = Field(default_factory=ModelConfig)
  data: DataConfig = Field(default_factory=DataConfig)
  train: TrainSection = Field(default_factory=TrainSection)
  eval: EvalConfig = Field(default_factory=EvalConfig)
  experiment: TrainInfo

  @model_validator(mode="before")
  @classmethod
  def _model_bools(cls, data: Any) -> Any:
    return check_model_bools(data)

  @model_validator(mode="after")
  def _check(self) -> TrainConfig:
    problems = []
    m, t = self.model, self.train
    if m.vocab_size < BYTE_VOCAB:
      problems.append(f"model.vocab_size={m.vocab_size}: the byte-level tokenizer needs "
                      f">= {BYTE_VOCAB} (256 bytes and a document separator)")
    if t.seq_len > m.max_position:
      problems.append(f"train.seq_len={t.seq_len} is beyond model.max_position="
                      f"{m.max_position}")
    if t.steps < 1:
      problems.append("train.dense_steps + train.sparse_steps = 0: train at least one step")
    if t.warmup_steps > t.steps:
      problems.append(f"train.warmup_steps={t.warmup_steps} is more than the steps "
                      f"(train.dense_steps + train.sparse_steps = {t.steps})")
    block = min(t.attention_block, t.seq_len)
    if t.seq_len % block:
      problems.append(f"train.seq_len={t.seq_len} is not a multiple of "
                      f"train.attention_block={t.attention_block}")
    if m.kv_layout != "bf16":
      problems.append(f"model.kv_layout={m.kv_layout!r}: training computes on unquantised "
                      f"entries; train with 'bf16' (the trained parameters serve either "
                      f"layout)")
    if m.checkpoint is not None:
      problems.append(f"model.checkpoint={m.checkpoint!r}: training starts from "
                      f"model.param_seed or train.init_from; remove model.checkpoint (use "
                      f"train.init_from: PATH to start from a trained model, --resume DIR "
                      f"to continue a training run)")
    if t.trainable == "mtp" and t.mtp_weight == 0:
      problems.append("train.trainable='mtp' trains only the MTP block, from its loss: it "
                      "needs train.mtp_weight > 0 (given 0)")
    if problems:
      raise ValueError("\n".join(problems))
    return self

  @property
  def block(self) -> int:
    """Query rows per attention block (at most the sequence)."""
    return min(self.train.attention_block, self.train.seq_len)


def validate_train(data: dict, source: str | None = None) -> TrainConfig:
  """A plain dict -> TrainConfig, or one ConfigError listing every problem."""
  try:
    return TrainConfig.model_validate(data)
  except ValidationError as e:
    raise ConfigError(format_validation_error(e, TrainConfig), source=source) from None


def load_train_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
  """Loads a training file, composes its building blocks (``defaults: {model: ...}``),
  applies ``a.b=value`` overrides and validates it (nothing is computed)."""
  return validate_train(compose(path, overrides), source=str(path))


def config_dict(cfg: TrainConfig) -> dict:
  """The resolved config as plain data, ``experiment`` first (what ``config.yaml`` of
  a training run holds)."""
  data = cfg.model_dump(mode="json")
  return {"experiment": data.pop("experiment"), **data}
