"""The host's RAM and the share of it that host pools may pin on a GPU.

A GPU backend pins host pools through XLA's pinned-host allocator, whose cap is read
from ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (in GiB; 64 when unset) when the backend
starts. The allocator grows its pinned region to the next power of two of a request,
clipped to the cap: with a cap at or above the RAM a 100 GiB pool asks for a 128 GiB
region and pins what the machine has, leaving nothing for the process itself. So the
default cap is the RAM less a reserve for the process (an eighth of it, at least 8 GiB),
and host pools are checked against the cap.
"""

from __future__ import annotations

import os

HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
"""The GPU backend's cap on pinned host memory, in GiB (64 when unset)."""
MIN_RESERVE_GIB = 8
"""Host RAM, in GiB, never pinned by default: the process's own memory."""


def host_ram() -> int | None:
  """Bytes of physical RAM (None where the platform does not say)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def free_ram() -> int | None:
  """Bytes of RAM available now (``MemAvailable`` of /proc/meminfo; None where unreadable)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) << 10
  except OSError:
    return None
  return None


def default_pinned_limit_gib(ram_bytes: int) -> int:
  """The pinned-host cap set when none is: the RAM in whole GiB less max(8, RAM / 8)."""
  gib = ram_bytes >> 30
  reserve = max(MIN_RESERVE_GIB, -(-gib // 8))
  return max(gib - reserve, 1)


def pinned_host_limit() -> int | None:
  """Bytes host pools may pin on a GPU: ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` when set (and
  a whole number), else the default cap (None where the RAM is unknown)."""
  value = os.environ.get(HOST_LIMIT_ENV, "").strip()
  if value.isdigit():
    return int(value) << 30
  ram = host_ram()
  return None if ram is None else default_pinned_limit_gib(ram) << 30


__all__ = ["HOST_LIMIT_ENV", "MIN_RESERVE_GIB", "default_pinned_limit_gib", "free_ram",
           "host_ram", "pinned_host_limit"]
