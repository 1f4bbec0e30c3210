"""Buffer sizing: misses against HiSparse's per-request buffer and ula's shared pool.

The trained model's selections (``experiments/traces``) served on ``batch`` decode rows
(``selections.build``) and replayed through one rank of each system (the NumPy models,
which make the jax code's choices):

* ``hisparse`` with a device buffer of ``c x k`` slots per (request, layer group) for
  ``c`` in ``factors`` (plus one slot for the new token, as HiSparse sizes
  ``device_buffer_size``), the host holding every entry;
* ``ula`` DP with one device pool shared by the rank's requests of the same device
  memory (``batch x (c k + 1)`` slots per group), a host pool for the rest.

HiSparse's claim: the miss rate halves from a buffer of k to 2k and again to 4k; 2k is
far below k.
"""

from __future__ import annotations

import tempfile

from pydantic import Field, field_validator

from ula_jax.experiments.base import AnchorPoint, Check, Context, Experiment, Outcome, anchor_panel
from ula_jax.experiments.policies import TraceParams, build_trace, replay_ula


class BufferParams(TraceParams):
  batch: int = Field(4, ge=1, description="decode rows the selections are served on")
  requests: int | None = Field(None, ge=1, description="requests served; None = the "
                               "recorded ones, at least batch")
  factors: list[float] = Field(default_factory=lambda: [1, 2, 4],
                               description="buffer sizes as multiples of k")

  @field_validator("factors")
  @classmethod
  def _factors(cls, v: list[float]) -> list[float]:
    if not v or any(f < 1 for f in v):
      raise ValueError(f"factors={v}: expected multiples of k, each >= 1 (a buffer holds "
                       f"at least one selection)")
    return sorted(set(v))


def replay_hisparse(trace, *, buffer: int):
  from ula_jax.config.schema import HiSparseConfig, MemoryConfig
  from ula_jax.memory.traces.replay import build_rank_system, replay

  B = trace.max_batch
  cfg = MemoryConfig(system="hisparse", host_pool=max(trace.num_logical, trace.page_size),
                     hisparse=HiSparseConfig(device_buffer_size=buffer))
  system = build_rank_system(cfg, trace.geometry(), max_batch=B, page_size=trace.page_size,
                             max_context=max(trace.num_logical // B, 1))
  r = replay(trace, system, engine="fast", report_every=1 << 30, validate=False)
  tot = r.totals()
  looked = tot["hits"] + tot["misses"]
  return {**tot, "miss_rate": tot["misses"] / looked if looked else None,
          "device_slots": system.device_slots, "replay_s": r.seconds}


def run(p: BufferParams, ctx: Context) -> Outcome:
  sel = p.load()
  k = sel.top_k
  n = p.requests or max(p.batch, sel.num_requests)
  his, ula = {}, {}
  with tempfile.TemporaryDirectory(prefix="ula-jax-buffers-") as tmp:
    trace = build_trace(p, sel, tmp, requests=n, batch=p.batch)
    for f in p.factors:
      c = int(round(f * k))
      his[f] = replay_hisparse(trace, buffer=c)
      u = replay_ula(trace, device_pool=p.batch * (c + 1), policy="pb_lru")
      u["miss_rate"] = 1 - u["hit_rate"] if u["hit_rate"] is not None else None
      ula[f] = u
      ctx.log(f"  {_label(f)}: hisparse miss rate {his[f]['miss_rate']:.4f}, ula "
              f"{u['miss_rate']:.4f}")
    steps = trace.num_steps
  rows = []
  base = his[p.factors[0]]["miss_rate"]
  for f in p.factors:
    h, u = his[f], ula[f]
    rows.append({"buffer": _label(f), "slots / row / group": int(round(f * k)) + 1,
                 "hisparse misses": h["misses"], "hisparse miss rate": h["miss_rate"],
                 f"/ at {_label(p.factors[0])}": h["miss_rate"] / base if base else None,
                 "ula misses": u["misses"], "ula miss rate": u["miss_rate"],
                 "ula / hisparse misses": u["misses"] / h["misses"] if h["misses"] else None,
                 "misses / step (hisparse)": h["misses"] / steps})
  anchor = []
  for a, b, want in ((1, 2, 0.5), (2, 4, 0.5)):
    if a in his and b in his:
      ratio = his[b]["miss_rate"] / his[a]["miss_rate"] if his[a]["miss_rate"] else None
      anchor.append(AnchorPoint(f"HiSparse miss rate {_label(b)} / {_label(a)}", ratio, want, "HiSparse"))
  checks = []
  mono = all(his[a]["misses"] >= his[b]["misses"] for a, b in zip(p.factors, p.factors[1:]))
  checks.append(Check("HiSparse misses never grow with its buffer", mono,
                      ", ".join(f"{_label(f)}: {his[f]['misses']}" for f in p.factors)))
  mono_u = all(ula[a]["misses"] >= ula[b]["misses"] for a, b in zip(p.factors, p.factors[1:]))
  checks.append(Check("ula misses never grow with its pool", mono_u,
                      ", ".join(f"{_label(f)}: {ula[f]['misses']}" for f in p.factors)))
  same = all(his[f]["hits"] + his[f]["misses"] == his[p.factors[0]]["hits"]
             + his[p.factors[0]]["misses"] for f in p.factors)
  checks.append(Check("every size looked up the same selections", same,
                      f"{his[p.factors[0]]['hits'] + his[p.factors[0]]['misses']} lookups"))

  def draw(fig):
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.5, 1]})
    xs = [f * k for f in p.factors]
    ax1.plot(xs, [100 * his[f]["miss_rate"] for f in p.factors], marker="o",
             label="HiSparse: per-request buffer")
    ax1.plot(xs, [100 * ula[f]["miss_rate"] for f in p.factors], marker="s",
             label=f"ula: shared pool of {p.batch} x (buffer + 1)")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, [_label(f) for f in p.factors])
    ax1.set_xlabel(f"device slots per request and layer group (k = {k})")
    ax1.set_ylabel("miss rate (%)")
    ax1.set_title(f"trained-model selections, {n} requests on {p.batch} rows",
                  fontsize="medium")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize="small")
    anchor_panel(ax2, anchor)

  return Outcome(title=f"misses against device buffer size, batch {p.batch}",
                 columns=["buffer", "slots / row / group", "hisparse misses",
                          "hisparse miss rate", f"/ at {_label(p.factors[0])}", "ula misses",
                          "ula miss rate", "ula / hisparse misses",
                          "misses / step (hisparse)"],
                 rows=rows, data={"hisparse": his, "ula": ula, "top_k": k, "requests": n,
                                  "decode_steps": steps, "selections": sel.source},
                 checks=checks, anchor=anchor, draw=draw,
                 notes=[f"selections: {sel.num_requests} recorded requests (prompts "
                        f"{int(sel.prompt_len.min())}-{int(sel.prompt_len.max())} tokens) x "
                        f"{sel.num_steps} decode steps, {sel.num_groups} layer groups"])


def _label(f: float) -> str:
  return "k" if f == 1 else f"{f:g}k"


def devices(p: BufferParams) -> tuple[str, int]:
  return "cpu", 1


EXPERIMENT = Experiment(
    name="buffer_sizing",
    question="How do misses fall with HiSparse's per-request device buffer (k, 2k, 4k), "
    "and with ula's shared device pool of the same memory?",
    anchor="HiSparse: the miss rate halves from a buffer of k to 2k and again to 4k",
    params=BufferParams, run=run, devices=devices)
