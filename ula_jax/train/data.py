"""Training text, its byte-level tokenizer, and the training and held-out windows.

The text is the files of one directory, by default the running Python's standard
library (``.py`` sources: every Python installation ships them, so nothing is fetched).
Files are read in sorted path order; a file is held out when a hash of its path (relative
to the root) falls below ``data.heldout_fraction``, so the split is the same on every
machine that has the file and does not move when other files come or go. Each file
becomes its bytes preceded by the document separator ``BOS``; the training stream and
the held-out stream are the concatenations of their files.

Training windows are drawn at random offsets of the training stream from a generator
seeded by ``(train.seed, step)``: step s gets the same batch whether the run went
straight through or was resumed. Held-out windows are evenly spaced and fixed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

from ula_jax.train.config import BYTE_VOCAB, DataConfig

BOS = 256
"""The document separator: the token before each file's bytes."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class ByteTokenizer:
  """Bytes are tokens 0..255; ``BOS`` (256) separates documents."""

  vocab_size = BYTE_VOCAB
  bos = BOS

  def encode(self, text: str | bytes, *, bos: bool = True) -> np.ndarray:
    """[len + bos] int32 token ids (UTF-8 for ``str``)."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    ids = np.frombuffer(data, np.uint8).astype(np.int32)
    return np.concatenate([[BOS], ids]).astype(np.int32) if bos else ids

  def decode(self, ids: np.ndarray | list[int]) -> bytes:
    """The bytes of ``ids``; separators and ids past 255 are dropped."""
    ids = np.asarray(ids).ravel()
    return bytes(ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tolist())


def default_root() -> Path:
  """The running Python's standard library."""
  return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, extensions: tuple[str, ...]) -> list[str]:
  """Paths (relative to ``root``, '/'-separated, sorted) of the files to read; installed
  packages (``site-packages``, ``dist-packages``) and caches are left out."""
  out = []
  for d, dirs, names in os.walk(root):
    dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]  # not descended into
    rel = Path(d).relative_to(root)
    out += [(rel / n).as_posix() for n in names if n.endswith(extensions)]
  return sorted(out)


def is_heldout(relpath: str, fraction: float) -> bool:
  """Whether the file at ``relpath`` is held out: its SHA-1 as a number in [0, 1)."""
  h = int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:8], "big")
  return h / 2.0**64 < fraction


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The training and held-out token streams and where they came from."""

  root: Path
  train_files: tuple[str, ...]
  heldout_files: tuple[str, ...]
  train: np.ndarray  # [N] uint16 tokens
  heldout: np.ndarray  # [M] uint16 tokens
  sha1: str  # of every file's path and bytes, in read order

  def describe(self) -> dict:
    return {"root": str(self.root), "train_files": len(self.train_files),
            "heldout_files": len(self.heldout_files), "train_tokens": int(self.train.size),
            "heldout_tokens": int(self.heldout.size), "sha1": self.sha1,
            "tokenizer": f"bytes + separator (vocab {BYTE_VOCAB})"}


def load_corpus(cfg: DataConfig) -> Corpus:
  """Reads and tokenizes the files ``cfg`` names (ValueError naming ``data.root`` when
  there are none)."""
  root = Path(cfg.root) if cfg.root is not None else default_root()
  if not root.is_dir():
    raise ValueError(f"data.root={str(root)!r}: not a directory")
  files = list_files(root, cfg.extensions)
  if not files:
    raise ValueError(f"data.root={str(root)!r}: no files ending in "
                     f"{', '.join(cfg.extensions)} (data.extensions)")
  digest = hashlib.sha1()
  parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
  names: dict[bool, list[str]] = {False: [], True: []}
  # data.max_bytes is shared between the splits in proportion, so a small corpus still
  # has held-out text.
  budget = {False: float("inf"), True: float("inf")}
  if cfg.max_bytes is not None:
    budget = {False: cfg.max_bytes * (1 - cfg.heldout_fraction),
              True: cfg.max_bytes * cfg.heldout_fraction}
  for rel in files:
    held = is_heldout(rel, cfg.heldout_fraction)
    if budget[held] <= 0:
      if budget[not held] <= 0:
        break
      continue
    data = (root / rel).read_bytes()
    budget[held] -= len(data)
    digest.update(rel.encode() + b"\0" + data)
    parts[held] += [np.array([BOS], np.uint16), np.frombuffer(data, np.uint8).astype(np.uint16)]
    names[held].append(rel)
  stream = {k: np.concatenate(v) if v else np.zeros(0, np.uint16) for k, v in parts.items()}
  return Corpus(root=root, train_files=tuple(names[False]), heldout_files=tuple(names[True]),
                train=stream[False], heldout=stream[True], sha1=digest.hexdigest())


def start_windows(windows: np.ndarray) -> np.ndarray:
  """``windows`` [n, L] with each first token replaced by ``BOS`` (``data.start_token``)."""
  out = np.array(windows, copy=True)
  out[:, 0] = BOS
  return out


def train_batch(tokens: np.ndarray, step: int, batch: int, seq_len: int, seed: int
                ) -> np.ndarray:
  """The training windows of ``step``: [batch, seq_len + 1] int32 (inputs are ``[:, :-1]``,
  targets ``[:, 1:]``), at offsets drawn from a generator seeded by ``(seed, step)``."""
  n = tokens.shape[0] - seq_len - 1
  if n < 0:
    raise ValueError(f"the training stream has {tokens.shape[0]} tokens, fewer than "
                     f"train.seq_len + 1 = {seq_len + 1}; lower train.seq_len or read more "
                     f"text (data.root, data.max_bytes)")
  starts = np.random.default_rng([seed, step]).integers(0, n + 1, size=batch)
  return np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_windows(tokens: np.ndarray, count: int, seq_len: int) -> np.ndarray:
  """Up to ``count`` non-overlapping held-out windows, evenly spaced:
  [n, seq_len + 1] int32 (ValueError when not even one fits)."""
  fit = tokens.shape[0] // (seq_len + 1)
  if fit < 1:
    raise ValueError(f"the held-out files hold {tokens.shape[0]} tokens, fewer than one "
                     f"window of train.seq_len + 1 = {seq_len + 1}; raise "
                     f"data.heldout_fraction or lower train.seq_len")
  n = min(count, fit)
  stride = tokens.shape[0] // n
  return np.stack([tokens[i * stride:i * stride + seq_len + 1] for i in range(n)]
                  ).astype(np.int32)


def unigram_log_probs(tokens: np.ndarray, vocab: int) -> np.ndarray:
  """[vocab] float64 log-probabilities of each token's training frequency (add-one)."""
  counts = np.bincount(tokens.astype(np.int64), minlength=vocab)[:vocab] + 1.0
  return np.log(counts / counts.sum())


def unigram_loss(log_probs: np.ndarray, windows: np.ndarray) -> float:
  """Mean nats per token of the unigram model on the windows' targets (``[:, 1:]``)."""
  return float(-log_probs[windows[:, 1:]].mean())


def heldout_requests(tokens: np.ndarray, prompt_lens: list[int], max_new_tokens: int,
                     *, start_token: bool = False) -> list[dict]:
  """Request records (``workload.kind: file``) whose prompts are held-out text: one per
  length in ``prompt_lens``, at evenly spaced offsets of the held-out stream (ValueError
  when the stream is shorter than the longest prompt); with ``start_token`` each prompt's
  first token is ``BOS``, as the model's training windows were (``data.start_token``)."""
  longest = max(prompt_lens)
  room = tokens.shape[0] - longest
  if room < 0:
    raise ValueError(f"the held-out files hold {tokens.shape[0]} tokens, fewer than the "
                     f"longest prompt ({longest})")
  starts = np.linspace(0, room, len(prompt_lens)).astype(int)
  first = (lambda p: [BOS] + p[1:]) if start_token else (lambda p: p)
  return [{"id": f"heldout-{i}", "prompt": first(tokens[s:s + n].astype(int).tolist()),
           "max_new_tokens": max_new_tokens}
          for i, (s, n) in enumerate(zip(starts, prompt_lens))]
