"""The ``ula-jax`` command line (``main``); ``launch`` runs it as several processes."""

from ula_jax.cli.main import main

__all__ = ["main"]
