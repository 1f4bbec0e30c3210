"""The ``ula-jax train`` verb: its arguments and handler (jax is imported only when it
runs)."""

from __future__ import annotations

import argparse


def add_train_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("config", help="training YAML (e.g. experiments/train_small/train.yaml)")
  p.add_argument("overrides", nargs="*", metavar="key=value",
                 help="dotted overrides, values parsed as YAML (train.sparse_steps=600, "
                 "model.num_layers=8), or model=block")
  p.add_argument("--out", metavar="DIR",
                 help="run directory (default: {experiment.out_dir}/{experiment.name}-"
                 "{timestamp}); an existing non-empty one is refused")
  p.add_argument("--resume", metavar="DIR",
                 help="continue the training run in DIR from its last checkpoint (CONFIG "
                 "and the overrides must give the run's config)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_train(args: argparse.Namespace) -> int:
  """Trains; prints the held-out result and the run directory. Exit status 0, or 2 (an
  invalid config or directory: ``ConfigError`` / ``RunDirError``, reported by ``main``)."""
  from ula_jax.config.errors import ConfigError
  from ula_jax.train.config import load_train_config
  from ula_jax.train.loop import train

  if args.out is not None and args.resume is not None:
    raise ConfigError(["give --out DIR (a new run) or --resume DIR (continue one), not both"])
  cfg = load_train_config(args.config, args.overrides)
  import jax

  from ula_jax.core.compilation import enable_persistent_cache

  if not jax.config.jax_compilation_cache_dir:
    enable_persistent_cache()  # a resumed run reads its compiled steps back
  result = train(cfg, args.out, resume=args.resume, progress=not args.no_progress)
  s = result.summary
  ev, uni = s["eval"], s["unigram"]
  if ev is not None:
    print(f"held-out loss {ev['loss']:.4f} nats/token ({ev['bits_per_byte']:.3f} bits/byte; "
          f"unigram baseline {uni['loss']:.4f} nats/token, {uni['bits_per_byte']:.3f} "
          f"bits/byte)")
    far = ev.get("captured_mass_beyond_k")
    print(f"indexer top-k captures {ev['captured_mass']:.1%} of the attention"
          + (f" ({far:.1%} over queries with more than k candidates)" if far is not None
             else ""))
    print(f"MTP block: held-out loss {ev['mtp_loss_sparse']:.4f} nats/token (predicting the "
          f"token two places ahead)")
  print(f"training run directory: {result.run_dir} (status {result.status})")
  return 0
