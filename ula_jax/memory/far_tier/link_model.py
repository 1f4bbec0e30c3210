"""Modeled time of far-tier traffic (SAC, seed 001): links, interleaving, contention.

No CXL or RDMA hardware exists here, so the ``far_tier`` system moves its bytes
through host memory and this module turns what it moved into *modeled* time. Every
figure it produces carries ``modeled`` in its key name.

A link (``LinkSpec``) costs a transfer as::

    rounds * latency + ops * op_overhead + bytes / bandwidth

* ``rounds``: dependent round trips on the critical path (one per layer group whose
  selection is fetched on demand; one per bulk transfer batch);
* ``ops``: transfer operations the compute node issues (one per row for row-granular
  loads/stores, one per page per layer for bulk copies); costly on RDMA (a work
  request each), free on DRAM and CXL (hardware load/store);
* ``bytes``: row-granular (gathered) bytes reach ``gather_efficiency`` of the
  bandwidth, bulk bytes all of it.

Topology (``FarTopology``): each request's KV lives on one far device; far devices
are mapped to dp ranks round-robin (rank ``d`` -> far device ``d % F``), so devices
interleave over the far devices. A far device's bandwidth is shared by every compute
device mapped to it (all ``tp`` ranks of each of its dp ranks read the same rows), and
each compute device is also capped by its own port. A step is synchronous over the
mesh: its transfer time is the slowest device's.

Presets (``LINK_PRESETS``) are calibrated on rows of ``REFERENCE_ROW_BYTES`` (656 B,
the DSA FP8 layout SAC measured with DeepSeek-V3.2) against seed 001's sparse-read
latencies: CXL reads n rows in 1.64x (few rows, latency-bound) down to 1.04x (many
rows, bandwidth-bound) of local DRAM's time; RDMA in 4x (few rows) up to 19.7x (many
rows: a work request per row plus a bandwidth cap).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

# Rows SAC's latency ratios are calibrated on: one DSA FP8 entry (512 fp8 + 4 fp32 + 64 bf16).
REFERENCE_ROW_BYTES = 656

# Seed 001 (SAC, Fig. 5): sparse-read latency relative to local DRAM.
CXL_LATENCY_RATIO = (1.04, 1.64)  # many rows .. few rows
RDMA_LATENCY_RATIO = (4.0, 19.7)  # few rows .. many rows

# Per-step counters a far-tier system reports (``Resolution.stats``), summed over layer
# groups by the engine. Units: rows (one layer's row of one entry), operations, rounds.
COUNTER_KEYS = (
    "far_read_rows",  # rows loaded row by row (on-demand fetch of selected entries)
    "far_read_ops",  # load operations issued for them
    "far_rounds",  # dependent round trips on the critical path
    "far_write_rows",  # rows stored row by row (the decoded token's entry)
    "far_write_ops",
    "far_bulk_rows",  # rows moved in bulk (prefill write-out, full prefetch)
    "far_bulk_ops",  # bulk operations (one per page per layer)
)


@dataclasses.dataclass(frozen=True)
class LinkSpec:
  """One far-memory link (hashable, static).

  latency_s:          one dependent round trip (issue to data), seconds
  bandwidth_Bps:      bytes/s of one far device, shared by the devices mapped to it
  port_bandwidth_Bps: bytes/s of one compute device's own path to the far tier
  op_overhead_s:      issue cost per operation, serialised on the compute device
  gather_efficiency:  fraction of bandwidth row-granular transfers reach (0, 1]
  """

  name: str
  latency_s: float
  bandwidth_Bps: float
  port_bandwidth_Bps: float
  op_overhead_s: float = 0.0
  gather_efficiency: float = 1.0

  def __post_init__(self):
    for field in ("latency_s", "op_overhead_s"):
      if getattr(self, field) < 0:
        raise ValueError(f"link {self.name!r}: {field}={getattr(self, field)} must be >= 0")
    for field in ("bandwidth_Bps", "port_bandwidth_Bps"):
      if getattr(self, field) <= 0:
        raise ValueError(f"link {self.name!r}: {field}={getattr(self, field)} must be > 0")
    if not 0 < self.gather_efficiency <= 1:
      raise ValueError(f"link {self.name!r}: gather_efficiency={self.gather_efficiency} "
                       "must be in (0, 1]")

  def read_time(self, rows: float, row_bytes: int) -> float:
    """Modeled seconds for one device, alone on the link, to load ``rows`` scattered rows
    (one round trip, one operation per row): the quantity of SAC's latency figure."""
    if rows <= 0:
      return 0.0
    bw = min(self.bandwidth_Bps, self.port_bandwidth_Bps) * self.gather_efficiency
    return self.latency_s + rows * self.op_overhead_s + rows * row_bytes / bw


def _presets() -> dict[str, LinkSpec]:
  # Local DRAM: pinned host memory read by device threads over PCIe Gen5 x16; measured
  # here: 55.2 GB/s memcpy, and row-granular loads of 656-B rows at 0.63-0.79 of it.
  dram = LinkSpec("dram", latency_s=5e-6, bandwidth_Bps=55e9, port_bandwidth_Bps=55e9,
                  op_overhead_s=0.0, gather_efficiency=0.75)
  # CXL: load/store like DRAM; few rows cost the latency ratio, many rows the bandwidth one.
  lo, hi = CXL_LATENCY_RATIO
  cxl = LinkSpec("cxl", latency_s=hi * dram.latency_s, bandwidth_Bps=dram.bandwidth_Bps / lo,
                 port_bandwidth_Bps=dram.port_bandwidth_Bps / lo, op_overhead_s=0.0,
                 gather_efficiency=dram.gather_efficiency)
  # RDMA: a 200 Gb/s NIC (bandwidth cap) and a work request per row; the overhead makes
  # many-row reads cost RDMA_LATENCY_RATIO[1] x DRAM's per-row time.
  lo, hi = RDMA_LATENCY_RATIO
  rdma_bw = 25e9
  dram_row_s = REFERENCE_ROW_BYTES / (dram.bandwidth_Bps * dram.gather_efficiency)
  rdma = LinkSpec("rdma", latency_s=lo * dram.latency_s, bandwidth_Bps=rdma_bw,
                  port_bandwidth_Bps=rdma_bw,
                  op_overhead_s=hi * dram_row_s - REFERENCE_ROW_BYTES / rdma_bw,
                  gather_efficiency=1.0)
  return {l.name: l for l in (dram, cxl, rdma)}


LINK_PRESETS: dict[str, LinkSpec] = _presets()


def link_preset(name: str) -> LinkSpec:
  if name not in LINK_PRESETS:
    raise ValueError(f"memory.far_tier.link={name!r}: expected one of {sorted(LINK_PRESETS)}")
  return LINK_PRESETS[name]


@dataclasses.dataclass(frozen=True)
class FarTopology:
  """Which far device serves which compute device (static)."""

  dp: int
  tp: int
  num_far_devices: int

  def __post_init__(self):
    if self.num_far_devices < 1:
      raise ValueError(f"memory.far_tier.num_far_devices={self.num_far_devices}: must be >= 1")

  def far_device_of_rank(self) -> np.ndarray:
    """[dp] far device holding the KV of each dp rank's requests (round-robin)."""
    return np.arange(self.dp) % self.num_far_devices

  def sharers(self) -> np.ndarray:
    """[num_far_devices] compute devices reading from each far device."""
    return np.bincount(self.far_device_of_rank(), minlength=self.num_far_devices) * self.tp


def _per_rank(counters: Mapping[str, Any], key: str, dp: int) -> np.ndarray:
  v = np.asarray(counters.get(key, 0), np.float64)
  if v.ndim == 0:  # a total over dp ranks (what the engine records): spread evenly
    return np.full((dp,), float(v) / dp)
  if v.shape != (dp,):
    raise ValueError(f"counter {key!r} has shape {v.shape}: expected a scalar or [dp]=({dp},)")
  return v


def transfer_time(link: LinkSpec, topo: FarTopology, counters: Mapping[str, Any],
                  row_bytes: int) -> float:
  """Modeled far-tier seconds of one step.

  counters: ``COUNTER_KEYS`` -> [dp] per-rank values, or a scalar total over the dp
            ranks (spread evenly over them); every tp rank of a dp rank moves that
            rank's rows.
  row_bytes: bytes of one layer's row of one entry.
  """
  dp = topo.dp
  c = {k: _per_rank(counters, k, dp) for k in COUNTER_KEYS}
  row_b = (c["far_read_rows"] + c["far_write_rows"]) * row_bytes / link.gather_efficiency
  bulk_b = c["far_bulk_rows"] * row_bytes
  wire = row_b + bulk_b  # bandwidth-equivalent bytes per compute device
  far_of = topo.far_device_of_rank()
  far_load = np.bincount(far_of, weights=wire * topo.tp, minlength=topo.num_far_devices)
  busy = np.maximum(wire / link.port_bandwidth_Bps, far_load[far_of] / link.bandwidth_Bps)
  rounds = c["far_rounds"] + (c["far_bulk_rows"] > 0)
  ops = c["far_read_ops"] + c["far_write_ops"] + c["far_bulk_ops"]
  per_rank = rounds * link.latency_s + ops * link.op_overhead_s + busy
  return float(per_rank.max()) if dp else 0.0


def _field(record: Any, name: str) -> Any:
  """``record[name]`` of a mapping, else the attribute (e.g. a ``RequestResult``)."""
  return record[name] if isinstance(record, Mapping) else getattr(record, name)


def modeled_run(steps: Sequence[Mapping[str, Any]], link: LinkSpec, topo: FarTopology,
                row_bytes: int, requests: Sequence[Any] = ()) -> dict:
  """A run's per-step counters -> modeled step times, TTFT, TBT and throughput.

  steps:    per engine step, in order, a mapping with ``compute_s`` (device compute
            seconds of the step, measured or modeled), ``decode_tokens`` (tokens
            generated, all ranks), optional ``step`` (its number; default: position)
            and the far counters of ``COUNTER_KEYS`` ([dp] per rank or a scalar
            total, see ``transfer_time``).
  requests: records with ``arrival_step`` and ``first_token_step`` (e.g. the engine's
            ``RequestResult``s) for TTFT; records without a first token are skipped.

  The modeled step time is ``compute_s + transfer`` (far traffic is not hidden
  behind compute: on-demand fetches sit between the indexer and attention, and a
  full prefetch must finish before decode starts). TBT is the token-weighted mean
  step time of decode steps: every running request gets one token per step.
  """
  transfer = np.array([transfer_time(link, topo, s, row_bytes) for s in steps], np.float64)
  compute = np.array([float(s["compute_s"]) for s in steps], np.float64)
  tokens = np.array([float(s["decode_tokens"]) for s in steps], np.float64)
  step_s = compute + transfer
  end = np.cumsum(step_s)
  numbers = [int(s.get("step", i)) for i, s in enumerate(steps)]
  total = float(end[-1]) if len(end) else 0.0
  out = {
      "modeled_step_s": step_s.tolist(),
      "modeled_transfer_s": transfer.tolist(),
      "modeled_total_s": total,
      "modeled_transfer_total_s": float(transfer.sum()),
      "modeled_throughput_tok_s": float(tokens.sum() / total) if total > 0 else 0.0,
      "modeled_tbt_s": float((tokens * step_s).sum() / tokens.sum()) if tokens.sum() else 0.0,
  }
  ttft = []
  for r in requests:
    first, arrival = _field(r, "first_token_step"), _field(r, "arrival_step")
    if first is None:
      continue
    i_end = int(np.searchsorted(numbers, first, side="right")) - 1
    i_start = int(np.searchsorted(numbers, arrival, side="left"))
    if i_end < 0:
      continue
    start = float(end[i_start - 1]) if i_start > 0 else 0.0
    ttft.append(float(end[i_end]) - start)
  if requests:
    out["modeled_ttft_s"] = float(np.mean(ttft)) if ttft else 0.0
    out["modeled_ttft_s_per_request"] = ttft
  return out
