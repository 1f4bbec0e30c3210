"""Far tier: on-demand top-k over CXL against full prefetch over RDMA (SAC), modeled.

A request of ``context`` tokens decodes ``output_tokens`` tokens on one device, its KV
in a disaggregated far pool. Per decode step the ``far_tier`` system's counters follow
its own rules (``memory/far_tier/system.py``): ``on_demand`` loads each layer's rows of
the selected entries (``min(k, context) - 1`` per layer: the new token is written, not
loaded), one dependent round trip per layer group, and writes the new token's rows
through; ``full_prefetch`` reads nothing per step but copies the whole prefix to the
device before the first step (``FarTier.prefill_traffic``: written out and read back in
bulk); ``staged_prefetch`` over RDMA, SAC's baseline, prefetches the prefix the same way
into host DRAM and loads each step's top-k from there (on demand over the DRAM link), as
an RDMA pool under HiSparse does. ``link_model.modeled_run`` turns them into time with
the link presets (DRAM, CXL, RDMA: ``LINK_PRESETS``, calibrated on SAC's latency ratios)
plus ``compute_s`` of device work per step. No CXL or RDMA hardware exists here: every
time is modeled.

Two sweeps: throughput against context (top-k fixed) and against the fraction of the
context each step reads (``k / context`` at ``fraction_context``).

SAC's claims: on-demand top-k over CXL reaches 91% of local DRAM's throughput and 2.1x
RDMA full prefetch's; CXL latency 1.04-1.64x local DRAM's, RDMA 4-19.7x.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ula_jax.experiments.base import (AnchorPoint, Check, Context, Experiment, Outcome,
                                      Params, anchor_panel)

CONFIGS = (("on_demand", "dram"), ("on_demand", "cxl"), ("on_demand", "rdma"),
           ("full_prefetch", "rdma"), ("full_prefetch", "cxl"), ("staged_prefetch", "rdma"))
LABELS = {c: f"{c[0].replace('_', ' ')} / {c[1].upper()}" for c in CONFIGS}
BASELINE = ("staged_prefetch", "rdma")
"""SAC's RDMA baseline: the whole prefix prefetched into the compute node's host DRAM
before decoding, each step's top-k then swapped in from there (HiSparse)."""


class FarTierParams(Params):
  model: str = Field("glm5", description="model preset whose KV geometry is modeled")
  kv_layout: Literal["bf16", "fp8"] = Field("fp8", description="model.kv_layout: 1152-B "
                                            "or 656-B rows (SAC measured the FP8 layout)")
  top_k: int | None = Field(None, ge=1, description="selected entries per step; None = the "
                            "model's")
  contexts: list[int] = Field(default_factory=lambda: [16384, 32768, 65536, 131072])
  fractions: list[float] = Field(
      default_factory=lambda: [1 / 64, 1 / 16, 1 / 4, 1.0],
      description="k / context at fraction_context (each step reads this share)")
  fraction_context: int = Field(131072, ge=2)
  batch: int = Field(1, ge=1, description="requests decoding together on the device")
  output_tokens: int = Field(256, ge=1, description="decode steps per request")
  compute_s: float = Field(0.02, ge=0, description="device compute seconds of one decode "
                           "step (all layers), the same for every link")
  prefill_s: float = Field(0.0, ge=0, description="device compute seconds of the prefill")
  page_size: int = Field(64, ge=1)

  @field_validator("fractions")
  @classmethod
  def _fractions(cls, v: list[float]) -> list[float]:
    if not v or any(not 0 < f <= 1 for f in v):
      raise ValueError(f"fractions={v}: expected shares of the context in (0, 1]")
    return sorted(set(v))


def geometry(p: FarTierParams):
  from ula_jax.models.config import ModelConfig
  return ModelConfig(preset=p.model, kv_layout=p.kv_layout).kv_geometry()


def _far_tier(p: FarTierParams, geo, mode: str, link: str, context: int):
  from ula_jax.config.schema import FarTierConfig, MemoryConfig
  from ula_jax.core.types import MeshInfo
  from ula_jax.memory import build_memory_system
  cfg = MemoryConfig(system="far_tier", far_tier=FarTierConfig(mode=mode, link=link))
  return build_memory_system(cfg, geo, MeshInfo(1, 1), max_batch=p.batch,
                             page_size=p.page_size, max_context=context)


def _prefill_record(p: FarTierParams, system, prompt: int) -> dict:
  """Step 0: the prompts' far traffic (``system.prefill_traffic``), no token."""
  pre = {key: int(v) for key, v in system.prefill_traffic(p.batch * prompt).items()}
  return {"step": 0, "decode_tokens": 0, "compute_s": p.prefill_s, **pre}


def _decode_records(p: FarTierParams, geo, on_demand: bool, prompt: int, k: int) -> list:
  """One record per decode step: the selected entries' rows loaded when ``on_demand``,
  the new token's rows written."""
  B, L, G = p.batch, geo.num_layers, geo.num_groups
  records = []
  for t in range(p.output_tokens):
    history = prompt + t + 1
    loads = B * max(min(k, history) - 1, 0) * L if on_demand else 0
    records.append({"step": t + 1, "decode_tokens": B, "compute_s": p.compute_s,
                    "far_read_rows": loads, "far_read_ops": loads,
                    "far_rounds": G if loads else 0, "far_write_rows": B * L,
                    "far_write_ops": B * L, "far_bulk_rows": 0, "far_bulk_ops": 0})
  return records


def model_request(p: FarTierParams, geo, mode: str, link: str, context: int, k: int) -> dict:
  """Modeled TTFT, time between tokens and throughput of ``p.batch`` requests of
  ``context`` tokens each selecting ``k`` entries per step.

  ``staged_prefetch`` (SAC's RDMA baseline) is two links in turn: the prefill and the
  prefetch of the whole prefix in bulk over ``link`` (``full_prefetch``'s traffic) into
  host DRAM, then every decode step's top-k loaded from host DRAM (``on_demand`` over
  the ``dram`` link). PCIe contention between the two and other clients' prefetches
  are not modeled."""
  prompt = context - p.output_tokens
  if prompt < 1:
    raise ValueError(f"context={context} leaves no prompt for output_tokens="
                     f"{p.output_tokens}")
  reqs = [{"arrival_step": 0, "first_token_step": 1}]
  if mode != "staged_prefetch":
    system = _far_tier(p, geo, mode, link, context)
    records = [_prefill_record(p, system, prompt),
               *_decode_records(p, geo, mode == "on_demand", prompt, k)]
    m = system.modeled(records, reqs)
    return {"throughput": m["modeled_throughput_tok_s"], "tbt_s": m["modeled_tbt_s"],
            "ttft_s": m["modeled_ttft_s"], "transfer_s": m["modeled_transfer_total_s"],
            "total_s": m["modeled_total_s"], "fraction_read": min(k, context) / context}
  far = _far_tier(p, geo, "full_prefetch", link, context)
  host = _far_tier(p, geo, "on_demand", "dram", context)
  pre = far.modeled([_prefill_record(p, far, prompt)])
  dec = host.modeled(_decode_records(p, geo, True, prompt, k))
  total = pre["modeled_total_s"] + dec["modeled_total_s"]
  tokens = p.batch * p.output_tokens
  return {"throughput": tokens / total if total > 0 else 0.0, "tbt_s": dec["modeled_tbt_s"],
          "ttft_s": pre["modeled_total_s"] + dec["modeled_step_s"][0],
          "transfer_s": pre["modeled_transfer_total_s"] + dec["modeled_transfer_total_s"],
          "total_s": total, "fraction_read": min(k, context) / context}


def run(p: FarTierParams, ctx: Context) -> Outcome:
  from ula_jax.memory.far_tier.link_model import LINK_PRESETS, REFERENCE_ROW_BYTES

  geo = geometry(p)
  k = p.top_k or geo.top_k
  by_ctx = {c: {cfg: model_request(p, geo, *cfg, c, k) for cfg in CONFIGS} for c in p.contexts}
  by_frac = {f: {cfg: model_request(p, geo, *cfg, p.fraction_context,
                                    max(1, round(f * p.fraction_context)))
                 for cfg in CONFIGS} for f in p.fractions}
  rows = []
  for c, d in by_ctx.items():
    for cfg, m in d.items():
      rows.append({"sweep": "context", "context": c, "k": k, "fraction read": m["fraction_read"],
                   "mode / link": LABELS[cfg], "tokens/s": m["throughput"],
                   "TBT ms": m["tbt_s"] * 1e3, "TTFT s": m["ttft_s"],
                   "x RDMA staged prefetch": m["throughput"] / d[BASELINE]["throughput"]})
  for f, d in by_frac.items():
    for cfg, m in d.items():
      rows.append({"sweep": "fraction", "context": p.fraction_context,
                   "k": max(1, round(f * p.fraction_context)), "fraction read": f,
                   "mode / link": LABELS[cfg], "tokens/s": m["throughput"],
                   "TBT ms": m["tbt_s"] * 1e3, "TTFT s": m["ttft_s"],
                   "x RDMA staged prefetch": m["throughput"] / d[BASELINE]["throughput"]})
  top = max(p.contexts)
  cxl, dram = by_ctx[top][("on_demand", "cxl")], by_ctx[top][("on_demand", "dram")]
  rdma = by_ctx[top][BASELINE]
  direct = by_ctx[top][("full_prefetch", "rdma")]
  links = {n: LINK_PRESETS[n] for n in ("dram", "cxl", "rdma")}
  few, many = 16, 1 << 16
  lat = {n: (links[n].read_time(few, REFERENCE_ROW_BYTES),
             links[n].read_time(many, REFERENCE_ROW_BYTES)) for n in links}
  anchor = [
      AnchorPoint(f"CXL / DRAM throughput, on demand, {top // 1024}K", cxl["throughput"]
                  / dram["throughput"], 0.91, "SAC"),
      AnchorPoint(f"CXL on demand / RDMA prefetch to host, {top // 1024}K",
                  cxl["throughput"] / rdma["throughput"], 2.1, "SAC"),
      AnchorPoint(f"CXL on demand / RDMA prefetch to the GPU, {top // 1024}K",
                  cxl["throughput"] / direct["throughput"], None, ""),
      AnchorPoint("RDMA / CXL time between tokens", rdma["tbt_s"] / cxl["tbt_s"], 1.8, "SAC"),
      AnchorPoint("RDMA / CXL TTFT", rdma["ttft_s"] / cxl["ttft_s"], 9.7, "SAC"),
      AnchorPoint(f"CXL / DRAM read latency, {few} rows", lat["cxl"][0] / lat["dram"][0],
                  1.64, "SAC"),
      AnchorPoint(f"CXL / DRAM read latency, {many} rows", lat["cxl"][1] / lat["dram"][1],
                  1.04, "SAC")]
  fr = sorted(by_frac)
  adv = [by_frac[f][("on_demand", "cxl")]["throughput"] / by_frac[f][BASELINE]["throughput"]
         for f in fr]
  checks = [
      Check("CXL on demand beats RDMA prefetch to host at the smallest fraction read",
            adv[0] > 1, f"x{adv[0]:.2f} at {fr[0]:.4f}"),
      Check("on demand's advantage shrinks as the fraction read grows",
            all(a >= b for a, b in zip(adv, adv[1:])),
            ", ".join(f"{f:.3g}: x{a:.2f}" for f, a in zip(fr, adv))),
      Check("CXL never beats local DRAM", all(
          d[("on_demand", "cxl")]["throughput"] <= d[("on_demand", "dram")]["throughput"]
          for d in list(by_ctx.values()) + list(by_frac.values())), "every point"),
      Check("the links' read latencies sit in SAC's ranges",
            1.04 - 1e-9 <= lat["cxl"][1] / lat["dram"][1] <= lat["cxl"][0] / lat["dram"][0]
            <= 1.64 + 1e-9, f"CXL {lat['cxl'][1] / lat['dram'][1]:.3f}-"
            f"{lat['cxl'][0] / lat['dram'][0]:.3f}x DRAM")]

  def draw(fig):
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for cfg in CONFIGS:
      ax1.plot(p.contexts, [by_ctx[c][cfg]["throughput"] for c in p.contexts], marker="o",
               label=LABELS[cfg], ls="-" if cfg[0] == "on_demand" else "--")
      ax2.plot(fr, [by_frac[f][cfg]["throughput"] for f in fr], marker="o",
               label=LABELS[cfg], ls="-" if cfg[0] == "on_demand" else "--")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel(f"context (top-k {k})")
    ax1.set_ylabel("modeled decode tokens/s")
    ax1.set_title(f"{p.model} ({p.kv_layout} rows), batch {p.batch}, {p.output_tokens} tokens",
                  fontsize="medium")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel(f"fraction of the context read per step (context {p.fraction_context})")
    ax2.set_title("against the fraction read", fontsize="medium")
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    ax1.set_ylim(bottom=0)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(ScalarFormatter())
    ax2.yaxis.set_minor_formatter(NullFormatter())
    for ax in (ax1, ax2):
      ax.grid(True, alpha=0.3)
    ax1.legend(fontsize="x-small")
    anchor_panel(ax3, anchor)

  return Outcome(title="far tier, modeled decode throughput",
                 columns=["sweep", "context", "k", "fraction read", "mode / link",
                          "tokens/s", "TBT ms", "TTFT s", "x RDMA staged prefetch"],
                 rows=rows, data={"by_context": _keyed(by_ctx), "by_fraction": _keyed(by_frac),
                                  "read_latency_s": lat, "row_bytes": geo.row_bytes,
                                  "layers": geo.num_layers, "groups": geo.num_groups},
                 checks=checks, anchor=anchor, draw=draw,
                 notes=[f"modeled: compute {p.compute_s * 1e3:g} ms per step plus link time "
                        f"(link_model presets); {geo.num_layers} layers of "
                        f"{geo.row_bytes}-byte rows, {geo.num_groups} selections per step"])


def _keyed(d: dict) -> dict:
  return {str(x): {f"{m}/{l}": v for (m, l), v in inner.items()} for x, inner in d.items()}


def devices(p: FarTierParams) -> tuple[str, int]:
  return "cpu", 1


EXPERIMENT = Experiment(
    name="far_tier",
    question="With the KV in a disaggregated far pool, does fetching each step's top-k on "
    "demand over CXL beat prefetching the whole prefix over RDMA, against context length "
    "and the fraction read?",
    anchor="SAC: CXL on-demand top-k reaches 91% of local DRAM's throughput and 2.1x RDMA "
    "full prefetch's; CXL latency 1.04-1.64x DRAM",
    params=FarTierParams, run=run, devices=devices)
