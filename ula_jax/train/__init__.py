"""Training this framework's own MLA + DSA model on text (``ula-jax train CONFIG``).

``config`` (the schema, ``load_train_config``), ``data`` (the corpus, the byte-level
tokenizer, training and held-out windows, the unigram baseline), ``forward`` (the
training forward: blockwise dense or top-k attention and the indexer's KL), ``loop``
(``train``: optimizer, steps, evaluation, checkpoints, the run directory), ``cost``
(FLOPs of a run), ``plots`` and ``command`` (the CLI verb). Modules that need jax are
imported on use: ``from ula_jax.train.loop import train``.
"""

from __future__ import annotations

from ula_jax.train.config import TrainConfig, load_train_config

__all__ = ["TrainConfig", "load_train_config"]
