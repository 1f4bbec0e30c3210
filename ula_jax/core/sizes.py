"""Pool sizes: a token count, or bytes with a unit."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str, *, field: str, token_bytes: int) -> int:
  """Pool sizes in tokens (an int) or bytes (``"8GiB"``, ``"512MB"``) -> tokens."""
  if isinstance(value, bool):
    raise ValueError(f"{field}={value!r}: expected a token count or a size like '8GiB'")
  if isinstance(value, int):
    if value < 0:
      raise ValueError(f"{field}={value}: must be >= 0 tokens")
    return value
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
  if not m or m.group(2).lower() not in _UNITS:
    raise ValueError(
        f"{field}={value!r}: expected a token count (int) or bytes with a unit "
        f"({', '.join(u for u in _UNITS if u)}), e.g. '8GiB'")
  nbytes = float(m.group(1)) * _UNITS[m.group(2).lower()]
  return int(nbytes // token_bytes)


