"""The ``ula-jax`` command line (``main``); ``launch`` runs it as several processes.

``main`` is imported on first use, so ``python -m ula_jax.cli.main`` runs the module
once, without runpy's warning about a module already imported by its package.
"""

__all__ = ["main"]


def main(argv=None):
    """Run the ``ula-jax`` command line (the console script's entry point)."""
    from ula_jax.cli.main import main as _main

    return _main(argv)
