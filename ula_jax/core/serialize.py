"""JSON for the values the package writes: numpy scalars and arrays, dataclasses, paths."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np


def to_json(value: Any) -> Any:
  """``json.dumps`` default: numpy scalars and arrays, dataclasses, paths."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return dataclasses.asdict(value)
  if isinstance(value, Path):
    return str(value)
  raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def dumps(value: Any, **kw: Any) -> str:
  """``json.dumps`` with ``to_json`` for what plain JSON lacks."""
  return json.dumps(value, default=to_json, **kw)
