"""Capacity: admitted requests against context length, every system, equal budgets.

For each context length and system, the most requests of that many tokens the engine
admits at once (``bench.serving.capacity``: the engine's admission rule, whole context
in free logical pages of a dp rank and a free decode row, applied to the system's
sizing; no arrays). At ``fill_context`` each system is then filled to its capacity
(prompts written, one decode step, replayed through the system from a synthetic trace:
``common.fill_report``), and its capacity report gives the distinct fraction: distinct
entries over physical slots in use.

UlaCache's claim: with 8-way TP, MLA's latent is stored on every rank, so only 12.5%
of the KV memory holds distinct history; ula stores each entry once and admits about
8x the requests.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from ula_jax.experiments.base import AnchorPoint, Check, Context, Experiment, Outcome
from ula_jax.experiments.common import (LABELS, ServingParams, SystemName, fill_report,
                                        serving_args, setups)


class CapacityParams(ServingParams):
  contexts: list[int] = Field(
      default_factory=lambda: [256, 512, 1024, 2048],
      description="tokens per request (prompt + output), one point each")
  fill_context: int | None = Field(
      None, ge=2, description="context at which every system is filled to its capacity to "
      "measure its distinct fraction; None = the first of contexts")
  fill: list[SystemName] | None = Field(
      None, description="systems filled (None = all); ula_tp's fill runs its jax "
      "transitions over the tp devices, the others NumPy models")

  @field_validator("contexts")
  @classmethod
  def _contexts(cls, v: list[int]) -> list[int]:
    if not v or any(c < 2 for c in v):
      raise ValueError(f"contexts={v}: expected a non-empty list of token counts >= 2")
    return sorted(set(v))


def run(p: CapacityParams, ctx: Context) -> Outcome:
  from ula_jax.bench.serving import capacity

  from ula_jax.experiments.common import base_config

  top_k = base_config(p).model.index_topk
  sets = setups(p, top_k)
  fill_at = p.fill_context or p.contexts[0]
  contexts = sorted(set(p.contexts) | {fill_at})
  caps: dict[str, dict[int, dict]] = {name: {} for name in p.systems}
  for c in contexts:
    args = serving_args(p, context=c)
    for name, s in sets.items():
      caps[name][c] = capacity(args, s)
  # UlaCache's 8x is TP's duplication alone: ula TP and resident TP at equal device
  # memory, no host tier.
  device_only = None
  if "ula_tp" in sets and "resident_tp" in sets and sets["resident_tp"].tp > 1:
    from ula_jax.bench.serving import setup as make_setup
    s = make_setup("ula_tp", p.devices, device_budget=str(p.device_budget), host_budget="0",
                   hisparse_buffer=p.hisparse_buffer or 2 * top_k)
    device_only = capacity(serving_args(p, context=fill_at), s)
  fills: dict[str, dict] = {}
  for name, s in sets.items():
    cap = caps[name][fill_at]
    if cap["requests"] and (p.fill is None or name in p.fill):
      ctx.log(f"  filling {name} with {cap['requests']} requests of {fill_at} tokens")
      fills[name] = fill_report(p, s, context=fill_at, rows=cap["rows"],
                                requests_per_rank=cap["requests"] // s.dp)
  ref = next((n for n in ("resident_tp", "resident_dp") if n in sets), p.systems[0])
  rows = []
  for name, s in sets.items():
    for c in p.contexts:
      cap = caps[name][c]
      base = caps[ref][c]["requests"]
      f = fills.get(name) if c == fill_at else None
      rows.append({"system": name, "dp x tp": f"{s.dp}x{s.tp}", "context": c,
                   "capacity": cap["requests"], "limit": cap["limit"],
                   "rows / rank": cap["rows"], "tokens / rank": cap["tokens_per_rank"],
                   f"x {ref}": cap["requests"] / base if base else None,
                   "distinct fraction": f["distinct_fraction"] if f else None})
  data = {"capacity": {n: {str(c): v for c, v in d.items()} for n, d in caps.items()},
          "fill": fills, "fill_context": fill_at, "reference": ref, "top_k": top_k,
          "ula_tp_device_only": device_only,
          "setups": {n: {"dp": s.dp, "tp": s.tp, "overrides": list(s.overrides)}
                     for n, s in sets.items()}}
  checks = _checks(p, sets, caps, fills, fill_at)
  anchor = _anchor(sets, caps, fills, fill_at, device_only)

  def draw(fig):
    ax1, ax2, ax3 = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.3, 1, 1]})
    for name in p.systems:
      ax1.plot(p.contexts, [caps[name][c]["requests"] or float("nan") for c in p.contexts],
               marker="o", label=LABELS[name])
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("context (tokens per request)")
    ax1.set_ylabel("requests admitted at once")
    ax1.set_title(f"{p.devices} device(s), {p.device_budget} device + {p.host_budget} host "
                  f"per device", fontsize="medium")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize="small")
    names = [n for n in p.systems if n in fills]
    ax2.bar([LABELS[n] for n in names], [fills[n]["distinct_fraction"] for n in names],
            color="tab:blue")
    for i, n in enumerate(names):
      ax2.text(i, fills[n]["distinct_fraction"] + 0.02,
               f"{fills[n]['distinct_fraction']:.3f}", ha="center", fontsize="small")
    if p.devices > 1:
      ax2.axhline(1 / p.devices, ls="--", color="gray", lw=1, label=f"1/{p.devices}")
      ax2.legend(fontsize="small", loc="upper center")
    ax2.set_ylim(0, 1.15)
    ax2.set_ylabel("distinct entries / physical slots")
    ax2.set_title(f"distinct fraction at capacity, context {fill_at}", fontsize="medium")
    ax2.tick_params(axis="x", labelsize="small", rotation=20)
    from ula_jax.experiments.base import anchor_panel
    anchor_panel(ax3, anchor)

  return Outcome(title=f"requests admitted at once, {p.devices} device(s), equal budgets",
                 columns=["system", "dp x tp", "context", "capacity", "limit",
                          "rows / rank", "tokens / rank", f"x {ref}", "distinct fraction"],
                 rows=rows, data=data, checks=checks, anchor=anchor, draw=draw,
                 notes=[f"distinct fraction measured at context {fill_at} with each system "
                        f"filled to its capacity (replayed, {', '.join(sorted({f['engine'] for f in fills.values()}))} engine)"])


def _checks(p, sets, caps, fills, fill_at) -> list[Check]:
  out = []
  if "ula_dp" in fills:
    f = fills["ula_dp"]["distinct_fraction"]
    out.append(Check("ula DP stores every entry once", f == 1.0, f"distinct fraction {f}"))
  if "resident_tp" in fills and sets["resident_tp"].tp > 1:
    tp = sets["resident_tp"].tp
    f = fills["resident_tp"]["distinct_fraction"]
    out.append(Check(f"resident TP{tp} stores 1/{tp} distinct", abs(f - 1 / tp) < 1e-12,
                     f"distinct fraction {f}, 1/{tp} = {1 / tp}"))
  for a, b in (("ula_dp", "resident_dp"), ("ula_tp", "resident_tp")):
    if a in caps and b in caps:
      worse = [c for c in p.contexts if caps[a][c]["requests"] < caps[b][c]["requests"]]
      out.append(Check(f"{a} admits at least {b}'s requests", not worse,
                       f"fewer at contexts {worse}" if worse else "at every context"))
  grows = [n for n in p.systems
           if any(caps[n][a]["requests"] < caps[n][b]["requests"]
                  for a, b in zip(p.contexts, p.contexts[1:]))]
  out.append(Check("capacity never grows with the context", not grows,
                   f"grows for {grows}" if grows else "every system"))
  # The report is taken after the first of two decode steps: each request holds its
  # prompt (context - 2 tokens) and its first new token.
  short = [n for n, f in fills.items()
           if f["distinct_total"] != f["requests_per_rank"] * (fill_at - 1) * f["groups"]]
  out.append(Check("each system held its capacity when filled", not short,
                   f"short: {short}" if short else
                   f"distinct entries = requests x {fill_at - 1} tokens x groups, every "
                   f"system"))
  return out


def _anchor(sets, caps, fills, fill_at, device_only) -> list[AnchorPoint]:
  out = []
  if "ula_tp" in caps and "resident_tp" in caps and sets["resident_tp"].tp > 1:
    tp = sets["resident_tp"].tp
    base = caps["resident_tp"][fill_at]["requests"]
    if device_only is not None:
      out.append(AnchorPoint(f"ula TP / resident TP{tp} requests, device memory only",
                             device_only["requests"] / base if base else None, 8.0,
                             "UlaCache"))
    out.append(AnchorPoint(f"ula TP / resident TP{tp} requests, with the host tier",
                           caps["ula_tp"][fill_at]["requests"] / base if base else None,
                           None, "UlaCache"))
  if "resident_tp" in fills and sets["resident_tp"].tp > 1:
    out.append(AnchorPoint(f"resident TP{sets['resident_tp'].tp} distinct fraction",
                           fills["resident_tp"]["distinct_fraction"], 0.125, "UlaCache"))
  if "ula_dp" in fills:
    out.append(AnchorPoint("ula DP distinct fraction", fills["ula_dp"]["distinct_fraction"],
                           1.0, "UlaCache"))
  if "ula_dp" in caps and "resident_dp" in caps:
    base = caps["resident_dp"][fill_at]["requests"]
    out.append(AnchorPoint("ula DP / resident DP requests",
                           caps["ula_dp"][fill_at]["requests"] / base if base else None,
                           None, "UlaCache"))
  return out


def devices(p: CapacityParams) -> tuple[str, int]:
  return p.platform, p.devices


EXPERIMENT = Experiment(
    name="capacity",
    question="How many requests of 16K-128K tokens does each memory system admit at once "
    "at equal device and host budgets, and how much of what it stores is distinct?",
    anchor="UlaCache: TP8 stores 12.5% distinct history; ula stores each entry once and "
    "admits about 8x the requests",
    params=CapacityParams, run=run, devices=devices)
