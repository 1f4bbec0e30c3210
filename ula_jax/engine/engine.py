"""The serving engine: queue, admission, chunked prefill, continuous-batching decode.

The Python loop only schedules. Each engine step runs at most three jitted functions,
each one ``shard_map`` over the ``('dp', 'tp')`` mesh so that every dp rank serves its
own requests from its own pools:

* ``prefill``: one chunk of one request per dp rank (ranks with nothing to prefill skip);
  with ``workload.prefill='synthetic'`` its entries come from ``synthetic_prefill``, not
  the model;
* ``decode``: one token for every decoding row of every dp rank, greedy; with
  ``speculative.num_draft = d > 0`` a ``verify`` step instead: every decoding request's
  last token and its ``d`` drafts as ``1 + d`` query rows, greedy acceptance, and the
  next step's drafts from the model's MTP block;
* ``release``: frees the logical addresses of one finished request per dp rank.

Admission is by logical pages: a dp rank has ``memory.num_logical // page_size`` pages
(the memory system sizes its logical space to what it can physically hold), and a
request is admitted only when its whole context (prompt + max_new_tokens) fits in free
pages and a decode row is free. Otherwise it waits. A request that could never fit is
rejected with a message and the run goes on. Nothing is dropped, nothing runs out of
memory.

Tensor parallelism: with ``mesh.tp > 1`` decode splits attention heads over the tp
ranks of each dp rank (``decode_step(..., tp_axis='tp')``); prefill computes every head
on every tp rank. The host-side inputs are the same for every tp rank of a dp rank.

Multi-controller runs (``jax.distributed``, one process per host or per device group):
every process runs this same deterministic schedule over the same requests. Inputs are
built as global arrays from the host values every process holds
(``jax.make_array_from_callback``), and everything read back (next tokens, stats, the
state ``report`` reads) is gathered over processes, since no process addresses every
shard. With one process nothing is gathered and nothing changes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ula_jax.config.errors import ConfigError
from ula_jax.config.schema import ExperimentConfig
from ula_jax.core import compat, digest, pinned_region
from ula_jax.core.compilation import CompileLog
from ula_jax.engine import synthetic_prefill
from ula_jax.engine.packing import StatePacking, pack_jit, split_jit
from ula_jax.engine.types import Request, RequestResult, RunResult, StepMetrics
from ula_jax.memory import (INVALID, MeshInfo, build_memory_system, local_devices,
                             memory_stats)
from ula_jax.memory.base import memory_kind_of
from ula_jax.memory.ula.resolve import fast_path_for
from ula_jax.kernels import byte_offsets_overflow
from ula_jax.kernels.auto import concrete
from ula_jax.kernels.indexer.decode import scores_mode, topk_mode
from ula_jax.kernels.stacked_matmul import projections_impl
from ula_jax.kernels.indexer.synthetic import NOTE as SELECTIONS_NOTE, SyntheticSelection
from ula_jax.mesh import auto_kernels, interpret_kernels
from ula_jax.core.addressing import PageAllocator, addrs_of_positions, all_addrs
from ula_jax.models import mtp
from ula_jax.models import transformer as tfm


# The jitted steps by the names compilations are logged under (``core.compilation``).
STEP_PROGRAMS = ("decode", "speculate", "redo", "verify", "prefill", "release")


# What a ``RESOURCE_EXHAUSTED`` error of a step says: the allocation that failed and the
# program that asked for it (``Engine._step_memory_error``).
_ALLOCATION = re.compile(r"allocate (\d+(?:\.\d+)?\s*[KMGT]?i?B)")
_EXECUTABLE = re.compile(r"executable_name='([^']+)'")


def resolve_max_context(cfg: ExperimentConfig) -> int:
  """Tokens per request the engine is built for: ``engine.max_context``, which the schema
  derives from the workload when it is unset (``config.schema.context_bucket``)."""
  page = cfg.engine.page_size
  return -(-cfg.engine.max_context // page) * page


def store_prefill(mem: Any, state: Any, addrs: jax.Array, valid: jax.Array,
                  entries: jax.Array, keys: jax.Array, row: jax.Array) -> Any:
  """A prompt chunk into a memory system's local state (inside ``shard_map``).

  addrs: [C] int32 logical addresses; valid: [C] bool; entries: [L, C, W];
  keys: [G, C, K] indexer keys; row: [] int32 the request's decode row

  The entries and keys come in behind a fence (``transformer.fence``): the model's side
  compiles the same way in every memory system's program.
  """
  entries, keys = tfm.fence((entries, keys))
  state = mem.write_prefill(state, addrs, valid, entries, row)
  # A loop on the device, not one write per group: the program stays the same size
  # whatever the depth.
  return jax.lax.fori_loop(0, keys.shape[0],
                           lambda g, st: mem.write_index_keys(st, g, addrs, keys[g]), state)


def speculative_summary(num_draft: int, steps: list[StepMetrics], mtp_weights: str) -> dict:
  """A speculative run's figures from its steps' metrics: ``total_drafted`` drafts
  verified, ``total_accepted`` of them accepted, ``acceptance_rate`` (their ratio; None
  when nothing was drafted), ``verify_steps`` (a request's decode step counts once) and
  ``tokens_per_verify_step`` (tokens a request gains per verify step, 1 + the accepted
  drafts on average); ``mtp_weights`` says where the draft block's parameters came from."""
  drafted = sum(int(s.extra.get("drafted", 0)) for s in steps)
  accepted = sum(int(s.extra.get("accepted", 0)) for s in steps)
  verified = sum(s.running for s in steps)
  tokens = sum(s.decode_tokens for s in steps)
  return {"num_draft": num_draft, "total_drafted": drafted, "total_accepted": accepted,
          "acceptance_rate": accepted / drafted if drafted else None,
          "verify_steps": verified,
          "tokens_per_verify_step": tokens / verified if verified else None,
          "mtp_weights": mtp_weights}


def check_tp_heads(num_heads: int, tp: int) -> None:
  """ValueError unless the ``tp`` ranks can split ``num_heads`` attention heads evenly."""
  if num_heads % tp:
    fits = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
    raise ValueError(
        f"model.num_heads={num_heads} is not divisible by mesh.tp={tp}: attention heads are "
        f"split evenly over the tp ranks; use mesh.tp in {fits} or change model.num_heads")


# ----------------------------------------------------------------------------------
# Host <-> global arrays (single- and multi-controller)
# ----------------------------------------------------------------------------------


def global_array(x: Any, sharding: NamedSharding) -> jax.Array:
  """A host value every process holds (the whole array) -> a global array.

  One process: ``device_put``. Several: each process fills the shards it addresses
  from its copy, so no process sends data to another's devices.
  """
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def host_array(x: jax.Array) -> np.ndarray:
  """The whole value of a (possibly multi-process) array as numpy, on every process.

  An array spread over processes is gathered: a collective, so every process must make
  the same calls in the same order (the engine's schedule is the same on all of them).
  """
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  return multihost_utils.process_allgather(x, tiled=True)


class HostLeaf:
  """A state leaf that reads as its whole global value (gathered over processes on the
  first read, then cached): ``np.asarray``, indexing and numpy attributes work; shape
  and dtype are known without a gather. Pools nobody reads are never moved."""

  def __init__(self, x: jax.Array):
    self._x = x
    self._value: np.ndarray | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    return self._x.shape

  @property
  def dtype(self) -> np.dtype:
    return self._x.dtype

  @property
  def ndim(self) -> int:
    return self._x.ndim

  def value(self) -> np.ndarray:
    if self._value is None:
      self._value = host_array(self._x)
    return self._value

  def __array__(self, dtype=None, copy=None):
    v = self.value()
    return v if dtype is None else v.astype(dtype)

  def __getitem__(self, idx):
    return self.value()[idx]

  def __len__(self) -> int:
    return self.shape[0]

  def __getattr__(self, name: str):
    if name.startswith("_"):  # not set yet (copy, pickle): never gather for these
      raise AttributeError(name)
    return getattr(self.value(), name)


def _digest_arrays(rows: list, geo) -> dict[str, np.ndarray]:
  """(request id, token index, then the ``digest.STEP_DIGESTS``: [G], [L], [L], [L]) per
  request and decode step -> the arrays of ``digests.npz``: request [n] str, token [n]
  int32, selection [n, G], new / entries / output [n, L] uint32."""
  cols = list(zip(*rows)) if rows else [[]] * (2 + len(digest.STEP_DIGESTS))
  out = {"request": np.asarray(cols[0], dtype=str), "token": np.asarray(cols[1], np.int32)}
  for name, col in zip(digest.STEP_DIGESTS, cols[2:]):
    width = geo.num_groups if name == "selection" else geo.num_layers
    out[name] = np.stack(col).astype(np.uint32) if col else np.zeros((0, width), np.uint32)
  return out


def _per_rank(take: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Row d of ``a`` where ``take[d]``, else of ``b`` ([dp, ...] host arrays)."""
  return np.where(take.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)


def host_view(tree: Any) -> Any:
  """``tree`` with every leaf spread over processes replaced by a ``HostLeaf`` (what a
  memory system's host-side ``report`` reads with ``np.asarray``). One process: ``tree``
  itself."""
  spread = lambda x: isinstance(x, jax.Array) and not x.is_fully_addressable
  if not any(spread(x) for x in jax.tree.leaves(tree)):
    return tree
  return jax.tree.map(lambda x: HostLeaf(x) if spread(x) else x, tree)


@dataclasses.dataclass
class _Live:
  """A request occupying a decode row of a dp rank."""

  req: Request
  device: int
  row: int
  pages: np.ndarray
  admitted_step: int
  admitted_time: float
  prefilled: int = 0  # prompt tokens written
  generated: list[int] = dataclasses.field(default_factory=list)
  # Draft tokens (speculative.num_draft > 0) the next verify step checks after the last
  # generated token; none before the request's first decode step.
  drafts: list[int] = dataclasses.field(default_factory=list)
  first_token_step: int | None = None
  ttft_s: float | None = None
  decode_time_s: float = 0.0

  @property
  def prefill_done(self) -> bool:
    return self.prefilled >= self.req.prompt_len

  @property
  def finished(self) -> bool:
    return len(self.generated) >= self.req.max_new_tokens


@dataclasses.dataclass
class RunState:
  """The host side of a run in progress: ``Engine.run``'s scheduling state, the results
  and metrics so far. With the memory system's state and the prefill workspace it is
  what a checkpoint holds (``engine.checkpoint``)."""

  requests: list[Request]  # every request of the run, in the caller's order
  pending: collections.deque  # [Request] not yet arrived, by arrival step
  queue: collections.deque  # [Request] arrived, waiting for admission
  rows: list[list[_Live | None]]  # [dp][max_batch] the decode rows
  alloc: list[PageAllocator]  # [dp] free logical pages
  results: dict[str, RequestResult] = dataclasses.field(default_factory=dict)
  steps: list[StepMetrics] = dataclasses.field(default_factory=list)
  totals: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  step: int = 0  # the next engine step
  finished_count: int = 0
  peak: dict = dataclasses.field(default_factory=lambda: {"device_used": -1, "report": None})
  last_report: Any = None  # CapacityReport of the last report step
  elapsed_s: float = 0.0  # wall time already run (before a resume)
  callback_s: float = 0.0  # time spent in the step callback, not counted in elapsed_s
  resumed_at: list[int] = dataclasses.field(default_factory=list)  # steps resumed from
  # True between steps (the fields above agree with the device state), False within one.
  at_boundary: bool = True

  @classmethod
  def start(cls, requests: list[Request], dp: int, max_batch: int,
            num_pages: int) -> RunState:
    return cls(requests=list(requests),
               pending=collections.deque(sorted(requests, key=lambda r: r.arrival_step)),
               queue=collections.deque(), rows=[[None] * max_batch for _ in range(dp)],
               alloc=[PageAllocator(num_pages) for _ in range(dp)])


class Engine:
  """Decodes requests with a model and a memory system on a ``('dp', 'tp')`` mesh.

  ``mesh`` may span several processes (``jax.distributed``); every process then builds
  the same Engine and calls ``run`` with the same requests.
  """

  def __init__(self, cfg: ExperimentConfig, mesh: Mesh, *, max_context: int | None = None):
    t_setup = time.perf_counter()
    self.cfg = cfg
    self.mesh = mesh
    self.compile_log = CompileLog().start()  # read by the run's summary
    ecfg = cfg.engine
    self.dp, self.tp = mesh.shape["dp"], mesh.shape["tp"]
    check_tp_heads(cfg.model.num_heads, self.tp)
    self.max_batch = ecfg.max_batch
    self.page_size = ecfg.page_size
    # speculative.num_draft: draft tokens per request and step; every decode step is then a
    # verify step of 1 + num_draft query rows per request (``_verify_round``).
    self.num_draft = cfg.speculative.num_draft
    # engine.steps_per_dispatch: decode steps per device program (``_decode_round``).
    self.steps_per_dispatch = cfg.engine.steps_per_dispatch
    self.rows = cfg.speculative.rows
    self.max_context = max_context or resolve_max_context(cfg)
    self.pages_per_row = self.max_context // self.page_size
    self.chunk = min(ecfg.prefill_chunk, self.max_context)
    self.geo = cfg.model.kv_geometry()
    # workload.prefill='synthetic': prompt KV from a seeded generator (``synthetic_prefill``)
    # in chunks sized by bytes (there are no activations), and no prefill workspace.
    self.synthetic = cfg.workload.prefill == "synthetic"
    if self.synthetic:
      self.chunk = synthetic_prefill.chunk_len(self.geo, self.chunk, self.max_context)
      if jax.process_index() == 0:
        logging.getLogger(__name__).warning("warning: %s", synthetic_prefill.NOTE)
    interpret = interpret_kernels(cfg, mesh.devices.flat[0].platform)
    # kernels.*=auto decided for this device and these shapes (``kernels.auto``); everything
    # below sees concrete implementations. The run's summary records them.
    self.kernels = kernels = auto_kernels(cfg, mesh.devices.flat[0], tp=self.tp)
    platform = mesh.devices.flat[0].platform
    self.decode_topk = topk_mode(cfg.kernels.decode_topk, platform)
    self.resolve_fast_path = fast_path_for(cfg.kernels.resolve_fast_path, kernels.resolve,
                                           platform)
    self.decode_scores = scores_mode(cfg.kernels.decode_scores, self.max_context,
                                     platform=platform, tp=self.tp,
                                     page_size=self.page_size,
                                     index_dim=cfg.model.index_head_dim,
                                     kv_layout=cfg.model.kv_layout)
    # workload.selections='synthetic': decode steps rank by seeded scores of stated
    # locality (``kernels.indexer.synthetic``).
    wl = cfg.workload
    self.selections = (SyntheticSelection(period=wl.selection_period,
                                          salience=wl.selection_salience,
                                          window=wl.selection_window_for(cfg.top_k),
                                          seed=wl.seed)
                       if wl.selections == "synthetic" else None)
    if self.selections is not None and jax.process_index() == 0:
      logging.getLogger(__name__).warning("warning: %s", SELECTIONS_NOTE)
    self.mem = build_memory_system(cfg.memory, self.geo, MeshInfo(self.dp, self.tp),
                                   max_batch=self.max_batch, page_size=self.page_size,
                                   max_context=self.max_context,
                                   fetch_impl=kernels.fetch,
                                   resolve_impl=kernels.resolve,
                                   resolve_fast_path=self.resolve_fast_path,
                                   decode_scores=self.decode_scores,
                                   decode_topk=self.decode_topk,
                                   interpret=interpret,
                                   step_rows=self.rows,
                                   synthetic_selection=self.selections)
    self.attention_impl = kernels.attention
    self.interpret = interpret  # kernels.interpret as resolved for this platform
    # Prefill chunks: the same attention kernel, the configured indexer, row blocks within
    # engine.prefill_scratch.
    self.prefill_kw = dict(
        attention=kernels.attention, indexer=kernels.indexer,
        scratch_bytes=cfg.engine.prefill_scratch_bytes,
        interpret=interpret)
    # kernels.fast_path_mode: 'speculate' runs decode steps optimistically (see
    # _build_steps) on systems that support it (``MemorySystem.speculative``).
    self.fast_path_mode = cfg.kernels.fast_path_mode
    self._try_speculate = True
    self._stat_keys: list[str] = []  # a decode step's stats, in its host output's order
    self.report_every = ecfg.report_every
    # engine.record_trace: keep every rank's selections (memory.trace) in the RunResult.
    self.record_trace = ecfg.record_trace
    self._recorders = None
    # engine.record_digests: per request and decode step, where the step's bits went
    # (core.digest), kept in the RunResult.
    self.record_digests = ecfg.record_digests
    self._digests: list | None = None

    # The pools first, the parameters after: the largest allocations meet an empty device
    # allocator. Placed after the parameters, a pool that the estimate fits
    # (memory.check_fits_machine) could fail to find one free piece that large: with
    # XLA_PYTHON_CLIENT_PREALLOCATE=false the allocator grows in regions that the
    # parameters leave partly used (a 48 GiB pool beside 11.8 GiB of parameters on an
    # 80 GiB H100).
    t_pools = time.perf_counter()
    state = self._init_pools(mesh)
    # How the host pools were pinned (memory.host_alloc as it applied): 'huge_pages' where
    # regions of this process hold them, 'xla' where XLA's allocator does, None without one.
    host = [x for x in jax.tree.leaves(state)
            if isinstance(x, jax.Array) and memory_kind_of(x) == "pinned_host" and x.size]
    self.host_alloc = (None if not host else "huge_pages"
                       if any(pinned_region.holds(x) for x in host) else "xla")
    # Where a run's time before its first step goes (the summary's setup_time_s):
    # allocating and filling the pools, pinned host memory included, dominates at scale.
    self.pools_time_s = time.perf_counter() - t_pools
    # Where the MTP block's parameters (the drafts) came from; the run summary states it.
    self.mtp_weights = "param_seed"
    try:
      model = self._make_model(platform, interpret)
      self.graphdef, params = nnx.split(model)
      replicated = NamedSharding(mesh, P())
      # Drawing the parameters is dispatched ahead: waiting here reports a device out of
      # memory where it happened, not at the first program that reads them.
      self.params = jax.block_until_ready(
          jax.tree.map(lambda x: global_array(x, replicated), params))
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      raise self._params_error(e) from e
    self._check_fetch_fits(state)
    self._state_specs = self.mem.state_specs(state)
    # engine.pack_state: the state's small leaves travel between steps in a few buffers.
    self._packing = (StatePacking.plan(state, self._state_specs)
                     if ecfg.pack_state else None)
    self.state = state
    self.workspace = None if self.synthetic else self._init_workspace()
    self._build_steps()
    self._step_memory_checked = False  # check_step_memory, before the first run
    self.step_memory: dict[str, Any] | None = None  # what that check measured
    self.setup_time_s = time.perf_counter() - t_setup

  def _init_pools(self, mesh: Mesh) -> Any:
    """The memory system's initial state, or a ConfigError naming the pool fields where
    the device cannot allocate it."""
    try:
      return jax.block_until_ready(self.mem.init_state(mesh))
    except ValueError as e:
      if not str(e).startswith("memory.host_alloc"):
        raise
      raise ConfigError([str(e)]) from e
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      mc = self.cfg.memory
      raise ConfigError([
          f"memory.device_pool={mc.device_pool!r}, memory.host_pool={mc.host_pool!r}: "
          f"allocating memory.system={mc.system!r}'s pools failed "
          f"({str(e).splitlines()[0][:300]}); lower memory.device_pool or "
          "memory.host_pool (its tokens' indexer keys live on the device), or "
          "mesh.gpu_memory_fraction where the device has more to give"]) from e

  def _make_model(self, platform: str, interpret: bool | None) -> tfm.Transformer:
    """The model: parameters drawn from ``model.param_seed`` or restored from
    ``model.checkpoint``, products set by ``kernels.projections``."""
    cfg = self.cfg
    if cfg.model.checkpoint is None:
      model = tfm.Transformer(cfg.model, rngs=nnx.Rngs(cfg.model.param_seed))
    else:  # trained parameters (model.checkpoint); orbax is imported only then
      from ula_jax.models.checkpoint import load_model, mtp_saved
      model = load_model(cfg.model)
      self.mtp_weights = "checkpoint" if mtp_saved(cfg.model.checkpoint) else "param_seed"
      if self.mtp_weights != "checkpoint" and self.num_draft and jax.process_index() == 0:
        logging.getLogger(__name__).warning(
            "warning: model.checkpoint=%r has no MTP weights; the draft block is drawn from "
            "model.param_seed (the tokens are the same, fewer drafts are accepted)",
            cfg.model.checkpoint)
    self.projections = projections_impl(cfg.kernels.projections, platform, interpret)
    model.use_projections(self.projections, interpret)
    return model

  def _params_error(self, e: Exception) -> ConfigError:
    """A device out of memory while the parameters were drawn or restored, beside the
    pools made before them, as a ConfigError naming the pool fields."""
    cfg, mc = self.cfg, self.cfg.memory
    need = tfm.param_bytes(cfg.model) / 2**30
    return ConfigError([
        f"memory.device_pool={mc.device_pool!r}, memory.host_pool={mc.host_pool!r}: "
        f"model={cfg.model.preset!r}'s parameters ({need:.2f} GiB) did not fit beside "
        f"memory.system={mc.system!r}'s pools ({str(e).splitlines()[0][:300]}); lower "
        "memory.device_pool or memory.host_pool (its tokens' indexer keys live on the "
        "device)"])

  def _step_memory_error(self, e: Exception) -> ConfigError:
    """A step program the device had no memory for (a ``RESOURCE_EXHAUSTED`` error while
    serving) as a ConfigError naming the fields that size what the device holds: the
    pools and parameters fit (``memory.check_fits_machine``, ``_init_pools``), and the
    step's working memory came on top of them."""
    text = str(e)
    program = _EXECUTABLE.search(text)
    program = f"the {program.group(1).removeprefix('jit_')}" if program else "a"
    asked = _ALLOCATION.search(text)
    asked = f"it asked for {asked.group(1)} more" if asked else text.splitlines()[0][:300]
    stats = memory_stats(local_devices(self.mesh)[0])
    held = (f"; {stats['bytes_in_use'] / 2**30:.2f} of {stats['bytes_limit'] / 2**30:.2f} "
            "GiB of the device were in use"
            if {"bytes_in_use", "bytes_limit"} <= set(stats) else "")
    checked = self.step_memory
    if checked:
      held += (f"; before the first prefill the {checked['step']} step's working memory "
               f"was {checked['need_bytes'] / 2**30:.2f} GiB with "
               f"{checked['free_bytes'] / 2**30:.2f} GiB free")
      if "in_use_at_first_decode_bytes" in checked:
        held += (f", {checked['in_use_at_first_decode_bytes'] / 2**30:.2f} GiB in use as the "
                 "first decode step was dispatched")
    mc = self.cfg.memory
    return ConfigError([
        f"memory.device_pool={mc.device_pool!r}: {program} step ran out of device "
        f"memory ({asked}{held}): the pools and the parameters fit, the step's working "
        f"memory did not; lower memory.device_pool (or memory.host_pool={mc.host_pool!r}, "
        "whose tokens' indexer keys live on the device) by at least that much, or "
        f"engine.max_batch={self.max_batch}, whose rows the step's working memory grows "
        "with"])

  def working_memory(self, step: str) -> tuple[int, int] | None:
    """Step ``step``'s working memory by XLA's ``memory_analysis`` of its program
    (``lower_step``, compiled): (temporaries, outputs not aliased to a donated input) in
    bytes, or None where XLA gives no analysis."""
    analysis = self.lower_step(step).compile().memory_analysis()
    if analysis is None:
      return None
    outputs = int(analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes)
    return int(analysis.temp_size_in_bytes), max(outputs, 0)

  def check_step_memory(self) -> None:
    """A ConfigError before anything is served where the first decode program's or a
    prefill chunk's working memory does not fit beside what each local device already
    holds (pools, parameters, state, workspace): both programs are compiled ahead, as the
    first steps would compile them (those steps then run them: nothing compiles twice),
    and each one's ``memory_analysis`` - temporaries, and outputs not aliased to a donated
    input - is set against the device's free bytes (``bytes_limit - bytes_in_use``). Such
    a step would otherwise fail with ``RESOURCE_EXHAUSTED`` once requests are taken in.
    Nothing is checked where the backend reports no memory statistics (CPU) or XLA no
    analysis. The analysis is a lower bound: a step that passes can still run out, on
    fragmentation or on allocations the analysis does not count, and is then reported by
    ``_step_memory_error`` with what was measured here (``step_memory``, also in the run's
    summary). Runs once: ``run`` calls it unless it has run."""
    self._step_memory_checked = True
    free = {}
    for d in local_devices(self.mesh):
      stats = memory_stats(d)
      if {"bytes_in_use", "bytes_limit"} <= set(stats):
        free[d] = (stats["bytes_limit"] - stats["bytes_in_use"], stats)
    if not free:
      return
    kind = ("verify" if self._verify is not None
            else "speculate" if self._speculate is not None else "decode")
    device, (room, stats) = min(free.items(), key=lambda item: item[1][0])
    needs = {step: n for step in (kind, "prefill")
             if (n := self.working_memory(step)) is not None}
    if kind not in needs:
      return
    # A synthetic chunk writes generated entries (``synthetic_prefill``): where it does
    # not fit beside the pools, it is halved, below engine.prefill_chunk too, down to one
    # page. Its entries depend on the positions only, so the tokens stay; only the
    # engine steps a prompt takes grow. (One process only: every process must run chunks
    # of one size.)
    floor, chunk = min(self.page_size, self.max_context), self.chunk
    while (self.synthetic and jax.process_count() == 1 and "prefill" in needs
           and sum(needs["prefill"]) > room and self.chunk // 2 >= floor):
      self.chunk //= 2
      if (n := self.working_memory("prefill")) is None:
        break
      needs["prefill"] = n
    if self.chunk != chunk and jax.process_index() == 0:
      logging.getLogger(__name__).warning(
          "warning: the synthetic prefill chunk of %d positions (engine.prefill_chunk=%d) "
          "did not fit beside the pools; chunks of %d positions are used", chunk,
          self.cfg.engine.prefill_chunk, self.chunk)
    temp, outputs = needs[kind]
    self.step_memory = {"step": kind, "need_bytes": temp + outputs, "temp_bytes": temp,
                        "new_output_bytes": outputs, "free_bytes": int(room),
                        "in_use_bytes": int(stats["bytes_in_use"]),
                        "limit_bytes": int(stats["bytes_limit"])}
    if "prefill" in needs:
      self.step_memory["prefill_temp_bytes"] = needs["prefill"][0]
      self.step_memory["prefill_need_bytes"] = sum(needs["prefill"])
    step, (temp, outputs) = max(needs.items(), key=lambda item: sum(item[1]))
    need = temp + outputs
    if need <= room:
      return
    gib = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
    mc, ec = self.cfg.memory, self.cfg.engine
    if step != "prefill":
      grows = (f"engine.max_batch={self.max_batch}, whose rows the step's working memory "
               "grows with")
    elif self.synthetic:  # its chunk is sized by bytes (synthetic_prefill.chunk_len)
      grows = None
    else:
      grows = (f"engine.prefill_chunk={ec.prefill_chunk} or "
               f"engine.prefill_scratch={ec.prefill_scratch!r}, which size a chunk's "
               "working memory")
    raise ConfigError([
        f"memory.device_pool={mc.device_pool!r}: the {step} step needs {gib(need)} of "
        f"working memory ({gib(temp)} of temporaries, {gib(outputs)} of new "
        f"outputs) beside the pools, parameters and state, and device {device.id} has "
        f"{gib(room)} free ({stats['bytes_in_use'] / 2**30:.2f} of "
        f"{stats['bytes_limit'] / 2**30:.2f} GiB in use); lower memory.device_pool by at "
        f"least {gib(need - room)} (or "
        f"memory.host_pool={mc.host_pool!r}, whose tokens' indexer keys live on the "
        f"device)" + (f", or {grows}" if grows else "")])

  def _check_fetch_fits(self, state: Any) -> None:
    """``kernels.fetch: auto`` decided again where the Pallas row copy it chose cannot
    index a pool: a one-byte array of the state holding 2-4 GiB on a device
    (``kernels.byte_offsets_overflow``); the choice then skips ``pallas``
    (``kernels.auto.LaunchShape.wide_byte_pool``)."""
    if self.cfg.kernels.fetch != "auto" or self.kernels.fetch != "pallas":
      return
    local = [jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype)
             for x in jax.tree.leaves(state)]
    if not any(byte_offsets_overflow(x) for x in local):
      return
    fetch = auto_kernels(self.cfg, self.mesh.devices.flat[0], tp=self.tp,
                         wide_byte_pool=True).fetch
    self.kernels = self.kernels.model_copy(update={"fetch": fetch})
    self.mem.set_fetch_impl(fetch)

  # ``carry`` is the state as the jitted steps (``_decode``, ``_prefill``, ``_release``)
  # take and return it: the state itself, or with ``engine.pack_state`` (kept leaves,
  # packed buffers) (``packing.StatePacking``).

  @property
  def state(self) -> Any:
    """The memory system's state (a pytree of global arrays), unpacked."""
    if self._packing is None:
      return self.carry
    kept, packed = self.carry
    return self._packing.merge(kept, split_jit(self._packing, packed))

  @state.setter
  def state(self, state: Any) -> None:
    if self._packing is None:
      self.carry = state
    else:
      local = all(x.is_fully_addressable for x in jax.tree.leaves(state))
      packed = (self._packing.pack_host(state, self.mesh) if local
                else pack_jit(self._packing, self.mesh, state))
      self.carry = (self._packing.kept(state), packed)

  def _report_view(self) -> Any:
    """The state as ``MemorySystem.report`` reads it: the leaves where they are (reports
    count on the device and move only the counts), leaves spread over processes as
    ``HostLeaf``s."""
    return host_view(self.state)

  # ------------------------------------------------------------------------------
  # jitted steps
  # ------------------------------------------------------------------------------

  def _init_workspace(self):
    ws = tfm.init_workspace(self.cfg.model, self.max_context)
    sharding = NamedSharding(self.mesh, P("dp"))
    return jax.tree.map(
        lambda x: jax.jit(lambda: jnp.zeros((self.dp, *x.shape), x.dtype),
                          out_shardings=sharding)(), ws)

  def _build_steps(self) -> None:
    mesh, mem, graphdef = self.mesh, self.mem, self.graphdef
    sq = lambda t: jax.tree.map(lambda x: x[0], t)
    ex = lambda t: jax.tree.map(lambda x: x[None], t)
    to_local, from_local = mem.to_local, mem.from_local
    state_specs = self._state_specs
    ws_specs = jax.tree.map(lambda _: P("dp"), self.workspace)
    param_specs = jax.tree.map(lambda _: P(), self.params)
    attention, interpret = self.attention_impl, self.interpret
    prefill_kw = self.prefill_kw
    page_size = self.page_size
    tp_axis = "tp" if self.tp > 1 else None

    record, digests = self.record_trace, self.record_digests

    def step_local(m, params, state, tokens, positions, page_table, active):
      model = nnx.merge(graphdef, params)
      out = tfm.decode_step(
          model, m, state, tokens[0], positions[0], page_table[0], active[0],
          attention=attention, tp_axis=tp_axis, return_selection=record,
          return_digests=digests, interpret=interpret)
      logits, state, stats = out[:3]
      sel = out[3] if record or digests else {}
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), state, stats, sel

    def decode_local(params, state, tokens, positions, page_table, active):
      nxt, state, stats, sel = step_local(mem, params, to_local(state), tokens, positions,
                                          page_table, active)
      return nxt[None], from_local(state), ex(stats), ex(sel)

    # kernels.fast_path_mode='speculate': every group's all-hit path with no conditional;
    # a rank where some group was not all-hit restores its state and reports ``fail``,
    # and the host runs the step again there (``redo_local``). The state comes out twice:
    # as the step left it and restored (``rollback``); ``speculate`` below takes the
    # packed buffers from the old and new carry (one select per buffer: restoring a small
    # leaf in full is always a valid rollback) and the other leaves from ``rollback``.
    def speculate_local(params, state, tokens, positions, page_table, active):
      old = to_local(state)
      nxt, new, stats, sel = step_local(spec_mem, params, old, tokens, positions,
                                        page_table, active)
      fail = stats.pop("spec_fail") > 0
      return (nxt[None], from_local(new), from_local(mem.rollback(old, new, ~fail)),
              ex(stats), ex(sel), fail[None])

    def redo_local(params, state, tokens, positions, page_table, active, redo):
      state = to_local(state)
      run = lambda st: step_local(mem, params, st, tokens, positions, page_table, active)
      out_shape = jax.eval_shape(run, state)
      skip = lambda st: (jnp.zeros_like(out_shape[0]), st,
                         *jax.tree.map(jnp.zeros_like, out_shape[2:]))
      nxt, state, stats, sel = jax.lax.cond(redo[0], run, skip, state)
      return nxt[None], from_local(state), ex(stats), ex(sel)

    def mapped(fn, extra_in: int = 0, extra_out: int = 0, states: int = 1):
      # (params, state, tokens, positions, page_table, active, extra_in more [dp] inputs)
      # -> (next tokens, ``states`` states, stats, selections, extra_out more [dp] outputs)
      def call(params, state, *args):
        return compat.shard_map(
            fn, mesh=mesh,
            in_specs=(param_specs, state_specs) + (P("dp"),) * (4 + extra_in),
            out_specs=(P("dp"),) + (state_specs,) * states + (P("dp"), P("dp"))
            + (P("dp"),) * extra_out)(params, state, *args)
      return call

    decode_mapped = mapped(decode_local)
    speculate_mapped = mapped(speculate_local, extra_out=1, states=2)  # + fail
    redo_mapped = mapped(redo_local, extra_in=1)  # + redo
    spec_mem = mem.speculative() if self.fast_path_mode == "speculate" else None

    def prefill_local(params, state, ws, tokens, start, length, page_row, row, do):
      model = nnx.merge(graphdef, params)
      state, ws = to_local(state), sq(ws)
      tokens, start, length, page_row, row, do = (
          tokens[0], start[0], length[0], page_row[0], row[0], do[0])

      # Only the model's compute is conditional. The state (with its host pools) never
      # passes through a conditional: XLA copies a host-memory operand of one to the
      # device. A rank with nothing to prefill writes nothing (every address INVALID).
      def run(ws):
        entries, keys, last_logits, ws = tfm.prefill_chunk(model, ws, tokens, start, length,
                                                           **prefill_kw)
        return entries, keys, jnp.argmax(last_logits).astype(jnp.int32), ws

      e, k, _, _ = jax.eval_shape(run, ws)

      def skip(ws):
        return jnp.zeros(e.shape, e.dtype), jnp.zeros(k.shape, k.dtype), jnp.int32(0), ws

      entries, keys, tok, ws = jax.lax.cond(do, run, skip, ws)
      pos = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
      valid = (jnp.arange(tokens.shape[0]) < length) & do
      addrs = jnp.where(valid, addrs_of_positions(page_row, pos, page_size), INVALID)
      state = store_prefill(mem, state, addrs, valid, entries, keys, row)
      return from_local(state), ex(ws), tok[None]

    def prefill_mapped(params, state, ws, tokens, start, length, page_row, row, do):
      return compat.shard_map(
          prefill_local, mesh=mesh,
          in_specs=(param_specs, state_specs, ws_specs) + (P("dp"),) * 6,
          out_specs=(state_specs, ws_specs, P("dp")))(
              params, state, ws, tokens, start, length, page_row, row, do)

    def release_local(state, page_row, length, row):
      addrs = all_addrs(page_row[0], page_size)
      valid = jnp.arange(addrs.shape[0]) < length[0]
      return from_local(mem.release(to_local(state), addrs, valid, row[0]))

    def release_mapped(state, page_row, length, row):
      return compat.shard_map(
          release_local, mesh=mesh,
          in_specs=(state_specs, P("dp"), P("dp"), P("dp")),
          out_specs=state_specs)(state, page_row, length, row)

    packing = self._packing

    def unpacked(carry):
      return carry if packing is None else packing.unpack(*carry)

    def packed(state):
      return state if packing is None else packing.pack(state, mesh)

    # The jitted decode steps take one int32 input array ([dp, B, 3 + pages], see
    # ``decode_inputs``) and return one int32 array for the host ([dp, B + stats (+ 1)]:
    # next tokens, the step's stats in ``stat_keys`` order, and ``fail`` when speculating):
    # one transfer each way per step. They take and return ``carry`` (profiles name them
    # decode, speculate, redo, prefill, release).
    stat_keys = self._stat_keys

    def split_inputs(x):
      return x[..., 0], x[..., 1], x[..., 3:], x[..., 2] != 0

    def readout(nxt, stats, *extra):
      # Filled when the step is traced; every trace of a memory system gives the same keys.
      stat_keys[:] = sorted(stats)
      cols = [nxt] + [stats[k].astype(jnp.int32)[:, None] for k in stat_keys]
      return jnp.concatenate(cols + [e.astype(jnp.int32)[:, None] for e in extra], axis=1)

    def decode(params, carry, inputs):
      nxt, state, stats, sel = decode_mapped(params, unpacked(carry), *split_inputs(inputs))
      return readout(nxt, stats), packed(state), sel

    # engine.steps_per_dispatch = N > 1: N decode steps in one program, a loop on the
    # device. Its input is ``multi_inputs``' ([dp, B, 4 + pages]: token, position, active,
    # tokens left, pages); it returns [dp, N * B + stats]: the token each row decoded at
    # each of the N steps (rows past their length keep their last token and write
    # nothing), then the stats summed over the steps.
    n_steps = self.steps_per_dispatch

    def multi_local(params, state, tokens, positions, page_table, active, left):
      model = nnx.merge(graphdef, params)
      table = page_table[0]

      def one(carry, _):
        state, tok, pos, act, left = carry
        logits, state, stats = tfm.decode_step(
            model, mem, state, tok, pos, table, act, attention=attention,
            tp_axis=tp_axis, interpret=interpret)[:3]
        nxt = jnp.where(act, jnp.argmax(logits, axis=-1).astype(jnp.int32), tok)
        left = left - act.astype(jnp.int32)
        return (state, nxt, pos + act.astype(jnp.int32), act & (left > 0), left), (nxt, stats)

      carry = (to_local(state), tokens[0], positions[0], active[0], left[0])
      (state, *_), (toks, stats) = jax.lax.scan(one, carry, None, length=n_steps)
      stats = {k: v.sum(0) for k, v in stats.items()}
      return toks.reshape(-1)[None], from_local(state), ex(stats)

    def decode_multi(params, carry, inputs):
      x = inputs
      nxt, state, stats = compat.shard_map(
          multi_local, mesh=mesh,
          in_specs=(param_specs, state_specs) + (P("dp"),) * 5,
          out_specs=(P("dp"), state_specs, P("dp")))(
              params, unpacked(carry), x[..., 0], x[..., 1], x[..., 4:], x[..., 2] != 0,
              x[..., 3])
      return readout(nxt, stats), packed(state), {}
    decode_multi.__name__ = "decode"  # a decode step to profiles and the compile log

    def speculate(params, carry, inputs):
      nxt, new, restored, stats, sel, fail = speculate_mapped(params, unpacked(carry),
                                                              *split_inputs(inputs))
      if packing is None:
        return readout(nxt, stats, fail), restored, sel
      kept, restored_bufs = packing.pack(restored, mesh)  # buffers: those not over dp
      _, new_bufs = packing.pack(new, mesh)
      bufs = [jnp.where(~fail.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
              if len(b.spec) and b.spec[0] == "dp" else r
              for n, o, r, b in zip(new_bufs, carry[1], restored_bufs, packing.buffers)]
      return readout(nxt, stats, fail), (kept, bufs), sel

    def redo(params, carry, inputs, fail):
      nxt, state, stats, sel = redo_mapped(params, unpacked(carry), *split_inputs(inputs),
                                           fail)
      return readout(nxt, stats), packed(state), sel

    # speculative.num_draft > 0: the verify step (``verify_inputs`` has its input). Per
    # request it returns R + 1 + d int32 (the greedy token after each of the R = 1 + d
    # rows, the drafts accepted, the next step's d drafts), then the stats.
    num_draft, rows = self.num_draft, self.rows

    def verify_local(params, state, tokens, positions, page_table, active):
      model = nnx.merge(graphdef, params)
      active = active[0]
      logits, hidden, state, stats = tfm.verify_step(
          model, mem, to_local(state), tokens[0], positions[0], page_table[0], active,
          attention=attention, tp_axis=tp_axis, interpret=interpret)
      greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, R]
      accepted = mtp.accept_greedy(tokens[0], greedy, active)  # [B]
      # The next drafts follow the last token this step emits (row ``accepted``'s).
      last = accepted[:, None]
      h = jnp.take_along_axis(hidden, last[:, :, None], axis=1)[:, 0]
      tok = jnp.take_along_axis(greedy, last, axis=1)[:, 0]
      drafts = mtp.draft_tokens(model, h, tok, num_draft)
      out = jnp.concatenate([greedy, accepted[:, None], drafts], axis=1)
      return out[None], from_local(state), ex(stats)

    def verify(params, carry, inputs):
      tokens, positions = inputs[..., :rows], inputs[..., rows]
      active = jnp.arange(rows)[None, None, :] < inputs[..., rows + 1, None]
      out, state, stats = compat.shard_map(
          verify_local, mesh=mesh, in_specs=(param_specs, state_specs) + (P("dp"),) * 4,
          out_specs=(P("dp"), state_specs, P("dp")))(
              params, unpacked(carry), tokens, positions, inputs[..., rows + 2:], active)
      return readout(out.reshape(out.shape[0], -1), stats), packed(state)

    def prefill(params, carry, ws, *args):
      state, ws, tok = prefill_mapped(params, unpacked(carry), ws, *args)
      return packed(state), ws, tok

    def release(carry, *args):
      return packed(release_mapped(unpacked(carry), *args))

    self._decode = jax.jit(decode if n_steps == 1 else decode_multi, donate_argnums=(1,))
    self._verify = jax.jit(verify, donate_argnums=(1,)) if self.num_draft else None
    self._speculate = self._redo = None
    if spec_mem is not None:
      self._speculate = jax.jit(speculate, donate_argnums=(1,))
      self._redo = jax.jit(redo, donate_argnums=(1,))
    self._prefill = jax.jit(prefill, donate_argnums=(1, 2))
    self._release = jax.jit(release, donate_argnums=(0,))
    if self.synthetic:
      self._prefill = self._synthetic_prefill_step()

  def _synthetic_prefill_step(self) -> Callable:
    """The jitted prefill of ``workload.prefill='synthetic'``: one chunk of one request per
    dp rank, its entries and keys from ``synthetic_prefill.synthetic_chunk``; no model.

    (carry, rid [dp] int32 request keys, start [dp] int32 first positions,
     addrs [dp, C] int32 logical addresses (INVALID past the chunk's length),
     row [dp] int32, do [dp] bool) -> carry
    """
    mesh, mem, geo, packing = self.mesh, self.mem, self.geo, self._packing
    seed, state_specs = self.cfg.workload.seed, self._state_specs

    def local(state, rid, start, addrs, row, do):
      rid, start, addrs, row, do = rid[0], start[0], addrs[0], row[0], do[0]

      # No conditional around the state (see the compute path): a rank with nothing to
      # prefill generates a chunk and writes none of it.
      entries, keys = synthetic_prefill.synthetic_chunk(geo, seed, rid, start, addrs.shape[0])
      addrs = jnp.where(do, addrs, INVALID)
      state = store_prefill(mem, mem.to_local(state), addrs, addrs >= 0, entries, keys, row)
      return mem.from_local(state)

    def prefill(carry, *args):  # named as the compute path's step (``STEP_PROGRAMS``)
      state = carry if packing is None else packing.unpack(*carry)
      state = compat.shard_map(local, mesh=mesh, in_specs=(state_specs,) + (P("dp"),) * 5,
                               out_specs=state_specs)(state, *args)
      return state if packing is None else packing.pack(state, mesh)

    return jax.jit(prefill, donate_argnums=(0,))

  def _put(self, x: np.ndarray) -> jax.Array:
    """[dp, ...] host values -> a global array, row d on dp rank d (tp replicated)."""
    return global_array(x, NamedSharding(self.mesh, P("dp")))

  # ------------------------------------------------------------------------------
  # scheduling
  # ------------------------------------------------------------------------------

  def _reject_reason(self, r: Request) -> str | None:
    if r.prompt_len < 1:
      return "empty prompt"
    if r.max_new_tokens < 1:
      return f"max_new_tokens={r.max_new_tokens} must be >= 1"
    if r.total_len > self.cfg.model.max_position:
      return (f"prompt {r.prompt_len} + output {r.max_new_tokens} tokens exceeds "
              f"model.max_position={self.cfg.model.max_position}")
    if r.total_len > self.max_context:
      return (f"prompt {r.prompt_len} + output {r.max_new_tokens} tokens exceeds "
              f"engine.max_context={self.max_context}")
    need = -(-r.total_len // self.page_size)
    if need > self.mem.num_logical // self.page_size:
      return (f"needs {need * self.page_size} KV tokens; a dp rank of memory.system="
              f"{self.mem.name} holds at most {self.mem.num_logical}")
    return None

  def run(self, requests: list[Request],
          on_step: Callable[[StepMetrics], None] | None = None, *,
          resume: RunState | None = None) -> RunResult:
    """Serves ``requests`` to completion (or ``engine.max_steps``).

    resume: the state of an earlier run of the same ``requests`` (restored from a
      checkpoint with the memory system's state, ``engine.checkpoint.restore``): the run
      goes on from its step, its results and metrics so far included

    ``self.run_state`` is the run's ``RunState`` while it runs and after it returns;
    ``on_step`` is called between steps (``at_boundary``), where a checkpoint may be taken.
    The time it takes (metrics, progress, checkpoints) counts neither in the run's wall
    time nor in a request's time to first token; the summary gives it as
    ``callback_time_s``.
    """
    dp, B = self.dp, self.max_batch
    self.compile_log.start()
    if not self._step_memory_checked:
      self.check_step_memory()
    if self.record_trace:
      from ula_jax.memory.ula.trace import TraceRecorder
      self._recorders = [TraceRecorder(self.geo, max_batch=B, num_logical=self.mem.num_logical,
                                       page_size=self.page_size) for _ in range(dp)]
    self._digests = [] if self.record_digests else None
    rs = resume or RunState.start(requests, dp, B, self.mem.num_logical // self.page_size)
    self.run_state = rs
    rows, pending, queue, alloc = rs.rows, rs.pending, rs.queue, rs.alloc
    results, steps, totals = rs.results, rs.steps, rs.totals
    peak, step, finished_count, last_report = rs.peak, rs.step, rs.finished_count, rs.last_report
    max_steps = self.cfg.engine.max_steps
    t_run = time.perf_counter() - rs.elapsed_s

    # An interrupt (KeyboardInterrupt, or a subclass a caller raises for SIGTERM, e.g.
    # from on_step) ends the loop: what was served so far is returned, not lost.
    interrupted: str | None = None
    try:
      while pending or queue or any(l is not None for rank in rows for l in rank):
        if (not queue and pending and pending[0].arrival_step > step
            and all(l is None for rank in rows for l in rank)):
          # Nothing runs until the next arrival: jump to it rather than stepping (and
          # writing a metrics line) through every idle step in between.
          step = pending[0].arrival_step
          if max_steps is not None:
            step = min(step, max_steps)
        if max_steps is not None and step >= max_steps:
          break
        rs.at_boundary = False
        t0 = time.perf_counter()
        while pending and pending[0].arrival_step <= step:
          r = pending.popleft()
          reason = self._reject_reason(r)
          if reason is not None:
            results[r.id] = RequestResult(r.id, r.prompt_len, r.max_new_tokens, "rejected",
                                          [], reason=reason, arrival_step=r.arrival_step)
          else:
            queue.append(r)

        # Admission: FIFO; a request goes to the rank with the most free pages that has a free row.
        while queue:
          r = queue[0]
          need = -(-r.total_len // self.page_size)
          cands = [(alloc[d].free_pages, -d) for d in range(dp)
                   if alloc[d].free_pages >= need and any(l is None for l in rows[d])]
          if not cands:
            break
          d = -max(cands)[1]
          row = next(i for i, l in enumerate(rows[d]) if l is None)
          rows[d][row] = _Live(r, d, row, alloc[d].allocate(need), step, time.perf_counter())
          queue.popleft()

        # Prefill: the oldest not-yet-prefilled request of each rank runs one chunk.
        n_prefill, prefill_tokens = self._prefill_round(rows, step)
        prefill_wait = 0.0
        if n_prefill and self.synthetic:
          # A synthetic chunk is dispatched without a result to wait for; the decode
          # round's time starts once it is done, so that it times the decode alone.
          t_wait = time.perf_counter()
          jax.block_until_ready(self.carry)
          prefill_wait = time.perf_counter() - t_wait

        # Decode: every prefilled, unfinished row.
        t_dec = time.perf_counter()
        n_decode, decode_tokens, stats = self._decode_round(rows, step)
        decode_time = time.perf_counter() - t_dec if n_decode else 0.0
        for k, v in stats.items():
          totals[k] += v

        # Release finished requests.
        done = [l for rank in rows for l in rank if l is not None and l.finished]
        if done:
          self._release_round(done)
          for l in done:
            alloc[l.device].free(l.pages)
            rows[l.device][l.row] = None
            results[l.req.id] = RequestResult(
                l.req.id, l.req.prompt_len, l.req.max_new_tokens, "finished",
                l.generated, device=l.device, arrival_step=l.req.arrival_step,
                admitted_step=l.admitted_step, first_token_step=l.first_token_step,
                finished_step=step, ttft_s=l.ttft_s, decode_time_s=l.decode_time_s)
            finished_count += 1

        if step % self.report_every == 0 or not (pending or queue or done):
          last_report = self.mem.report(self._report_view())
        rep = last_report
        dev_used = int(rep.device_used.sum())
        if dev_used > peak["device_used"]:
          peak = {"device_used": dev_used, "report": rep}
        kind = ("mixed" if n_prefill and n_decode else "prefill" if n_prefill
                else "decode" if n_decode else "idle")
        m = StepMetrics(
            step=step, kind=kind, running=n_decode, prefilling=n_prefill,
            waiting=len(queue) + sum(1 for rank in rows for l in rank
                                     if l is not None and not l.prefill_done),
            finished=finished_count, decode_tokens=decode_tokens,
            prefill_tokens=prefill_tokens, step_time_s=time.perf_counter() - t0,
            decode_time_s=decode_time,
            tokens_per_s=decode_tokens / decode_time if decode_time > 0 else 0.0,
            device_used=dev_used, host_used=int(rep.host_used.sum()),
            distinct=rep.distinct_total,
            admitted=sum(1 for rank in rows for l in rank if l is not None),
            prefill_wait_s=prefill_wait, extra=dict(stats))
        steps.append(m)
        step += 1
        rs.step, rs.finished_count, rs.peak, rs.last_report = (step, finished_count, peak,
                                                              last_report)
        rs.elapsed_s = time.perf_counter() - t_run
        rs.at_boundary = True
        if on_step is not None:
          t_cb = time.perf_counter()
          try:
            on_step(m)
          finally:
            # The pause is left out of the wall time and of the waits of admitted rows.
            paused = time.perf_counter() - t_cb
            t_run += paused
            rs.callback_s += paused
            for l in (l for rank in rows for l in rank if l is not None):
              l.admitted_time += paused
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      raise self._step_memory_error(e) from e
    except KeyboardInterrupt as e:
      # (one that comes after the last request is done interrupts nothing)
      if pending or queue or any(l is not None for rank in rows for l in rank):
        interrupted = getattr(e, "signal_name", None) or "SIGINT"

    # Anything still queued or running when max_steps or an interrupt stops the run is
    # reported, not lost (in a copy: ``run_state`` stays as the loop left it).
    results = dict(results)
    status, why = (("interrupted", f"interrupted by {interrupted}") if interrupted
                   else ("rejected", f"engine.max_steps={max_steps} reached"))
    for rank in rows:
      for l in rank:
        if l is not None and l.req.id not in results:
          results[l.req.id] = RequestResult(
              l.req.id, l.req.prompt_len, l.req.max_new_tokens, status, list(l.generated),
              reason=f"{why} while running", device=l.device,
              arrival_step=l.req.arrival_step, admitted_step=l.admitted_step)
    for r in list(queue) + list(pending):
      results[r.id] = RequestResult(r.id, r.prompt_len, r.max_new_tokens, status, [],
                                    reason=f"{why} while waiting",
                                    arrival_step=r.arrival_step)
    for r in requests:  # an interrupt inside a step may leave one in none of the lists
      if r.id not in results:
        results[r.id] = RequestResult(r.id, r.prompt_len, r.max_new_tokens, status, [],
                                      reason=why, arrival_step=r.arrival_step)

    ordered = [results[r.id] for r in requests]
    wall = time.perf_counter() - t_run
    summary = self._summary(steps, ordered, totals, wall)
    summary["callback_time_s"] = rs.callback_s
    if rs.resumed_at:
      summary["resumed_at_steps"] = list(rs.resumed_at)
    if interrupted:
      summary["interrupted_by"] = interrupted
    self.compile_log.stop()
    capacity = peak["report"].as_dict() if peak["report"] is not None else {}
    traces = [r.build() for r in self._recorders] if self._recorders is not None else None
    self._recorders = None
    digests = None if self._digests is None else _digest_arrays(self._digests, self.geo)
    self._digests = None
    return RunResult(steps=steps, requests=ordered, capacity=capacity, summary=summary,
                     traces=traces, digests=digests)

  def _prefill_round(self, rows, step) -> tuple[int, int]:
    if self.synthetic:
      return self._synthetic_prefill_round(rows)
    dp, C = self.dp, self.chunk
    tokens = np.zeros((dp, C), np.int32)
    start = np.zeros((dp,), np.int32)
    length = np.zeros((dp,), np.int32)
    page_row = np.full((dp, self.pages_per_row), INVALID, np.int32)
    row = np.zeros((dp,), np.int32)
    do = np.zeros((dp,), bool)
    chosen: list[_Live | None] = [None] * dp
    for d in range(dp):
      cands = [l for l in rows[d] if l is not None and not l.prefill_done]
      if not cands:
        continue
      l = min(cands, key=lambda l: (l.admitted_step, l.row))
      n = min(C, l.req.prompt_len - l.prefilled)
      tokens[d, :n] = l.req.prompt[l.prefilled:l.prefilled + n]
      start[d], length[d], row[d], do[d] = l.prefilled, n, l.row, True
      page_row[d, :len(l.pages)] = l.pages
      chosen[d] = l
    if not do.any():
      return 0, 0
    self.carry, self.workspace, tok = self._prefill(
        self.params, self.carry, self.workspace, self._put(tokens), self._put(start),
        self._put(length), self._put(page_row), self._put(row), self._put(do))
    tok = host_array(tok)
    now = time.perf_counter()
    for d, l in enumerate(chosen):
      if l is None:
        continue
      if self._recorders is not None:
        self._recorders[d].prefill(self._addrs(l.pages, l.prefilled, int(length[d])),
                                   row=l.row)
      l.prefilled += int(length[d])
      if l.prefill_done:
        l.generated.append(int(tok[d]))
        l.first_token_step, l.ttft_s = step, now - l.admitted_time
    return int(do.sum()), int(length.sum())

  def _synthetic_prefill_round(self, rows) -> tuple[int, int]:
    """``workload.prefill='synthetic'``: the oldest not-yet-prefilled request of each rank
    gets its next chunk of positions ``[0, P - 1)`` from the generator. A request is
    prefilled once those are written: its first decode step takes the prompt's last token
    at position ``P - 1``, and that step's logits give its first token."""
    dp, C = self.dp, self.chunk
    rid = np.zeros((dp,), np.uint32)
    start = np.zeros((dp,), np.int32)
    addrs = np.full((dp, C), INVALID, np.int32)
    row = np.zeros((dp,), np.int32)
    length = np.zeros((dp,), np.int32)
    chosen: list[_Live | None] = [None] * dp
    for d in range(dp):
      cands = [l for l in rows[d] if l is not None and not l.prefill_done]
      for l in cands:  # nothing (more) to generate: position P - 1 is decode's
        if l.prefilled >= l.req.prompt_len - 1:
          l.prefilled = l.req.prompt_len
      cands = [l for l in cands if not l.prefill_done]
      if not cands:
        continue
      l = min(cands, key=lambda l: (l.admitted_step, l.row))
      n = min(C, l.req.prompt_len - 1 - l.prefilled)
      rid[d] = synthetic_prefill.request_key(l.req.id)
      start[d], length[d], row[d] = l.prefilled, n, l.row
      addrs[d, :n] = self._addrs(l.pages, l.prefilled, n)
      chosen[d] = l
    do = length > 0
    if not do.any():
      return 0, 0
    self.carry = self._prefill(self.carry, self._put(rid.view(np.int32)), self._put(start),
                               self._put(addrs), self._put(row), self._put(do))
    for d, l in enumerate(chosen):
      if l is None:
        continue
      if self._recorders is not None:
        self._recorders[d].prefill(addrs[d, :length[d]], row=l.row)
      l.prefilled += int(length[d])
      if l.prefilled >= l.req.prompt_len - 1:
        l.prefilled = l.req.prompt_len
    return int(do.sum()), int(length.sum())

  def _decode_round(self, rows, step) -> tuple[int, int, dict]:
    """One decode step of every decoding request: (requests, tokens generated, stats)."""
    checked = self.step_memory
    if checked and "in_use_at_first_decode_bytes" not in checked:
      # What the device holds as the first decode step is dispatched (the prompts'
      # prefill queued or done), against what it held when the step was checked.
      stats = memory_stats(local_devices(self.mesh)[0])
      checked["in_use_at_first_decode_bytes"] = int(stats.get("bytes_in_use", 0))
    if self.num_draft:
      return self._verify_round(rows, step)
    dp, B = self.dp, self.max_batch
    tokens = np.zeros((dp, B), np.int32)
    positions = np.zeros((dp, B), np.int32)
    page_table = np.full((dp, B, self.pages_per_row), INVALID, np.int32)
    active = np.zeros((dp, B), bool)
    live = []
    for d in range(dp):
      for b, l in enumerate(rows[d]):
        if l is None or not l.prefill_done or l.finished or l.first_token_step == step:
          continue
        # (synthetic prefill: the first step decodes the prompt's last token)
        tokens[d, b] = l.generated[-1] if l.generated else l.req.prompt[-1]
        positions[d, b] = l.req.prompt_len + len(l.generated) - 1
        page_table[d, b, :len(l.pages)] = l.pages
        active[d, b] = True
        live.append(l)
    if not live:
      return 0, 0, {}
    if self.steps_per_dispatch > 1:
      return self._multi_round(live, tokens, positions, page_table, active, step)
    t0 = time.perf_counter()
    inputs = self.decode_inputs(tokens, positions, page_table, active)
    extra = {}
    if self._speculate is not None and self._try_speculate:
      out, self.carry, sel = self._speculate(self.params, self.carry, inputs)
      nxt, stats, fail = self._read_out(out, with_fail=True)
      extra = {"spec_steps": dp, "spec_redone": int(fail.sum())}
      if fail.any():  # those ranks run the step again, the others keep theirs
        out2, self.carry, sel2 = self._redo(self.params, self.carry, inputs, self._put(fail))
        nxt2, stats2, _ = self._read_out(out2)
        nxt = _per_rank(fail, nxt2, nxt)
        stats = {k: _per_rank(fail, stats2[k], v) for k, v in stats.items()}
        sel = {k: _per_rank(fail, host_array(sel2[k]), host_array(v)) for k, v in sel.items()}
        self._try_speculate = False
    else:
      out, self.carry, sel = self._decode(self.params, self.carry, inputs)
      nxt, stats, _ = self._read_out(out)
    if self._recorders is not None or self._digests is not None:
      sel = {k: host_array(v) for k, v in sel.items()}
    if self._recorders is not None:
      for d, rec in enumerate(self._recorders):
        rec.decode(sel["sel_addr"][d], sel["sel_valid"][d], sel["new_addr"][d], active[d])
    if self._digests is not None:
      for l in live:  # [dp, G or L, B] each: this request's column
        self._digests.append((l.req.id, len(l.generated),
                              *(sel[f"digest_{n}"][l.device, :, l.row]
                                for n in digest.STEP_DIGESTS)))
    dt = time.perf_counter() - t0
    for l in live:
      if not l.generated:  # synthetic prefill: this step gave the first token
        l.first_token_step, l.ttft_s = step, t0 + dt - l.admitted_time
      l.generated.append(int(nxt[l.device, l.row]))
      l.decode_time_s += dt
    totals = {k: int(v.sum()) for k, v in stats.items()}
    if self._speculate is not None and not extra:
      # Speculate again once a step moved nothing on any rank.
      self._try_speculate = totals.get("misses", 0) == 0 and totals.get("evictions", 0) == 0
    return len(live), len(live), {**totals, **extra}

  def _multi_round(self, live, tokens, positions, page_table, active, step
                   ) -> tuple[int, int, dict]:
    """``_decode_round`` with ``engine.steps_per_dispatch = N > 1``: N decode steps in one
    dispatch; a request decodes min(N, tokens it has left) of them."""
    dp, B, N = self.dp, self.max_batch, self.steps_per_dispatch
    left = np.zeros((dp, B), np.int32)
    for l in live:
      left[l.device, l.row] = l.req.max_new_tokens - len(l.generated)
    t0 = time.perf_counter()
    out, self.carry, _ = self._decode(
        self.params, self.carry, self.multi_inputs(tokens, positions, page_table, active, left))
    out = host_array(out)
    toks = out[:, :N * B].reshape(dp, N, B)
    stats = {k: out[:, N * B + i] for i, k in enumerate(self._stat_keys)}
    dt = time.perf_counter() - t0
    emitted = 0
    for l in live:
      n = min(N, int(left[l.device, l.row]))
      if not l.generated:  # synthetic prefill: this dispatch gave the first token
        l.first_token_step, l.ttft_s = step, t0 + dt - l.admitted_time
      l.generated.extend(int(t) for t in toks[l.device, :n, l.row])
      l.decode_time_s += dt
      emitted += n
    return len(live), emitted, {k: int(v.sum()) for k, v in stats.items()}

  def multi_inputs(self, tokens: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
                   active: np.ndarray, left: np.ndarray) -> jax.Array:
    """The input of ``engine.steps_per_dispatch > 1``'s decode program: ``decode_inputs``
    with each row's tokens left to generate ([dp, B] int32) after ``active``:
    [dp, B, 4 + pages_per_row] int32 on the mesh."""
    x = np.concatenate([np.asarray(tokens, np.int32)[..., None],
                        np.asarray(positions, np.int32)[..., None],
                        np.asarray(active, np.int32)[..., None],
                        np.asarray(left, np.int32)[..., None],
                        np.asarray(page_table, np.int32)], axis=-1)
    return self._put(x)

  def _verify_round(self, rows, step) -> tuple[int, int, dict]:
    """``_decode_round`` with ``speculative.num_draft = d > 0``: one verify step. A request
    verifies its last token and its drafts (none in its first decode step), as many rows
    as it has tokens left to generate; it emits the greedy tokens up to the first draft
    that differs from them and keeps the step's new drafts for the next one."""
    dp, B, R = self.dp, self.max_batch, self.rows
    tokens = np.zeros((dp, B, R), np.int32)
    positions = np.zeros((dp, B), np.int32)
    n_rows = np.zeros((dp, B), np.int32)
    page_table = np.full((dp, B, self.pages_per_row), INVALID, np.int32)
    live = []
    for d in range(dp):
      for b, l in enumerate(rows[d]):
        if l is None or not l.prefill_done or l.finished or l.first_token_step == step:
          continue
        # (synthetic prefill: the first step decodes the prompt's last token)
        row = [l.generated[-1] if l.generated else int(l.req.prompt[-1])] + list(l.drafts)
        n = min(len(row), l.req.max_new_tokens - len(l.generated))
        tokens[d, b, :n] = row[:n]
        positions[d, b] = l.req.prompt_len + len(l.generated) - 1
        n_rows[d, b] = n
        page_table[d, b, :len(l.pages)] = l.pages
        live.append(l)
    if not live:
      return 0, 0, {}
    t0 = time.perf_counter()
    out, self.carry = self._verify(self.params, self.carry,
                                   self.verify_inputs(tokens, positions, n_rows, page_table))
    out = host_array(out)
    width = R + 1 + self.num_draft
    per_row = out[:, :B * width].reshape(dp, B, width)
    stats = {k: out[:, B * width + i] for i, k in enumerate(self._stat_keys)}
    dt = time.perf_counter() - t0
    drafted = accepted = emitted = 0
    for l in live:
      r = per_row[l.device, l.row]
      a = int(r[R])
      if not l.generated:  # synthetic prefill: this step gave the first token
        l.first_token_step, l.ttft_s = step, t0 + dt - l.admitted_time
      l.generated.extend(int(t) for t in r[:a + 1])
      l.drafts = [int(t) for t in r[R + 1:]]
      l.decode_time_s += dt
      drafted += int(n_rows[l.device, l.row]) - 1
      accepted += a
      emitted += a + 1
    totals = {k: int(v.sum()) for k, v in stats.items()}
    return len(live), emitted, {**totals, "drafted": drafted, "accepted": accepted}

  def verify_inputs(self, tokens: np.ndarray, positions: np.ndarray, n_rows: np.ndarray,
                    page_table: np.ndarray) -> jax.Array:
    """A verify step's inputs as the one array the jitted step takes.

    tokens: [dp, B, R] int32 each request's last token and drafts; positions: [dp, B]
    int32 the last token's position; n_rows: [dp, B] int32 rows to verify (0: none);
    page_table: [dp, B, pages_per_row] int32
    returns [dp, B, R + 2 + pages_per_row] int32 on the mesh (tokens, position, rows, pages)
    """
    x = np.concatenate([np.asarray(tokens, np.int32),
                        np.asarray(positions, np.int32)[..., None],
                        np.asarray(n_rows, np.int32)[..., None],
                        np.asarray(page_table, np.int32)], axis=-1)
    return self._put(x)

  def decode_inputs(self, tokens: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
                    active: np.ndarray) -> jax.Array:
    """A decode step's inputs as the one array the jitted steps take.

    tokens, positions: [dp, B] int32; page_table: [dp, B, pages_per_row] int32;
    active: [dp, B] bool
    returns [dp, B, 3 + pages_per_row] int32 on the mesh (token, position, active, pages)
    """
    x = np.concatenate([np.asarray(tokens, np.int32)[..., None],
                        np.asarray(positions, np.int32)[..., None],
                        np.asarray(active, np.int32)[..., None],
                        np.asarray(page_table, np.int32)], axis=-1)
    return self._put(x)

  def idle_decode_inputs(self) -> jax.Array:
    """``decode_inputs`` of a step with no active row (to compile or time the step);
    ``multi_inputs`` with ``engine.steps_per_dispatch > 1``."""
    dp, B = self.dp, self.max_batch
    if self.steps_per_dispatch > 1:
      return self.multi_inputs(np.zeros((dp, B), np.int32), np.zeros((dp, B), np.int32),
                               np.full((dp, B, self.pages_per_row), INVALID, np.int32),
                               np.zeros((dp, B), bool), np.zeros((dp, B), np.int32))
    return self.decode_inputs(np.zeros((dp, B), np.int32), np.zeros((dp, B), np.int32),
                              np.full((dp, B, self.pages_per_row), INVALID, np.int32),
                              np.zeros((dp, B), bool))

  def lower_step(self, kind: str, platforms: tuple[str, ...] | None = None) -> Any:
    """The jitted step ``kind`` (``decode``, ``speculate``, ``verify``, ``prefill`` or
    ``release``) lowered for idle inputs (no active row, nothing to prefill):
    ``.compile()`` compiles it, as the first step of that kind would (``ula-jax bench
    compile``). platforms: lower for these instead of the mesh's (``("cuda",)`` lowers
    every Pallas kernel for Triton on any machine; such a lowering is not compiled
    here)."""
    dp, B, C = self.dp, self.max_batch, self.chunk
    z = lambda *shape: self._put(np.zeros(shape, np.int32))
    if kind == "prefill" and self.synthetic:
      step, args = self._prefill, (
          self.carry, z(dp), z(dp), self._put(np.full((dp, C), INVALID, np.int32)), z(dp),
          self._put(np.zeros((dp,), bool)))
    elif kind == "prefill":
      step, args = self._prefill, (
          self.params, self.carry, self.workspace, z(dp, C), z(dp), z(dp),
          self._put(np.full((dp, self.pages_per_row), INVALID, np.int32)), z(dp),
          self._put(np.zeros((dp,), bool)))
    elif kind == "release":
      step, args = self._release, (
          self.carry, self._put(np.full((dp, self.pages_per_row), INVALID, np.int32)),
          z(dp), z(dp))
    elif kind == "verify" and self._verify is not None:
      h = lambda *shape: np.zeros(shape, np.int32)
      step, args = self._verify, (self.params, self.carry, self.verify_inputs(
          h(dp, B, self.rows), h(dp, B), h(dp, B),
          np.full((dp, B, self.pages_per_row), INVALID, np.int32)))
    else:
      step = {"decode": self._decode, "speculate": self._speculate}.get(kind)
      if step is None:
        raise ValueError(f"kind={kind!r}: expected decode, prefill, release, speculate (with "
                         f"kernels.fast_path_mode=speculate) or verify (with "
                         f"speculative.num_draft > 0)")
      args = (self.params, self.carry, self.idle_decode_inputs())
    if platforms is None:
      return step.lower(*args)
    return compat.lower_for(step.trace(*args), platforms)

  def decode_hlo(self) -> str:
    """The compiled HLO text of the step a decode round runs first: ``speculate`` where
    the engine speculates (``kernels.fast_path_mode``), else ``decode``."""
    step = self._speculate if self._speculate is not None else self._decode
    return step.lower(self.params, self.carry, self.idle_decode_inputs()).compile().as_text()

  def _read_out(self, out: jax.Array, with_fail: bool = False):
    """A decode step's host output -> (next tokens [dp, B], {stat: [dp]}, fail [dp] or None)."""
    out = host_array(out)
    B = self.max_batch
    stats = {k: out[:, B + i] for i, k in enumerate(self._stat_keys)}
    return out[:, :B], stats, (out[:, -1].astype(bool) if with_fail else None)

  def _release_round(self, done: list[_Live]) -> None:
    by_rank: dict[int, list[_Live]] = collections.defaultdict(list)
    for l in done:
      by_rank[l.device].append(l)
    while any(by_rank.values()):
      page_row = np.full((self.dp, self.pages_per_row), INVALID, np.int32)
      length = np.zeros((self.dp,), np.int32)
      row = np.zeros((self.dp,), np.int32)
      for d, ls in by_rank.items():
        if ls:
          l = ls.pop()
          page_row[d, :len(l.pages)] = l.pages
          # Entries written: the prompt and every generated token but the last.
          length[d] = l.req.prompt_len + len(l.generated) - 1
          row[d] = l.row
          if self._recorders is not None:
            self._recorders[d].release(self._addrs(l.pages, 0, int(length[d])), row=l.row)
      self.carry = self._release(self.carry, self._put(page_row), self._put(length),
                                 self._put(row))

  def _addrs(self, pages: np.ndarray, start: int, n: int) -> np.ndarray:
    """Logical addresses of positions [start, start + n) of a request (host side)."""
    pos = np.arange(start, start + n)
    return (pages[pos // self.page_size] * self.page_size + pos % self.page_size).astype(np.int32)

  def _summary(self, steps, reqs, totals, wall) -> dict:
    decode_time = sum(s.decode_time_s for s in steps)
    gen = sum(len(r.output_tokens) for r in reqs if r.status == "finished")
    dec_tokens = sum(s.decode_tokens for s in steps)
    out = {
        "memory_system": self.mem.name,
        "dp": self.dp, "tp": self.tp, "processes": jax.process_count(),
        "max_batch": self.max_batch, "max_context": self.max_context,
        "requests": len(reqs),
        "finished": sum(r.status == "finished" for r in reqs),
        "rejected": sum(r.status == "rejected" for r in reqs),
        "steps": len(steps),
        "generated_tokens": gen,
        "wall_time_s": wall,
        "setup_time_s": self.setup_time_s,
        "pools_time_s": self.pools_time_s,
        "host_alloc": self.host_alloc,
        "decode_time_s": decode_time,
        "decode_tokens_per_s": dec_tokens / decode_time if decode_time else 0.0,
        # synthetic prefill: time spent waiting for chunks before decode rounds
        "prefill_wait_s": sum(s.prefill_wait_s for s in steps),
        "tokens_per_s": gen / wall if wall else 0.0,
        "peak_running": max((s.running for s in steps), default=0),
        "capacity_tokens_per_rank": self.mem.capacity_tokens,
        "prefill": self.cfg.workload.prefill,
        "prefill_chunk": self.chunk,
        "kernels": concrete(self.kernels),
        # How decode steps scored and selected (``kernels.decode_scores`` as it applied
        # to this window, ``kernels.decode_topk``) and multiplied (``kernels.projections``).
        "decode_scores": self.decode_scores,
        "decode_topk": self.decode_topk,
        "projections": self.projections,
        "resolve_fast_path": self.resolve_fast_path,
    }
    if self.synthetic:
      out["prefill_note"] = synthetic_prefill.NOTE
    # How decode steps ranked positions (``workload.selections``).
    if self.selections is None:
      out["selections"] = {"kind": "model"}
    else:
      out["selections"] = self.selections.describe()
      out["selections_note"] = SELECTIONS_NOTE
    memory = _device_memory(self.mesh)
    if memory:
      out["device_memory"] = memory
    if self.step_memory:
      out["step_memory"] = self.step_memory  # check_step_memory, before the first prefill
    out.update({f"total_{k}": v for k, v in totals.items()})
    out.update(self.mem.run_summary(steps, reqs))
    if totals.get("hits", 0) + totals.get("misses", 0):
      out["hit_rate"] = totals["hits"] / (totals["hits"] + totals["misses"])
    if self.num_draft:
      out.update(speculative_summary(self.num_draft, steps, self.mtp_weights))
    # Programs compiled (or read from the persistent cache) since the engine was built.
    out["compilation"] = self.compile_log.summary(STEP_PROGRAMS)
    return out



def _device_memory(mesh: Mesh) -> dict[str, int]:
  """The allocator's limit and peak use on this process's first device of ``mesh``, in
  bytes; empty on a backend without memory statistics (CPU)."""
  mine = local_devices(mesh)
  stats = memory_stats(mine[0]) if mine else {}
  return {k: int(stats[k]) for k in ("bytes_limit", "peak_bytes_in_use") if k in stats}
