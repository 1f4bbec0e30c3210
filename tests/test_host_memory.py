"""The pinned-host cap host pools are held to on a GPU (core.host_memory)."""

import pytest

from ula_jax.core import host_memory
from ula_jax.core.host_memory import HOST_LIMIT_ENV, default_pinned_limit_gib, pinned_host_limit

GIB = 1 << 30


@pytest.mark.parametrize("ram_gib, cap_gib", [
    (125, 109),   # an H200 host of this project: 100 GiB pools fit, 16 GiB left over
    (2048, 1792),  # an eighth kept back
    (48, 40),     # at least 8 GiB kept back
    (8, 1),       # never below 1 GiB
])
def test_the_default_cap_leaves_the_process_its_reserve(ram_gib, cap_gib):
  ram = ram_gib * GIB + 123_456_789  # a RAM that is not a whole number of GiB
  assert default_pinned_limit_gib(ram) == cap_gib
  # The allocator grows a region to the next power of two of a request, clipped to the
  # cap: what it pins is never more than the cap, so the reserve is kept.
  assert ram_gib - cap_gib >= min(8, ram_gib - 1)


def test_the_variable_overrides_the_default(monkeypatch):
  monkeypatch.setenv(HOST_LIMIT_ENV, "300")
  assert pinned_host_limit() == 300 * GIB
  monkeypatch.delenv(HOST_LIMIT_ENV)
  monkeypatch.setattr(host_memory, "host_ram", lambda: 125 * GIB)
  assert pinned_host_limit() == 109 * GIB
  monkeypatch.setattr(host_memory, "host_ram", lambda: None)
  assert pinned_host_limit() is None
