"""What a decode step's layer stack pays to read its weights: the model's own layers
(``glm5_narrow`` shapes, ``--layers`` of them, ``--rows`` decode rows), without attention
or KV (a layer's attention output is its absorbed query), run as the engine runs them
(``lax.scan`` over stacked parameters) or unrolled (``--form unrolled``: every layer's
parameters sliced out with static indices).

A serving step's profile at GLM-5 geometry shows some 4-5 device-to-device copies a
layer (``MemcpyD2D``, 8.4 ms of a 46.6 ms step on an H100): most likely each layer's
weights copied out of the stacked arrays before the matrix products read them. This
probe times one pass over the layers, counts its copies from a profile, and sets both
against reading the weights once at the device's own copy rate (measured in the same
process). Run it once per ``XLA_FLAGS`` setting (flags must precede jax's start):

    PYTHONPATH=. XLA_FLAGS=... python benchmarks/probes/gpu_layer_weights.py \\
        --tag base --json out.json [--form scan|unrolled] [--layers 16] [--rows 64]
        [--projections xla|pallas]

``--quick``: a CPU-sized smoke run (model ``tiny``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ula_jax.bench.common import (best_and_median, device_copy_rate, environment,
                                   time_calls)
from ula_jax.bench.prefill import DEFAULT_CONFIG as GLM5_CONFIG
from ula_jax.bench.profile import device_op_events, trace_calls
from ula_jax.config import load_config
from ula_jax.models.config import ModelConfig
from ula_jax.models.transformer import Transformer, _run_layers, param_bytes

F32 = jnp.float32


def model_config(layers: int, quick: bool) -> ModelConfig:
  """``tiny`` (quick), else the GLM-5 experiment's model (``glm5_narrow``) with
  ``layers`` layers."""
  if quick:
    return ModelConfig(preset="tiny", num_layers=layers)
  return load_config(GLM5_CONFIG, [f"model.num_layers={layers}"]).model


def _select(g, layers, first, indexer, c):
  """The group's indexer query and key (what decode computes before its top-k)."""
  del g, layers
  q_i, w = indexer.query(first.h, first.c_q, c["pos"])
  key = indexer.key(first.h, c["pos"])
  acc = c["acc"] + jnp.sum(q_i.astype(F32)) + jnp.sum(w.astype(F32)) + jnp.sum(
      key.astype(F32))
  return None, {**c, "acc": acc}


def _attend(l, layer, proj, sel, c):
  """The layer's products around attention: the absorbed query stands in for the
  attention's latent output."""
  del l, sel
  o_lat = layer.attn.absorb(proj.q_nope)
  out = layer.attn.out(o_lat)
  acc = c["acc"] + jnp.sum(proj.q_rope.astype(F32)) + jnp.sum(proj.entry.astype(F32))
  return out, {**c, "acc": acc}


def scan_forward(model: Transformer, x, pos):
  x, c = _run_layers(model, x, pos, {"acc": jnp.zeros((), F32), "pos": pos},
                     select=_select, attend=_attend)
  return x, c["acc"]


def unrolled_forward(model: Transformer, x, pos):
  cfg = model.cfg
  c = {"acc": jnp.zeros((), F32), "pos": pos}
  for g in range(cfg.num_groups):
    block = model.block(g)
    layers = list(cfg.group_layers(g))
    _, c = _select(g, None, block.indexer_input(x), block.indexer, c)
    for l in layers:
      layer = model.layer(l)
      proj = layer.pre_attention(x, pos)
      out, c = _attend(l, layer, proj, None, c)
      x = layer.post_attention(x, out)
  return x, c["acc"]


def write_ops(trace_dir: str, path: str) -> None:
  """The trace's device operations: totals by (name, HLO op) where the events' args name
  one, and the args of the first copies (what each copy moves, as the trace says)."""
  ops = device_op_events(trace_dir)
  per: dict = {}
  for e in ops:
    a = e.get("args", {})
    k = (str(e.get("name", "")), str(a.get("hlo_op", a.get("long_name", ""))))
    n, us = per.get(k, (0, 0.0))
    per[k] = (n + 1, us + e["dur"])
  rows = sorted(([n, op, c, us] for (n, op), (c, us) in per.items()), key=lambda r: -r[3])
  copies = [e.get("args", {}) for e in ops if "emcpy" in str(e.get("name", ""))][:60]
  with open(path, "w") as f:
    json.dump({"by_op": rows[:400], "copy_args": copies}, f, indent=1)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tag", default="base")
  p.add_argument("--form", choices=("scan", "unrolled"), default="scan")
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--rows", type=int, default=64)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--json", default="layer_weights.json")
  p.add_argument("--projections", choices=("xla", "pallas"), default="xla",
                 help="kernels.projections: the query up-projection and output projection "
                 "read in place by kernels.stacked_matmul (pallas) or sliced (xla)")
  p.add_argument("--hlo", default=None, help="write the compiled program's HLO here")
  p.add_argument("--ops", default=None, help="write the profiled device operations here "
                 "(totals by HLO op where the trace names it; the copies' trace args)")
  p.add_argument("--quick", action="store_true")
  args = p.parse_args(argv)

  cfg = model_config(args.layers, args.quick)
  model = Transformer(cfg)
  model.use_projections(args.projections)
  graphdef, params = nnx.split(model)
  wbytes = param_bytes(cfg)
  stack_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize
                    for a in jax.tree.leaves(nnx.split(model.segments)[1]))
  fwd = scan_forward if args.form == "scan" else unrolled_forward

  @jax.jit
  def forward(params, state):
    x, pos = state
    y, acc = fwd(nnx.merge(graphdef, params), x, pos)
    return (y + (acc * 0).astype(y.dtype), pos)

  x = jax.random.normal(jax.random.key(0), (args.rows, cfg.hidden_size)).astype(cfg.dtype)
  pos = jnp.arange(args.rows, dtype=jnp.int32) + 1000
  state = (x, pos)
  step = lambda s: forward(params, s)
  if args.hlo:
    with open(args.hlo, "w") as f:
      f.write(forward.lower(params, state).compile().as_text())
  times = []
  for _ in range(args.reps):
    t, state = time_calls(step, state, min_iters=3, max_iters=200, target_s=0.2, warmup=2)
    times.append(t)
  best, median = best_and_median(times)

  prof = {}
  if jax.default_backend() == "gpu":
    with tempfile.TemporaryDirectory() as tdir:
      with jax.profiler.trace(tdir, create_perfetto_trace=True):
        # Each call waits for the last: trace_calls gives a call the device operations
        # that start between its dispatch and the next, so back-to-back calls would
        # hand most of one call's operations to the next window.
        for _ in range(4):
          state = jax.block_until_ready(step(state))
      tr = trace_calls(tdir, "forward", top=12)
      if args.ops:
        try:
          write_ops(tdir, args.ops)
        except Exception as e:  # the table is a diagnostic: the timing still counts
          print(f"--ops: {type(e).__name__}: {e}")
    calls = tr["calls"][1:] or tr["calls"]
    busy = float(np.median([c["device_busy_us"] for c in calls]))
    copies = [k for k in tr["top_kinds"] if "emcpy" in k[0]]
    prof = {"device_busy_us": busy, "top_kinds": tr["top_kinds"],
            "memcpy_per_call": float(np.median([c["memcpy"] for c in calls])),
            "memcpy_us_per_call": sum(k[2] for k in copies)}
  gpu = jax.default_backend() == "gpu"
  rate = device_copy_rate(min(4 * 2**30, max(wbytes, 2**20))) if gpu else None
  ceiling_s = stack_bytes / rate if rate else None  # the layer weights read once
  row = {"tag": args.tag, "form": args.form, "projections": args.projections,
         "layers": cfg.num_layers, "rows": args.rows,
         "layer_weight_bytes": stack_bytes, "call_s": best, "call_median_s": median,
         "copy_rate_bytes_s": rate, "read_once_s": ceiling_s,
         "ratio_to_read_once": (best / ceiling_s) if ceiling_s else None, **prof}
  doc = {"probe": "layer_weights", "environment": environment(), "row": row}
  with open(args.json, "w") as f:
    json.dump(doc, f, indent=1)
  print(f"{args.tag:>14} {args.form:>8}  {best * 1e3:8.3f} ms"
        + (f"  read-once {ceiling_s * 1e3:6.3f} ms  x{best / ceiling_s:5.2f}"
           f"  memcpy {prof['memcpy_per_call']:5.0f} ({prof['memcpy_us_per_call'] / 1e3:6.3f} ms)"
           f"  busy {prof['device_busy_us'] / 1e3:6.3f} ms" if ceiling_s else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
