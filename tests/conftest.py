"""Test setup: 8 simulated CPU devices, a compilation cache for the session, unoptimised
CPU code generation by XLA's quicker emitters, fewer garbage collections, and random keys
whose seed is printed."""

import atexit
import gc
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


def _jaxlib_010_cpu_flag(flag: str) -> None:
  """``flag`` (``--name=value``) added to ``XLA_FLAGS`` in CPU sessions on jaxlib 0.10,
  unless the environment already sets ``name``. jaxlib 0.10 only: XLA stops a process that
  sets a flag it does not know, and jaxlib 0.11's XLA no longer knows the ones below
  (although their names are still in the library). The environment variable reaches the
  xdist workers and the processes tests and runs start."""
  flags = os.environ.get("XLA_FLAGS", "")
  name = flag.removeprefix("--").partition("=")[0]
  if os.environ["JAX_PLATFORMS"] != "cpu" or name in flags:
    return
  import jaxlib

  if jaxlib.__version__.startswith("0.10."):
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


# With LLVM at -O0, most of what is left of a CPU compile is XLA's MLIR fusion emitters
# (each fusion lowered through MLIR dialects to LLVM IR): about two thirds of an engine
# step's compile. ``--xla_cpu_use_fusion_emitters=false`` emits fusions with XLA's older
# LLVM IR emitters directly, about three times faster to compile. The operations computed
# are the same; XLA groups some of them into other fusions (the two emitters support
# different kinds), so, as with the setting above, the machine code and float results in
# the last bits may differ from a default build's (every comparison here is between
# programs of one session).
_jaxlib_010_cpu_flag("--xla_cpu_use_fusion_emitters=false")

# XLA:CPU splits each program's LLVM module into up to 32 parts and generates their
# machine code on threads. The suite runs one xdist worker per core (``-n 2`` on two
# cores), so the threads only take turns with the other worker, and the split and its
# extra modules are work of their own: on such a machine an engine step's compile takes
# about a tenth more CPU time than in one part. ``split_count=1`` generates one module on
# the compiling thread. The functions compiled are the same (LLVM at -O0 optimises none
# across them); only where their code is generated changes.
_jaxlib_010_cpu_flag("--xla_cpu_parallel_codegen_split_count=1")


def _short_tracebacks_in_locations() -> None:
  """jax writes the Python traceback of every traced operation (up to 100 frames) into
  the MLIR locations of each program it lowers, and XLA carries them through every pass
  as the program's stack-frame metadata: work for each of the thousands of programs the
  suite lowers, read only by profilers and XLA's own error messages. No location
  frames (``jax_traceback_in_locations_limit=0``) leaves the programs the same (their
  operations and names; the operations' ``name`` locations stay). A setting the
  environment already gives is left as it is; the environment variable reaches the xdist
  workers and the processes tests start."""
  if "JAX_TRACEBACK_IN_LOCATIONS_LIMIT" in os.environ:
    return
  os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"] = "0"
  jax.config.update("jax_traceback_in_locations_limit", 0)


_short_tracebacks_in_locations()


def _fewer_garbage_collections() -> None:
  """A quarter of the suite's time is jax tracing the steps tests build, which makes
  objects by the million; Python's cyclic collector, run every 700 new objects, walks
  them and the session's modules over and over (about 7% of the suite's CPU time). The
  modules imported so far stay alive for the session (``gc.freeze``: never walked
  again), and the collector runs every 50,000 new objects. Reference counting still
  frees everything outside cycles at once."""
  gc.freeze()
  gc.set_threshold(50_000, 20, 20)


_fewer_garbage_collections()

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


# The modules whose tests take longest on a 2-core machine (``--durations``), longest
# first. They run first: with ``--dist worksteal`` a worker that runs dry takes the other's
# queued tests, so the run ends on short tests instead of one worker finishing a long one
# alone while the other waits.
HEAVY_MODULES = (
    "test_multiprocess", "test_train", "test_triton_ir", "test_deep_model", "test_speculate",
    "test_kv_layout", "test_exactness", "test_tp_capacity", "test_decode_scores",
    "test_trace_run", "test_experiments", "test_stacked_ula_tp", "test_compilation",
    "test_bench_multi", "test_steps_per_dispatch", "test_ula_tp_properties",
    "test_exactness_tp",
)


def _heavy_first(items: list) -> None:
  rank = {name: i for i, name in enumerate(HEAVY_MODULES)}
  items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2],
                                       len(HEAVY_MODULES)))  # stable: order kept within


def pytest_collection_modifyitems(config, items):
  """Long-running modules first (``HEAVY_MODULES``). ``gpu``-marked tests need a CUDA
  device; on other machines they are deselected (not skipped): they run on a GPU host
  (``benchmarks/probes/gpu_kernels.sh``), and their interpret-mode twins run here."""
  _heavy_first(items)
  if jax.default_backend() == "gpu":
    return
  keep = [item for item in items if item.get_closest_marker("gpu") is None]
  dropped = [item for item in items if item.get_closest_marker("gpu") is not None]
  if dropped:
    config.hook.pytest_deselected(items=dropped)
    items[:] = keep
