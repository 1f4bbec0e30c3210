"""The experiment schema: one frozen pydantic model per config section.

YAML files and command-line overrides only set values; every field, its type, default
and allowed range is declared here. Models are frozen (hashable, usable as static jit
arguments) and reject unknown keys (``extra='forbid'``).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from ula_jax.config.request_file import file_lengths
from ula_jax.core.sizes import parse_size
from ula_jax.kernels.indexer.pallas import pages_fit
from ula_jax.kernels.sparse_attention import layout_problem
from ula_jax.models.config import ModelConfig

BLOCK_SECTIONS = ("model", "memory", "mesh", "workload", "engine", "kernels")
"""Sections that have building blocks under ``configs/<section>/<name>.yaml``."""


def _numeric_kind(annotation: Any) -> str | None:
  """'an integer' / 'a number' when ``annotation`` is int or float (optionally with None
  or str) and not bool, else None."""
  args = (typing.get_args(annotation)
          if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,))
  if bool in args:
    return None
  if int in args:
    return "an integer"
  if float in args:
    return "a number"
  return None


def bool_problem(value: Any, annotation: Any) -> str | None:
  """What is wrong when a YAML boolean reaches an int or float field (pydantic would take
  ``true`` as 1, so ``engine.max_batch=true`` would silently run with one row), else None."""
  kind = _numeric_kind(annotation)
  if kind is not None and isinstance(value, bool):
    return f"expected {kind}, not a boolean"
  return None


class Section(BaseModel):
  model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

  @field_validator("*", mode="before")
  @classmethod
  def _no_bool_numbers(cls, v: Any, info: ValidationInfo) -> Any:
    problem = bool_problem(v, cls.model_fields[info.field_name].annotation)
    if problem:
      raise ValueError(problem)  # the error names the field and its value
    return v


def _check_size(value: Any, field: str, *, allow_none: bool) -> Any:
  """Pool sizes are a token count (int >= 0) or bytes with a unit ('8GiB')."""
  if value is None:
    if allow_none:
      return None
    raise ValueError(f"{field}=None: expected a token count (int) or a size like '8GiB'")
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, (int, str)):
    raise ValueError(f"{field}={value!r}: expected a token count (int) or a size like '8GiB'")
  # token_bytes=1 only checks the spelling; the model's token size converts it later.
  parse_size(value, field=field, token_bytes=1)
  return value


def _check_pair(value: Any, field: str) -> Any:
  """``[min, max]`` length ranges: two integers, 1 <= min <= max."""
  ok = (isinstance(value, (list, tuple)) and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
  if not ok or not 1 <= value[0] <= value[1]:
    raise ValueError(f"{field}={_plain(value)!r}: expected a pair [min, max] of integers "
                     f"with 1 <= min <= max")
  return tuple(value)


def _plain(value: Any) -> Any:
  return list(value) if isinstance(value, tuple) else value


def scaled_range(pair: tuple[int, int], scale: float) -> tuple[int, int]:
  """``pair`` times ``scale``, rounded, each end at least 1 and ``min <= max``."""
  lo = max(1, round(pair[0] * scale))
  hi = max(lo, round(pair[1] * scale))
  return lo, hi


# ----------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------


class HiSparseConfig(Section):
  """HiSparse (SGLang ``--hisparse-config``): host holds every entry, device a buffer."""

  top_k: int | None = Field(
      None, ge=1,
      description="entries selected per request and layer group; None = model.index_topk")
  device_buffer_size: int = Field(
      4096, ge=1, description="device slots per (request, layer group) buffer; must be >= top-k")
  host_to_device_ratio: float = Field(
      2.0, gt=0, description="host pool size as a multiple of the device pool")


class FarTierConfig(Section):
  """SAC: KV in a disaggregated far pool, fetched per layer."""

  mode: Literal["on_demand", "full_prefetch"] = Field(
      "on_demand", description="fetch only the selected top-k entries, or every entry of "
      "the request (RDMA-style)")
  link: Literal["dram", "cxl", "rdma"] = Field(
      "cxl", description="the far link modelled: local DRAM, CXL memory pool or RDMA")
  num_far_devices: int = Field(
      1, ge=1, description="far memory devices entries are interleaved over")
  far_pool: int | str | None = Field(
      None,
      description="far pool size in tokens or bytes ('64GiB'); None = enough for every request")

  @field_validator("far_pool", mode="before")
  @classmethod
  def _far_pool(cls, v: Any) -> Any:
    return _check_size(v, "memory.far_tier.far_pool", allow_none=True)


PB_LRU_BUCKETS = 32
"""``memory.pb_lru_buckets``'s default: the recent buckets of the PB-LRU ring."""


class MemoryConfig(Section):
  """Which memory system places the KV, and its sizes."""

  system: Literal["resident", "ula", "hisparse", "far_tier"] = Field(
      "resident", description="memory system: resident (device only), ula, hisparse or far_tier")
  device_pool: int | str | None = Field(
      None, description="device pool per device per layer group, in tokens or bytes ('8GiB'); "
      "None = enough for engine.max_batch x engine.max_context")
  host_pool: int | str = Field(
      0, description="ula host tier per device, in tokens or bytes (0 = no host tier)")
  policy: Literal["pb_lru", "lru"] = Field(
      "pb_lru", description="ula eviction policy: parallel bucketed LRU or exact LRU")
  pb_lru_buckets: int = Field(
      PB_LRU_BUCKETS, ge=1, description="recent buckets in the PB-LRU ring (plus one cold "
      "bucket): exact LRU order is kept between slots touched at most this many rounds "
      "apart; older ones are equally cold")
  host_layout: Literal["layer_major", "entry_major"] = Field(
      "entry_major", description="ula's host pool rows (in TP mode each rank's host "
      "pool's): entry_major puts layer l's host slot h at row h * L + l (an entry's rows "
      "of every layer side by side, so a group's fetch or write-back of one entry reads "
      "or writes one stretch of host memory, not one per layer), layer_major at row "
      "l * Hr + h (a region per layer)")
  host_alloc: Literal["auto", "huge_pages", "xla"] = Field(
      "auto", description="how host pools (ula's, hisparse's, far_tier's) are pinned on a "
      "GPU: huge_pages, regions of 2 MiB pages zeroed by this process's threads and "
      "registered with the CUDA driver (a 100 GiB pool in seconds); xla, XLA's host "
      "allocator (4 KiB pages pinned by one thread: 2-3 GB/s); auto, huge_pages on CUDA "
      "GPUs, else xla")
  layout: Literal["mod", "block", "request", "replicated"] = Field(
      "mod", description="ula TP layout of a request's entries over tp ranks: position mod P, "
      "contiguous blocks, one owner per request, or a full copy per rank")
  local_buffer: int | None = Field(
      None, ge=1, description="ula TP local buffer of recently selected entries, tokens per rank; "
      "None = the system's default")
  index_scoring: Literal["aligned", "local"] = Field(
      "aligned", description="ula TP indexer: 'aligned' scores every position with the keys a "
      "rank does not own zeroed (selection bit-identical to one device); 'local' scores only "
      "owned positions (1/P of the work; near-equal scores may order differently)")
  hisparse: HiSparseConfig = Field(default_factory=HiSparseConfig)
  far_tier: FarTierConfig = Field(default_factory=FarTierConfig)

  @field_validator("device_pool", mode="before")
  @classmethod
  def _device_pool(cls, v: Any) -> Any:
    return _check_size(v, "memory.device_pool", allow_none=True)

  @field_validator("host_pool", mode="before")
  @classmethod
  def _host_pool(cls, v: Any) -> Any:
    return _check_size(v, "memory.host_pool", allow_none=False)


# ----------------------------------------------------------------------------------
# mesh, workload, engine, kernels, experiment
# ----------------------------------------------------------------------------------


class MeshConfig(Section):
  """The ``('dp', 'tp')`` device mesh."""

  dp: int = Field(1, ge=1, description="data-parallel ranks (each serves its own requests)")
  tp: int = Field(1, ge=1, description="tensor-parallel ranks (attention heads split over them)")
  platform: Literal["auto", "cpu", "gpu"] = Field(
      "auto", description="backend: auto (jax's default), cpu (simulated devices) or gpu")
  gpu_memory_fraction: float | None = Field(
      0.95, gt=0, le=1, description="share of each GPU's memory jax's allocator may hold "
      "(XLA_CLIENT_MEM_FRACTION, set when the backend starts unless the environment sets "
      "it); with XLA_PYTHON_CLIENT_PREALLOCATE=false jax's own limit is 0.75, which pools "
      "sized for the whole device outgrow. null: jax's default")

  @property
  def num_devices(self) -> int:
    return self.dp * self.tp


class WorkloadConfig(Section):
  """The requests: seeded synthetic long-document summarisation, or a file; or a
  selection trace replayed through the memory system without the model."""

  kind: Literal["synthetic", "file", "trace"] = Field(
      "synthetic", description="synthetic requests, requests read from workload.path, or "
      "'trace': replay the selections of workload.trace through the memory system without "
      "the model (metadata only)")
  seed: int = Field(0, ge=0, description="seed of lengths, token ids and arrivals")
  num_requests: int = Field(8, ge=1, description="synthetic requests to generate")
  prompt_len: tuple[int, int] = Field(
      (65536, 131072), description="[min, max] prompt tokens before length_scale (uniform)")
  length_scale: float = Field(
      1.0, gt=0, description="multiplies prompt lengths (small runs keep the shape)")
  output_len: tuple[int, int] = Field(
      (128, 512), description="[min, max] generated tokens before output_scale (uniform)")
  output_scale: float = Field(1.0, gt=0, description="multiplies output lengths")
  arrival: Literal["all_at_once", "poisson"] = Field(
      "all_at_once", description="every request at step 0, or Poisson arrivals")
  arrival_rate: float = Field(
      1.0, gt=0, description="requests per engine step when arrival='poisson'")
  path: str | None = Field(
      None, description="JSONL or JSON list of requests, for kind='file' (relative to the "
      "working directory)")
  prefill: Literal["compute", "synthetic"] = Field(
      "compute", description="how prompt KV is made: 'compute' runs the model over the prompt; "
      "'synthetic' writes prompt positions [0, P-1) with entries and indexer keys from a "
      "generator seeded by workload.seed, the request id and the position (no model "
      "compute; every memory system gets the same bits), and the first decode step takes "
      "the prompt's last token. Selections over synthetic keys are not a trained model's")
  selections: Literal["model", "synthetic"] = Field(
      "model", description="how a decode step ranks the positions its top-k selects: "
      "'model' by the indexer's scores; 'synthetic' by seeded scores of stated locality "
      "(workload.selection_period, selection_salience, selection_window; the indexer still "
      "runs, the ranking is the seeded one, from workload.seed): step-to-step locality like "
      "a trained model's with random weights or synthetic prompt keys. Not a trained "
      "model's selections")
  selection_period: int = Field(
      4, ge=1, description="selections='synthetic': positions of history between redraws "
      "of a position's per-group score (about 1/period of a step's selection changes)")
  selection_salience: float = Field(
      0.9, ge=0.0, le=1.0, description="selections='synthetic': weight of each position's "
      "fixed score (shared by the groups) against its redrawn one; higher brings dropped "
      "entries back sooner")
  selection_window: int | None = Field(
      None, ge=1, description="selections='synthetic': the newest positions (the new "
      "token's own among them) always selected, below the top-k; None: top-k / 32 (64 at "
      "top-k 2048), at least 1")
  trace: str | None = Field(
      None, description="for kind='trace': a selection trace (.npz or trace directory, "
      "ula-jax trace generate / import) or a run directory recorded with "
      "engine.record_trace (its ranks' traces); the model section gives its KV geometry")
  trace_replay: Literal["fast", "system"] = Field(
      "fast", description="kind='trace': 'fast' replays ula (DP), hisparse and resident "
      "through NumPy models of their metadata (the same counts; GLM-5-sized traces on a "
      "CPU), 'system' through the memory system's own jax transitions (every system)")

  @field_validator("prompt_len", mode="before")
  @classmethod
  def _prompt_len(cls, v: Any) -> Any:
    return _check_pair(v, "workload.prompt_len")

  @field_validator("output_len", mode="before")
  @classmethod
  def _output_len(cls, v: Any) -> Any:
    return _check_pair(v, "workload.output_len")

  @model_validator(mode="after")
  def _file_needs_path(self) -> WorkloadConfig:
    if self.kind == "file" and not self.path:
      raise ValueError("workload.kind='file' needs workload.path (a JSONL or JSON file of "
                       "requests)")
    if self.kind == "trace" and not self.trace:
      raise ValueError("workload.kind='trace' needs workload.trace (a trace .npz or "
                       "directory, or a run directory recorded with engine.record_trace)")
    return self

  def selection_window_for(self, top_k: int) -> int:
    """``selection_window`` for a top-k of ``top_k`` (its default: top-k / 32, >= 1)."""
    return self.selection_window or max(1, top_k // 32)

  @property
  def prompt_range(self) -> tuple[int, int]:
    """[min, max] prompt tokens after ``length_scale``."""
    return scaled_range(self.prompt_len, self.length_scale)

  @property
  def output_range(self) -> tuple[int, int]:
    """[min, max] generated tokens after ``output_scale``."""
    return scaled_range(self.output_len, self.output_scale)


MIN_PREFILL_SCRATCH = 1 << 20
"""The smallest ``engine.prefill_scratch`` (bytes)."""


class EngineConfig(Section):
  """Batching and scheduling."""

  max_batch: int = Field(8, ge=1, description="decode rows per dp rank")
  max_context: int | None = Field(
      None, ge=1, description="tokens per request at most; None = the longest workload "
      "request (prompt + output) rounded up to a context bucket (a page count of four per "
      "doubling, at most 25% over), so similar workloads share compiled programs")
  prefill_chunk: int = Field(256, ge=1, description="prompt tokens per prefill chunk")
  prefill_scratch: int | str = Field(
      "1GiB", description="bytes a prefill chunk's layer group selection (the indexer "
      "scores and top-k of a block of rows) and a layer's kernels.attention=xla attention "
      "may allocate at once, as bytes or with a unit ('512MiB'); the chunk's rows run in "
      "blocks that fit")
  page_size: int = Field(64, ge=1, description="logical addresses per page")
  max_steps: int | None = Field(
      None, ge=1, description="stop after this many engine steps; None = until done")
  progress: bool = Field(True, description="show a progress bar while running")
  report_every: int = Field(
      1, ge=1, description="engine steps between capacity reports (they copy pool metadata "
      "to the host)")
  pack_state: bool = Field(
      True, description="carry the memory system's small state leaves (tables, owners, "
      "bitmaps) between steps in one buffer per dtype and sharding: fewer arguments per "
      "jitted step, less host time per call; the KV pools stay separate")
  steps_per_dispatch: int = Field(
      1, ge=1, description="decode steps per device program: a loop on the device runs N "
      "steps (a row that reaches its length stops there), tokens and counters come back "
      "once per dispatch, admission, prefill and releases run between dispatches; an engine "
      "step (max_steps, metrics, checkpoints) is one dispatch. The tokens are those of 1")
  record_trace: bool = Field(
      False, description="record every rank's selections (trace_rank{d}.npz in the run "
      "directory); for memory.system=ula the summary then compares pb_lru and lru hit "
      "rates on the recorded trace")
  record_digests: bool = Field(
      False, description="record, per request and decode step, bit-exact digests of each "
      "layer group's selected positions and of each layer's entries read and attention "
      "output (digests.npz in the run directory): ula-jax compare then names the first "
      "group or layer where two runs part, not only the first token that differs")
  compilation_cache: bool = Field(
      True, description="keep compiled programs in jax's persistent compilation cache, so "
      "a second run of the same shapes compiles nothing")
  compilation_cache_dir: str | None = Field(
      None, description="folder of the persistent compilation cache; None = the folder jax is "
      "configured with (JAX_COMPILATION_CACHE_DIR), else $XDG_CACHE_HOME/ula_jax/xla "
      "(~/.cache/ula_jax/xla)")
  checkpoint_every: int = Field(
      0, ge=0, description="engine steps between checkpoints of the run (memory-system "
      "state, scheduler, metrics; the latest kept in the run directory's checkpoint/), one "
      "also at SIGINT/SIGTERM; ula-jax run --resume DIR continues from it; 0 = none")

  @field_validator("prefill_scratch", mode="before")
  @classmethod
  def _prefill_scratch(cls, v: Any) -> Any:
    what = (f"engine.prefill_scratch={v!r}: expected bytes (int) or a size with a unit "
            "(KiB, MiB, GiB, ...), e.g. '1GiB'")
    if isinstance(v, bool) or not isinstance(v, (int, str)):
      raise ValueError(what)
    try:
      nbytes = parse_size(v, field="engine.prefill_scratch", token_bytes=1)
    except ValueError:
      raise ValueError(what) from None
    if nbytes < MIN_PREFILL_SCRATCH:
      raise ValueError(f"engine.prefill_scratch={v!r}: must be at least 1MiB")
    return v

  @property
  def prefill_scratch_bytes(self) -> int:
    """``prefill_scratch`` in bytes."""
    return parse_size(self.prefill_scratch, field="engine.prefill_scratch", token_bytes=1)

  @model_validator(mode="after")
  def _checkpoints_without_trace(self) -> EngineConfig:
    for field, on, what in (("record_trace", self.record_trace, "a selection trace"),
                            ("record_digests", self.record_digests, "a run's digests")):
      if self.checkpoint_every and on:
        raise ValueError(f"engine.checkpoint_every={self.checkpoint_every} cannot be "
                         f"combined with engine.{field}=true: {what} is not checkpointed; "
                         f"set engine.checkpoint_every=0 or engine.{field}=false")
    return self


class KernelsConfig(Section):
  """Which implementation runs each hot operation. ``auto`` (the default of attention,
  indexer, fetch and resolve) is decided when an engine is built (``kernels.auto``): the
  references off a GPU, on a GPU the fastest measured for its device kind and the launch
  shapes (``kernels/auto_table.json``)."""

  attention: Literal["auto", "xla", "pallas", "mosaic"] = Field(
      "auto", description="sparse MLA attention kernel: 'mosaic' is the Pallas Mosaic GPU "
      "kernel (Hopper GPUs only; 64 heads per device, 512 + 64 wide bf16 entries); 'auto' "
      "xla off a GPU, on a GPU the fastest measured for the device and the query rows per "
      "launch")
  indexer: Literal["auto", "xla", "pallas"] = Field(
      "auto", description="indexer scores of a prefill chunk: 'xla' in column tiles, "
      "'pallas' one kernel that keeps the per-head products in registers (Triton on GPU); "
      "'auto' xla off a GPU, on a GPU the fastest measured")
  fetch: Literal["auto", "xla", "pallas", "ffi"] = Field(
      "auto", description="host->device fetch / write-back of entries (ffi = the custom "
      "call); 'auto' xla off a GPU, on a GPU the fastest measured (ffi only when installed)")
  resolve: Literal["auto", "jnp", "pallas", "pallas_fused"] = Field(
      "auto", description="the resolve stages (dedupe, hits, victims): 'pallas' as four "
      "Pallas launches per layer group, 'pallas_fused' PB-LRU's in one launch (exact LRU "
      "stays four); 'auto' jnp off a GPU, on a GPU the fastest measured for the policy")
  decode_scores: Literal["auto", "lengths", "window", "pages"] = Field(
      "auto", description="a decode step's indexer scores: 'lengths' scores each row over "
      "its own history only (rows with a request, longest first, in blocks of 8 rows and "
      "32,768 positions, loops on the device), 'window' every row of engine.max_batch over "
      "the whole max_context window, 'pages' a Pallas kernel, one program per row and two "
      "pages of keys, exiting past the row's length (no loop trip counts for the host to "
      "wait on; fp8 keys decoded in the kernel, their table outside 2-4 GiB; not ula with "
      "mesh.tp > 1; pages and keys of powers of 2 >= 16). 'auto' pages on a GPU with "
      "mesh.tp = 1 and bf16 keys (the fastest measured), else lengths where the window is "
      "longer than one block (32,768 positions), window otherwise; it follows the mesh and "
      "model, not the memory system. The same selections up to the rounding of the sums; "
      "every system of a run scores alike, so systems agree bit for bit")
  decode_topk: Literal["auto", "sort", "radix"] = Field(
      "auto", description="a decode step's top-k: 'sort' lax.top_k over the scored window "
      "(a sort on a GPU), 'radix' the radix select of the prefill (its counting passes in "
      "XLA), 'auto' radix on a GPU and sort elsewhere. Both return the same "
      "positions in ascending order, so they decode the same tokens bit for bit; only "
      "the time differs")
  resolve_fast_path: bool | Literal["auto"] = Field(
      "auto", description="a resolve whose step moves nothing (every selection on the "
      "device, room for the new tokens in free device slots) skips the full resolve for an "
      "all-hit path with identical results, chosen on device per layer group; false always "
      "runs kernels.resolve in full; 'auto' false on a GPU with a Pallas resolve (the "
      "fused resolve in every step measured faster than the fast path behind its "
      "conditional) and true elsewhere. The same tokens either way")
  fast_path_mode: Literal["cond", "speculate"] = Field(
      "cond", description="how a decode step chooses the all-hit fast path: 'cond' per layer "
      "group with lax.cond (on a GPU each one ends a CUDA graph and waits for the device); "
      "'speculate' runs the whole step on the all-hit path with no conditional and, on a dp "
      "rank where some group was not all-hit, restores the rank's state and runs the step "
      "again the plain way (after such a step, the plain way until a step moves nothing): "
      "with 'cond' where resolve_fast_path is true, with kernels.resolve in full and no "
      "conditional where it is false. Systems without a fast path ignore it")
  projections: Literal["auto", "xla", "pallas"] = Field(
      "auto", description="a decode step's products with each layer's own weights (MLA's "
      "projections, the experts' and MLPs' products, each group's indexer projections): "
      "'xla' multiplies by the weights sliced out of the stacked arrays (XLA "
      "copies every slice before the product reads it), 'pallas' a kernel that reads them "
      "in place (kernels.stacked_matmul; up to 256 rows a product: prefill chunks keep "
      "'xla', and under tensor parallelism so do the four per-head products on a rank's "
      "heads), 'auto' pallas on a GPU (measured "
      "faster) and xla elsewhere. Sums in another order: the tokens may differ from "
      "'xla''s in the last bits, every system of a run alike")
  interpret: bool | None = Field(
      None, description="run Pallas kernels in interpret mode; None = interpret on CPU only")
  deterministic: bool = Field(
      True, description="GPU: the same kernels for the same shapes in every compiled program "
      "(XLA autotuning off, deterministic reductions and scatters, no excess precision, "
      "GEMMs as library calls), so memory systems can be compared token for token; false "
      "lets XLA autotune and fuse freely")

  @property
  def uses_pallas(self) -> bool:
    """Whether a field names a Pallas implementation (``auto`` is none until resolved)."""
    return "pallas" in (self.attention, self.indexer, self.fetch, self.resolve.split("_")[0],
                        self.projections)


MAX_DRAFT = 3
"""Draft tokens a verify step checks at most (``speculative.num_draft``)."""


class SpeculativeConfig(Section):
  """Speculative decoding with the model's multi-token-prediction (MTP) drafts."""

  num_draft: int = Field(
      0, description="draft tokens per request and decode step, 0 (off) to 3: the model's "
      "MTP block drafts them, one verify step runs 1 + num_draft query rows per request "
      "(each with its own indexer top-k), greedy acceptance keeps the drafts that equal the "
      "model's own tokens; the tokens are those of num_draft=0")

  @field_validator("num_draft", mode="before")
  @classmethod
  def _num_draft(cls, v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_DRAFT:
      raise ValueError(f"speculative.num_draft={v!r}: expected 0 (off), 1, 2 or "
                       f"{MAX_DRAFT} draft tokens per decode step")
    return v

  @property
  def rows(self) -> int:
    """Query rows per request in one decode step (1 + num_draft)."""
    return 1 + self.num_draft


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def check_run_name(v: str) -> str:
  """``experiment.name`` of a run or training config, checked (it names a directory)."""
  if not _NAME.fullmatch(v):
    raise ValueError(f"experiment.name={v!r}: use letters, digits and . _ + - "
                     f"(it names a directory), starting with a letter or digit")
  return v


class ExperimentInfo(Section):
  """Names and output of one experiment (the ``experiment`` section)."""

  name: str = Field(description="experiment name (run directories are named after it)")
  description: str = Field("", description="free text, kept in the run directory")
  seed: int = Field(
      0, ge=0, description="seed of random choices outside the model and workload sections")
  out_dir: str = Field("runs", description="parent directory of run directories")
  plots: bool = Field(True, description="write PNG plots into the run directory")

  @field_validator("name")
  @classmethod
  def _name(cls, v: str) -> str:
    return check_run_name(v)


# ----------------------------------------------------------------------------------
# the whole experiment
# ----------------------------------------------------------------------------------


def _section_dict(data: dict, name: str) -> dict | None:
  value = data.get(name)
  if value is None:
    return {}
  if isinstance(value, BaseModel):
    return value.model_dump()
  return dict(value) if isinstance(value, dict) else None


def context_bucket(tokens: int, page: int) -> int:
  """``tokens`` rounded up to a page, then up to one of four page counts per doubling
  (p, 1.25p, 1.5p, 1.75p for p a power of two; every count up to 8 pages): at most 25%
  over, and workloads of similar lengths get the same context, so the same compiled
  programs (and the persistent compilation cache serves them)."""
  pages = max(1, -(-tokens // page))
  if pages > 8:
    step = 1 << (pages.bit_length() - 3)
    pages = -(-pages // step) * step
  return pages * page


def longest_request(workload: WorkloadConfig) -> int:
  """Tokens of the longest request the workload can produce (prompt + output)."""
  if workload.kind == "file":
    return max(p + o for p, o in file_lengths(workload.path))
  return workload.prompt_range[1] + workload.output_range[1]


def check_model_bools(data: Any) -> Any:
  """A config's raw ``model`` section, checked: the section is a plain pydantic model of
  the models layer, and its int and float fields get the same no-boolean check as the
  config sections (ValueError listing every such field). Returns ``data``."""
  model = data.get("model") if isinstance(data, dict) else None
  if isinstance(model, dict):
    problems = []
    for name, value in model.items():
      field = ModelConfig.model_fields.get(name)
      problem = field is not None and bool_problem(value, field.annotation)
      if problem:
        problems.append(f"model.{name}={str(value).lower()}: {problem}")
    if problems:
      raise ValueError("\n".join(problems))
  return data


class ExperimentConfig(Section):
  """A whole experiment: every section, validated together."""

  model: ModelConfig = Field(default_factory=ModelConfig)
  memory: MemoryConfig = Field(default_factory=MemoryConfig)
  mesh: MeshConfig = Field(default_factory=MeshConfig)
  workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
  engine: EngineConfig = Field(default_factory=EngineConfig)
  kernels: KernelsConfig = Field(default_factory=KernelsConfig)
  speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
  experiment: ExperimentInfo

  @model_validator(mode="before")
  @classmethod
  def _derive_max_context(cls, data: Any) -> Any:
    """Fills ``engine.max_context`` from the workload when it is unset, so the resolved
    config always states it (and the run directory records it)."""
    if not isinstance(data, dict):
      return data
    engine = _section_dict(data, "engine")
    workload = _section_dict(data, "workload")
    if engine is None or workload is None or engine.get("max_context") is not None:
      return data
    try:
      wl = WorkloadConfig.model_validate(workload)
      page = EngineConfig.model_validate({"page_size": engine.get("page_size", 64)}).page_size
    except ValueError:
      return data  # the section's own errors are reported by the main validation
    engine["max_context"] = context_bucket(longest_request(wl), page)
    return {**data, "engine": engine}

  @model_validator(mode="before")
  @classmethod
  def _model_bools(cls, data: Any) -> Any:
    return check_model_bools(data)

  @model_validator(mode="after")
  def _check_combinations(self, info: ValidationInfo) -> ExperimentConfig:
    # load_config passes the memory fields the command line set (context
    # 'memory_fields_set'); validating a dict directly counts every field it gives.
    explicit = (info.context or {}).get("memory_fields_set")
    problems = combination_problems(self) + unused_field_problems(self.memory, explicit)
    if problems:
      raise ValueError("\n".join(problems))
    return self

  @property
  def top_k(self) -> int:
    """Entries selected per request and layer group by the memory system."""
    if self.memory.system == "hisparse" and self.memory.hisparse.top_k is not None:
      return self.memory.hisparse.top_k
    return self.model.index_topk


def combination_problems(cfg: ExperimentConfig) -> list[str]:
  """Every combination of values that can never run (checked before any compute)."""
  problems: list[str] = []
  model, mem, eng, wl, mesh = cfg.model, cfg.memory, cfg.engine, cfg.workload, cfg.mesh
  top_k = cfg.top_k

  if eng.steps_per_dispatch > 1:
    bad = [(f"speculative.num_draft={cfg.speculative.num_draft}", cfg.speculative.num_draft),
           ("kernels.fast_path_mode='speculate'", cfg.kernels.fast_path_mode == "speculate"),
           ("engine.record_trace=true", eng.record_trace),
           ("engine.record_digests=true", eng.record_digests)]
    for what, on in bad:
      if on:
        problems.append(
            f"engine.steps_per_dispatch={eng.steps_per_dispatch} runs plain decode steps on "
            f"the device; it cannot be combined with {what} (use engine.steps_per_dispatch=1)")

  if eng.max_context is not None and eng.max_context % eng.page_size:
    problems.append(
        f"engine.max_context={eng.max_context} is not a multiple of engine.page_size="
        f"{eng.page_size}; use {-(-eng.max_context // eng.page_size) * eng.page_size}")

  if wl.kind == "trace" and eng.record_digests:
    problems.append("engine.record_digests=true digests what the model computes; "
                    "workload.kind='trace' runs no model: set engine.record_digests=false")

  longest = longest_request(wl)
  # A trace replay runs no model: its requests' lengths are the trace's, checked when
  # it is loaded (``workloads.trace``).
  if wl.kind != "trace" and longest > model.max_position:
    problems.append(
        f"workload: the longest request has {longest} tokens (prompt + output), beyond "
        f"model.max_position={model.max_position}; shorten the workload "
        f"(workload.prompt_len, length_scale, output_len) or raise model.max_position")

  if model.num_heads % mesh.tp:
    problems.append(
        f"mesh.tp={mesh.tp} does not divide model.num_heads={model.num_heads} "
        f"(attention heads are split over tp ranks)")

  if cfg.kernels.attention == "mosaic":
    heads = model.num_heads // mesh.tp
    got = (heads, model.kv_lora_rank, model.qk_rope_head_dim, model.kv_dtype)
    if got != (64, 512, 64, "bfloat16"):
      problems.append(
          f"kernels.attention='mosaic' takes 64 heads per device of 512 + 64 bf16 entry "
          f"columns; got model.num_heads / mesh.tp = {heads}, model.kv_lora_rank="
          f"{model.kv_lora_rank}, model.qk_rope_head_dim={model.qk_rope_head_dim}, "
          f"model.kv_dtype={model.kv_dtype!r} (use kernels.attention='pallas' or 'xla')")

  if cfg.kernels.decode_scores == "pages":
    if mem.system == "ula" and mesh.tp > 1:
      problems.append(
          f"kernels.decode_scores='pages' reads keys by logical address; ula with "
          f"mesh.tp={mesh.tp} shards them over ranks: use 'lengths', 'window' or 'auto'")
    if not pages_fit(eng.page_size, model.index_head_dim):
      problems.append(
          f"kernels.decode_scores='pages' needs engine.page_size and model.index_head_dim "
          f"powers of 2 >= 16; got {eng.page_size} and {model.index_head_dim}")

  # 'auto' takes an implementation that reads the layout (``kernels.auto``).
  layout = (layout_problem(cfg.kernels.attention, model.kv_layout)
            if cfg.kernels.attention != "auto" else None)
  if layout:
    problems.append(layout)

  if (mem.system == "hisparse" and mem.hisparse.top_k is not None
      and mem.hisparse.top_k != model.index_topk):
    # The indexer selects model.index_topk entries; a buffer sized for another count
    # would mislabel what ran.
    problems.append(
        f"memory.hisparse.top_k={mem.hisparse.top_k}: must equal model.index_topk="
        f"{model.index_topk} (or be left unset)")

  if mem.system == "hisparse" and mem.hisparse.device_buffer_size < top_k:
    problems.append(
        f"memory.hisparse.device_buffer_size={mem.hisparse.device_buffer_size} is smaller "
        f"than top-k={top_k} (memory.hisparse.top_k or model.index_topk): a request's "
        f"buffer must hold its whole selection")

  if wl.selections == "synthetic":
    if wl.kind == "trace":
      problems.append("workload.selections='synthetic' ranks a live decode step's positions; "
                      "workload.kind='trace' replays recorded selections without the model "
                      "(use workload.selections='model')")
    if wl.selection_window is not None and wl.selection_window >= top_k:
      problems.append(f"workload.selection_window={wl.selection_window} must be below the "
                      f"top-k ({top_k}): the window is always selected, the rest is drawn")

  spec = cfg.speculative
  rows = spec.rows  # query rows per request in one decode step
  # One decode step of a request needs the union of its rows' selections and their new
  # tokens on the device at once: up to rows x (top-k + 1) entries.
  per_request = rows * (top_k + 1)
  if (mem.system == "hisparse" and spec.num_draft
      and mem.hisparse.device_buffer_size + 1 < per_request):
    problems.append(
        f"memory.hisparse.device_buffer_size={mem.hisparse.device_buffer_size}: with "
        f"speculative.num_draft={spec.num_draft} a request's buffer (device_buffer_size + 1 "
        f"slots) must hold one verify step's entries, (1 + num_draft) x (top-k + 1) = "
        f"{rows} x ({top_k} + 1) = {per_request}; use memory.hisparse.device_buffer_size >= "
        f"{per_request - 1}")
  if spec.num_draft:
    clash = {"workload.kind": (wl.kind == "trace", "'trace' replays selections without "
                               "the model"),
             "engine.record_trace": (eng.record_trace, "true records one selection per "
                                     "request and step"),
             "engine.record_digests": (eng.record_digests, "true digests plain decode "
                                       "steps, one token per request"),
             "kernels.fast_path_mode": (cfg.kernels.fast_path_mode == "speculate",
                                        "'speculate' re-runs plain decode steps")}
    for name, (bad, why) in clash.items():
      if bad:
        problems.append(f"speculative.num_draft={spec.num_draft} cannot be combined with "
                        f"{name}: {why}; set speculative.num_draft=0 or change {name}")

  if mem.system == "ula":
    step = cfg.engine.max_batch * per_request
    need = (f"engine.max_batch * (top-k + 1) = {cfg.engine.max_batch} * ({top_k} + 1) = "
            f"{step}" if rows == 1 else
            f"engine.max_batch * (1 + speculative.num_draft) * (top-k + 1) = "
            f"{cfg.engine.max_batch} * {rows} * ({top_k} + 1) = {step}")
    short = (f"engine.max_batch * (top-k + 1) = {step}" if rows == 1 else
             f"engine.max_batch * (1 + speculative.num_draft) * (top-k + 1) = {step}")
    if mem.device_pool is not None and mesh.tp == 1:
      tokens = parse_size(mem.device_pool, field="memory.device_pool",
                          token_bytes=model.kv_geometry().token_bytes)
      if tokens < step:
        problems.append(
            f"memory.device_pool={mem.device_pool!r} holds {tokens} tokens per device, "
            f"fewer than one decode step needs on the device: {need} "
            f"(model.index_topk={top_k})")
    if mesh.tp > 1:
      if mem.layout == "replicated":
        problems.append(
            "memory.layout='replicated' is resident's TP layout (a full copy per rank); "
            "for memory.system=ula use 'mod', 'block' or 'request', or set "
            "memory.system=resident")
      if mem.local_buffer is not None and mem.local_buffer < step:
        problems.append(
            f"memory.local_buffer={mem.local_buffer} is smaller than one decode step's "
            f"selection: {short} (model.index_topk={top_k})")

  return problems


MEMORY_FIELD_USERS: dict[str, tuple[str, ...]] = {
    "host_pool": ("ula", "hisparse"),
    "policy": ("ula",),
    "pb_lru_buckets": ("ula",),
    "host_layout": ("ula",),
    "host_alloc": ("ula", "hisparse", "far_tier"),
    "layout": ("ula",),
    "local_buffer": ("ula",),
    "index_scoring": ("ula",),
    "hisparse": ("hisparse",),
    "far_tier": ("far_tier",),
}
"""The memory systems that read each memory field; ``system`` and ``device_pool`` are read
by every system."""


def memory_fields_set(mem: MemoryConfig) -> set[str]:
  """Dotted names (below ``memory``) of the fields ``mem`` was given explicitly."""
  out = set()
  for name in mem.model_fields_set:
    sub = getattr(mem, name)
    if isinstance(sub, BaseModel):
      out |= {f"{name}.{f}" for f in sub.model_fields_set}
    else:
      out.add(name)
  return out


def unused_field_problems(mem: MemoryConfig, explicit: set[str] | None = None) -> list[str]:
  """A problem per memory field set explicitly (``explicit``: dotted names below
  ``memory``; None = ``mem``'s own fields set) to a value other than its default that
  ``memory.system`` never reads: the run would silently ignore it.

  Defaults never count, so a building block of one system that states its defaults
  still composes with another ``memory.system``. ``memory.layout='replicated'`` names
  what resident does on tp > 1, so resident accepts it."""
  explicit = memory_fields_set(mem) if explicit is None else explicit
  problems = []
  for path in sorted(explicit):
    users = MEMORY_FIELD_USERS.get(path.split(".")[0])
    if users is None or mem.system in users:
      continue
    owner, value = mem, mem
    for part in path.split("."):
      if not isinstance(value, BaseModel) or part not in type(value).model_fields:
        break  # not a field (schema errors report it)
      owner, value = value, getattr(value, part)
    else:
      if isinstance(value, BaseModel):
        continue  # a whole section: its fields are listed one by one
      default = type(owner).model_fields[path.split(".")[-1]].get_default(
          call_default_factory=True)
      if value == default or (path == "layout" and value == "replicated"
                              and mem.system == "resident"):
        continue
      problems.append(
          f"memory.{path}={_plain(value)!r} is not used by memory.system={mem.system!r} "
          f"(only by {' and '.join(users)}); remove it, or set memory.system="
          f"{users[0]} to use it")
  return problems
