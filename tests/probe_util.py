"""Loading a script of ``benchmarks/probes`` (not a package) as a module, for tests."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

PROBES = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "probes"


def load_probe(name: str) -> ModuleType:
  """``benchmarks/probes/<name>.py`` imported as a fresh module."""
  spec = importlib.util.spec_from_file_location(name, PROBES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
