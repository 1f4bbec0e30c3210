"""Test setup: 8 simulated CPU devices, a compilation cache for the session, unoptimised
CPU code generation, and random keys whose seed is printed."""

import atexit
import os
import random
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def _session_compilation_cache() -> None:
  """Many tests build a fresh engine (or system) whose programs another test already
  compiled: same HLO, same shapes. A persistent compilation cache in a directory of this
  session only (shared by the xdist workers, removed at exit; the process that made it
  removes it) turns those compiles into loads of the same executable. A cache the
  environment already configures is left as it is."""
  if jax.config.jax_compilation_cache_dir:
    return
  path = os.environ.get("ULA_JAX_TEST_COMPILATION_CACHE")
  if path is None:
    path = tempfile.mkdtemp(prefix="ula-jax-test-compilation-cache-")
    os.environ["ULA_JAX_TEST_COMPILATION_CACHE"] = path  # the xdist workers inherit it
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


_session_compilation_cache()


def _unoptimised_cpu_code() -> None:
  """Most of the suite's time is XLA compiling programs that then run for milliseconds:
  nearly every engine or system a test builds is a program no other test compiles (its
  own memory system, layout, kernels or sizes), and LLVM optimising the generated CPU
  code is about half of each compile. ``jax_disable_most_optimizations`` (LLVM -O0, no
  expensive LLVM passes) skips that part. XLA's HLO passes still run (the optimised HLO is
  the same); only the machine code is slower, and its float results may differ from an
  optimised build's in the last bits, as with any compiler setting (every comparison here
  is between programs of one session). CPU sessions only: a GPU run keeps its optimised
  kernels. A setting the environment already gives is left as it is; the environment
  variable also reaches the processes ``ula-jax launch`` starts."""
  if os.environ["JAX_PLATFORMS"] != "cpu" or "JAX_DISABLE_MOST_OPTIMIZATIONS" in os.environ:
    return
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # the xdist workers and launched runs
  jax.config.update("jax_disable_most_optimizations", True)


_unoptimised_cpu_code()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# Hypothesis profiles: ``ci`` (the default) sized for the suite's time budget, ``long``
# (``ULA_HYPOTHESIS_PROFILE=long``) 20x the examples for soak runs. Examples are random
# per run (not derandomized); a failure prints the example and its reproduce blob.
hypothesis_settings.register_profile("ci", max_examples=48, deadline=None, derandomize=False,
                                     print_blob=True)
hypothesis_settings.register_profile("long", parent=hypothesis_settings.get_profile("ci"),
                                     max_examples=48 * 20)
hypothesis_settings.load_profile(os.environ.get("ULA_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def seed(request) -> int:
  """A fresh seed per test, printed so a failure reproduces (``ULA_TEST_SEED`` pins it)."""
  value = int(os.environ.get("ULA_TEST_SEED", random.SystemRandom().randrange(2**31)))
  print(f"\n[{request.node.name}] seed={value} (rerun with ULA_TEST_SEED={value})")
  return value


@pytest.fixture
def key(seed) -> jax.Array:
  return jax.random.key(seed)


@pytest.fixture
def rng(seed) -> np.random.Generator:
  return np.random.default_rng(seed)


def pytest_collection_modifyitems(config, items):
  """``gpu``-marked tests need a CUDA device; on other machines they are deselected (not
  skipped): they run on a GPU host (``benchmarks/probes/gpu_kernels.sh``), and their
  interpret-mode twins run here."""
  if jax.default_backend() == "gpu":
    return
  keep = [item for item in items if item.get_closest_marker("gpu") is None]
  dropped = [item for item in items if item.get_closest_marker("gpu") is not None]
  if dropped:
    config.hook.pytest_deselected(items=dropped)
    items[:] = keep
