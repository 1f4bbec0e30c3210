"""The ``ula-jax`` command line (``main``); ``launch`` runs it as several processes.

``main`` is imported on first use, so ``python -m ula_jax.cli.main`` runs the module
once, without runpy's warning about a module already imported by its package.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
  """Run the ``ula-jax`` command line (the console script's entry point)."""
  from ula_jax.cli.main import main as _main

  return _main(argv)
