"""``kernels.*: auto``: each hot operation's implementation for the device and the launch
shapes, decided once, when an engine (or a benchmark that builds one) is built.

``resolve_kernels(kernels, device, shape)`` returns the kernels section with every
``auto`` field replaced by a concrete implementation, so nothing downstream (memory
systems, the model, the kernels) ever sees ``auto``. ``choose`` is the decision itself:

* Off a GPU (CPU or any other backend), or with ``kernels.interpret=true`` (Pallas
  interpreted, a debugging aid): the references, ``REFERENCES`` (attention ``xla``,
  indexer ``xla``, fetch ``xla``, resolve ``jnp``), so CPU results are unchanged.
* On a GPU whose ``device_kind`` (e.g. ``'NVIDIA H200'``) ``auto_table.json`` lists: per
  operation the table's ranking of the implementations measured on that device, fastest
  first, and the first one that can run here (``problem``); then ``FALLBACK``:

  - attention: the table's entry for the geometry nearest the launch's (heads per device,
    latent + rope width, top-k, kv dtype) among those measured on the launch's row layout
    (``model.kv_layout``), and in it the row range holding the launch's query rows
    (decode rows per dp rank x (1 + ``speculative.num_draft``)); fp8 rows where the
    table has no fp8 entry take ``xla`` (the Pallas kernel's fp8 form only where it was
    measured faster, ``ula-jax bench attention --kv-layout fp8``, or asked for);
    ``mosaic`` only on a Hopper GPU with 64 heads of 512 + 64 bfloat16 columns in every
    launch (a computed prefill's too) and only for ``model.kv_layout='bf16'`` rows,
    ``pallas`` only for power-of-2 widths;
  - indexer: ``pallas`` only for a power-of-2 ``model.index_head_dim`` >= 16;
  - fetch: the ranking measured at the row size nearest the model's stored entry and,
    at it, the rows per call nearest a decode step's launch (``LaunchShape.fetch_rows``;
    the ranking over every size where the entry's bytes are not known); ``ffi`` only
    when the optional ``ula_jax_ffi`` package imports with its CUDA handlers (``pip
    install ./custom_calls``), ``pallas`` only where no one-byte array of the state
    holds 2-4 GiB on a device (``wide_byte_pool``: the engine decides fetch again once
    its pools exist);
  - resolve: the ranking of ``memory.policy`` measured nearest the launch (PB-LRU: the
    nearest ring size, ``memory.pb_lru_buckets``, then the nearest batch);
    ``pallas_fused`` only for PB-LRU (exact LRU's resolve is four launches either way:
    where its ranking names ``pallas_fused`` it gets ``pallas``).

* On a GPU the table does not list: ``FALLBACK`` under the same rules (attention
  ``pallas``, indexer ``pallas``, fetch ``pallas``, resolve ``pallas``: the four
  launches, which need no grid barrier), and one logged line says so.

An explicit value is never changed, and keeps the errors it gives.

The table is built from the JSON of the kernel benchmarks by ``ula-jax bench
kernels_table``; the command that builds the shipped one (the H200's rows and the H100
80GB's) is in ``ula_jax.bench.kernels_table``'s docstring and the README's ``kernels``
section.

Another GPU gets its rows from the same benchmarks run on it (``ula-jax bench attention``,
``fetch``, ``resolve``, ``prefill``; ``benchmarks/probes/gpu_auto_table.sh`` runs them) and
that command with its files and ``--merge ula_jax/kernels/auto_table.json`` (which keeps
the devices already there).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import math
from pathlib import Path
from typing import Any

OPS = ("attention", "indexer", "fetch", "resolve")
"""The ``kernels`` fields that take ``auto``."""

IMPLS: dict[str, tuple[str, ...]] = {
    "attention": ("xla", "pallas", "mosaic"),
    "indexer": ("xla", "pallas"),
    "fetch": ("xla", "pallas", "ffi"),
    "resolve": ("jnp", "pallas", "pallas_fused"),
}
"""Each operation's concrete implementations (the values of its ``kernels`` field)."""

REFERENCES = {"attention": "xla", "indexer": "xla", "fetch": "xla", "resolve": "jnp"}
"""What ``auto`` is off a GPU: the reference implementations."""

FALLBACK: dict[str, tuple[str, ...]] = {
    "attention": ("pallas", "xla"),
    "indexer": ("pallas", "xla"),
    "fetch": ("pallas", "xla"),
    "resolve": ("pallas", "pallas_fused", "jnp"),
}
"""A GPU's choices, in order, after the table's (all of them on a GPU the table does not
list); the last is the reference, which runs everywhere."""

POLICIES = ("pb_lru", "lru")
TABLE_PATH = Path(__file__).with_name("auto_table.json")
TABLE_FORMAT = 1
GPU_BACKENDS = ("gpu", "cuda", "rocm")
# device_kind substrings of Hopper GPUs, for a device that does not report its compute
# capability (or a faked one).
_HOPPER_KINDS = ("H100", "H200", "H800", "H20")
MOSAIC_GEOMETRY = (64, 512, 64, "bfloat16")
"""(heads, latent, rope, dtype) the Mosaic GPU kernel takes (``sparse_attention.mosaic``)."""

_log = logging.getLogger(__name__)
_logged: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Device:
  """What the choice depends on of the device: jax's platform (``'cpu'``, ``'gpu'``, ...),
  ``device_kind`` and, where the device reports it, the compute capability ('9.0')."""

  backend: str
  kind: str = ""
  compute_capability: str | None = None

  @classmethod
  def of(cls, device: Any) -> Device:
    """A jax device's."""
    cc = getattr(device, "compute_capability", None)
    return cls(str(device.platform), str(getattr(device, "device_kind", "")),
               None if cc is None else str(cc))

  @property
  def gpu(self) -> bool:
    return self.backend in GPU_BACKENDS

  @property
  def hopper(self) -> bool:
    """Compute capability 9.x (sm_90a, the Mosaic GPU kernel's target)."""
    if not self.gpu:
      return False
    if self.compute_capability:
      return self.compute_capability.split(".")[0] == "9"
    return any(k in self.kind for k in _HOPPER_KINDS)


@dataclasses.dataclass(frozen=True)
class LaunchShape:
  """The launch shapes the choice depends on.

  rows: query rows per attention launch (decode rows per dp rank x (1 + num_draft))
  heads: attention heads per device of a decode step; prefill_heads: of a computed
      prefill chunk's attention (every head on every tp rank; None: no computed prefill)
  latent, rope: an entry's columns (``model.kv_lora_rank``, ``model.qk_rope_head_dim``)
  top_k: entries selected per query row; kv_dtype, kv_layout: the pool's
  index_dim: ``model.index_head_dim`` (the indexer's key width)
  policy: ``memory.policy`` ('pb_lru' or 'lru'); buckets: ``memory.pb_lru_buckets``
  row_bytes: a stored entry's bytes (the rows fetch copies; None: not known, the
      fetch ranking over every row size measured)
  wide_byte_pool: a one-byte array of the memory system's state holds 2-4 GiB on a
      device, which the Pallas row copy cannot index (``kernels.byte_offsets_overflow``)

  A decode step's fetch launches take ``fetch_rows`` rows (``rows x (top_k + 1)``, the
  most a step can move; the rows that do not move are masked) and its resolve a batch
  of ``rows``.
  """

  rows: int = 1
  heads: int = 64
  latent: int = 512
  rope: int = 64
  top_k: int = 2048
  kv_dtype: str = "bfloat16"
  kv_layout: str = "bf16"
  prefill_heads: int | None = None
  index_dim: int = 128
  policy: str = "pb_lru"
  buckets: int = 32
  row_bytes: int | None = None
  wide_byte_pool: bool = False

  @property
  def fetch_rows(self) -> int:
    return self.rows * (self.top_k + 1)


def _pow2(n: int) -> bool:
  return n >= 1 and not n & (n - 1)


def ffi_available() -> bool:
  """Whether ``ula_jax_ffi`` imports with its CUDA handlers."""
  try:
    mod = importlib.import_module("ula_jax_ffi")
  except ImportError:
    return False
  has_cuda = getattr(mod, "has_cuda", None)
  return bool(has_cuda()) if callable(has_cuda) else False


def problem(op: str, impl: str, device: Device, shape: LaunchShape, *,
            ffi: bool | None = None) -> str | None:
  """Why ``impl`` cannot run ``op`` on ``device`` at ``shape`` (None when it can).
  ffi: whether ``ula_jax_ffi`` is usable (None: ``ffi_available()``)."""
  if impl not in IMPLS.get(op, ()):
    return f"kernels.{op}={impl!r} is not an implementation"
  if impl == REFERENCES[op]:
    return None
  if not device.gpu:
    return f"{impl} runs on a GPU only"
  if op == "attention":
    if shape.kv_layout != "bf16" and impl == "mosaic":
      return f"{impl} reads model.kv_layout='bf16' rows only"
    if impl == "pallas" and not (_pow2(shape.latent) and _pow2(shape.rope)
                                 and min(shape.latent, shape.rope) >= 16):
      return "pallas needs power-of-2 latent and rope widths >= 16"
    if impl == "mosaic":
      if not device.hopper:
        return "mosaic runs on Hopper GPUs only"
      heads = {shape.heads} | ({shape.prefill_heads} - {None})
      if (heads, shape.latent, shape.rope, shape.kv_dtype) != ({64}, *MOSAIC_GEOMETRY[1:]):
        return "mosaic takes 64 heads per launch of 512 + 64 bfloat16 columns"
  if op == "indexer" and not (_pow2(shape.index_dim) and shape.index_dim >= 16):
    return "pallas needs a power-of-2 model.index_head_dim >= 16"
  if op == "fetch" and impl == "ffi" and not (ffi_available() if ffi is None else ffi):
    return "ula_jax_ffi is not installed with CUDA handlers"
  if op == "fetch" and impl == "pallas" and shape.wide_byte_pool:
    return "pallas cannot index one-byte pools of 2-4 GiB (32-bit element offsets)"
  if op == "resolve" and impl == "pallas_fused" and shape.policy != "pb_lru":
    return "pallas_fused is PB-LRU's resolve (exact LRU takes pallas)"
  return None


# ----------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------


def check_table(table: Any) -> list[str]:
  """Every problem of a table (a JSON document as ``auto_table.json``): its format,
  every ranking naming existing implementations, attention row ranges in order."""
  if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
    return [f"format: expected {TABLE_FORMAT}"]
  devices = table.get("devices")
  if not isinstance(devices, dict):
    return ["devices: expected an object keyed by device kind"]
  out: list[str] = []

  def ranking(where: str, entry: Any, op: str) -> None:
    r = entry.get("ranking") if isinstance(entry, dict) else None
    if not isinstance(r, list) or not r:
      out.append(f"{where}: expected a non-empty ranking")
      return
    bad = [i for i in r if i not in IMPLS[op]]
    if bad or len(set(r)) != len(r):
      out.append(f"{where}: ranking {r}: expected distinct names of {list(IMPLS[op])}")

  def shapes(where: str, entry: Any, op: str, fields: tuple[str, ...]) -> None:
    # An operation's per-shape rankings: each names its shape's fields and a ranking.
    found = entry.get("by_shape", []) if isinstance(entry, dict) else []
    if not isinstance(found, list):
      out.append(f"{where}.by_shape: expected a list")
      return
    for j, e in enumerate(found):
      if not (isinstance(e, dict) and all(isinstance(e.get(f), int) and e[f] >= 1
                                          for f in fields)):
        out.append(f"{where}.by_shape[{j}]: expected {', '.join(fields)} >= 1")
        continue
      if "buckets" in e and not (isinstance(e["buckets"], int) and e["buckets"] >= 1):
        out.append(f"{where}.by_shape[{j}]: expected buckets >= 1")
      ranking(f"{where}.by_shape[{j}]", e, op)

  for kind, ops in devices.items():
    if not isinstance(ops, dict):
      out.append(f"{kind}: expected an object of operations")
      continue
    unknown = sorted(set(ops) - set(OPS) - {"sources"})
    if unknown:
      out.append(f"{kind}: unknown operations {unknown}")
    for i, geo in enumerate(ops.get("attention", [])):
      where = f"{kind}.attention[{i}]"
      g = geo.get("geometry", {}) if isinstance(geo, dict) else {}
      if not all(isinstance(g.get(f), int) and g[f] >= 1
                 for f in ("heads", "latent", "rope", "top_k")):
        out.append(f"{where}.geometry: expected heads, latent, rope, top_k >= 1")
      rows = geo.get("rows") if isinstance(geo, dict) else None
      if not isinstance(rows, list) or not rows:
        out.append(f"{where}.rows: expected a non-empty list")
        continue
      lo = 1
      for j, row in enumerate(rows):
        ranking(f"{where}.rows[{j}]", row, "attention")
        hi = row.get("max") if isinstance(row, dict) else None
        if not isinstance(row, dict) or row.get("min") != lo or not (
            hi is None and j == len(rows) - 1 or isinstance(hi, int) and hi >= lo):
          out.append(f"{where}.rows[{j}]: expected min={lo} and max >= min (max null on "
                     f"the last row only)")
          break
        lo = (hi or 0) + 1
    for op in ("indexer", "fetch"):
      if op in ops:
        ranking(f"{kind}.{op}", ops[op], op)
    if "fetch" in ops:
      shapes(f"{kind}.fetch", ops["fetch"], "fetch", ("row_bytes", "entries"))
    for policy, entry in (ops.get("resolve") or {}).items():
      if policy not in POLICIES:
        out.append(f"{kind}.resolve.{policy}: expected a policy of {list(POLICIES)}")
      ranking(f"{kind}.resolve.{policy}", entry, "resolve")
      shapes(f"{kind}.resolve.{policy}", entry, "resolve", ("batch",))
  return out


def read_table(path: str | Path) -> dict:
  """The table in ``path``, checked (ValueError naming the file and its problems)."""
  try:
    table = json.loads(Path(path).read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: unreadable kernels table ({e})") from None
  problems = check_table(table)
  if problems:
    raise ValueError(f"{path}: " + "; ".join(problems))
  return table


@functools.lru_cache(maxsize=None)
def shipped_table() -> dict:
  """``auto_table.json``, the table shipped in the package (read once)."""
  return read_table(TABLE_PATH)


def _layout(entry: dict) -> str:
  """The row layout an attention entry was measured on (tables name only non-bf16 ones)."""
  return entry["geometry"].get("kv_layout", "bf16")


def _nearest_geometry(entries: list[dict], shape: LaunchShape) -> dict:
  """The attention entry measured at the geometry closest to ``shape``'s (an exact match
  when there is one)."""
  def distance(entry: dict) -> float:
    g = entry["geometry"]
    d = sum(abs(math.log2(a / b)) for a, b in ((g["heads"], shape.heads),
                                                (g["latent"] + g["rope"],
                                                 shape.latent + shape.rope),
                                                (g["top_k"], shape.top_k)))
    return d + (g.get("dtype", "bfloat16") != shape.kv_dtype)
  return min(entries, key=distance)


def table_ranking(ops: dict, op: str, shape: LaunchShape) -> list[str]:
  """A device's ranking for ``op`` at ``shape`` (empty when the table has none)."""
  if op == "attention":
    entries = [e for e in ops.get("attention") or [] if _layout(e) == shape.kv_layout]
    if not entries:
      return []
    rows = _nearest_geometry(entries, shape)["rows"]
    for row in rows:
      if row["max"] is None or shape.rows <= row["max"]:
        return list(row["ranking"])
    return list(rows[-1]["ranking"])
  entry = (ops.get("resolve") or {}).get(shape.policy, {}) if op == "resolve" else (
      ops.get(op) or {})
  nearest = _nearest_shape(entry.get("by_shape") or [], op, shape)
  return list((nearest or entry).get("ranking", []))


def _log_distance(a: int, b: int) -> float:
  return abs(math.log2(a / b))


def _nearest_shape(entries: list[dict], op: str, shape: LaunchShape) -> dict | None:
  """Of an operation's per-shape rankings (``by_shape``), the one measured nearest the
  launch (None: none applies): fetch the nearest row size, and at it the nearest rows
  per call; resolve the nearest ring (PB-LRU), and at it the nearest batch."""
  if op == "fetch" and entries and shape.row_bytes:
    return min(entries, key=lambda e: (_log_distance(e["row_bytes"], shape.row_bytes),
                                       _log_distance(e["entries"], shape.fetch_rows)))
  if op == "resolve" and entries:
    return min(entries, key=lambda e: (
        _log_distance(e["buckets"], shape.buckets) if "buckets" in e else 0.0,
        _log_distance(e["batch"], shape.rows)))
  return None


# ----------------------------------------------------------------------------------
# The choice
# ----------------------------------------------------------------------------------


def choose(device: Device, shape: LaunchShape, *, interpret: bool | None = None,
           table: dict | None = None, ffi: bool | None = None) -> dict[str, str]:
  """The implementation of each operation (``OPS``) for ``device`` and ``shape`` (the
  rules in the module docstring). interpret: ``kernels.interpret``; table: a table as
  ``auto_table.json`` (None: the shipped one); ffi: whether ``ula_jax_ffi`` is usable
  (None: ``ffi_available()``, asked only when the table ranks ``ffi`` first)."""
  if not device.gpu or interpret:
    return dict(REFERENCES)
  table = shipped_table() if table is None else table
  ops = table["devices"].get(device.kind)
  out = {}
  for op in OPS:
    ranking = table_ranking(ops, op, shape) if ops else []
    fallback = FALLBACK[op]
    if op == "attention" and shape.kv_layout != "bf16":
      fallback = (REFERENCES[op],)  # fp8 rows: only what was measured on them
    candidates = ranking + list(fallback)
    if op == "resolve" and shape.policy != "pb_lru":
      # Exact LRU's resolve is four launches in either Pallas form: it takes 'pallas'.
      candidates = ["pallas" if i == "pallas_fused" else i for i in candidates]
    candidates = list(dict.fromkeys(candidates))
    out[op] = next(i for i in candidates if problem(op, i, device, shape, ffi=ffi) is None)
  if ops is None and device.kind not in _logged:
    _logged.add(device.kind)
    if _process_index() == 0:
      _log.warning("warning: kernels: GPU %r has no measurements in %s; kernels.*=auto "
                   "takes the fallback: %s", device.kind, TABLE_PATH.name,
                   " ".join(f"{op}={out[op]}" for op in OPS))
  return out


def _process_index() -> int:
  import jax
  return jax.process_index()


def resolve_kernels(kernels: Any, device: Device, shape: LaunchShape, *,
                    table: dict | None = None, ffi: bool | None = None) -> Any:
  """``kernels`` (a ``KernelsConfig``) with every ``auto`` field replaced by ``choose``'s
  implementation; the same object when no field is ``auto``."""
  auto = [op for op in OPS if getattr(kernels, op) == "auto"]
  if not auto:
    return kernels
  choice = choose(device, shape, interpret=kernels.interpret, table=table, ffi=ffi)
  return kernels.model_copy(update={op: choice[op] for op in auto})


def concrete(kernels: Any) -> dict[str, str]:
  """The implementations a resolved ``kernels`` runs, by operation (a run's summary)."""
  return {op: getattr(kernels, op) for op in OPS}


__all__ = ["FALLBACK", "IMPLS", "OPS", "REFERENCES", "TABLE_PATH", "Device", "LaunchShape",
           "check_table", "choose", "concrete", "ffi_available", "problem", "read_table",
           "resolve_kernels", "shipped_table", "table_ranking"]
