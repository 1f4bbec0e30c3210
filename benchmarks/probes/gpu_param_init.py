"""How long the model's parameters take to draw at a preset's geometry, and how much
device memory the drawing holds beyond the parameters: the stacks filled one drawn
module at a time (``models.transformer._stacked``, the default) against stacking every
drawn module at the end (``--forms`` names them: ``pieces``, ``stack_all``), each
construction timed to the last parameter on the device, with the seconds XLA spent
compiling during it and the device's peak use above what the parameters hold.

    PYTHONPATH=. python benchmarks/probes/gpu_param_init.py \
        [--config experiments/glm5_summarization/config.yaml] [OVERRIDES ...] \
        [--forms pieces,stack_all] [--json OUT.json]

(the config's model; run one form a process for a clean peak).

Any platform; the peak needs a backend that reports memory statistics (a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from ula_jax.config import load_config
from ula_jax.models import transformer as tfm


def _stack_all(make, n):
  """The earlier form: every module drawn, then stacked."""
  mods = [make() for _ in range(n)]
  nnx.update(mods[0], jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(m) for m in mods]))
  return mods[0]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="experiments/glm5_summarization/config.yaml")
  p.add_argument("overrides", nargs="*", help="config overrides, e.g. model=small")
  p.add_argument("--forms", default="pieces,stack_all")
  p.add_argument("--json", default=None)
  args = p.parse_args()
  cfg = load_config(args.config, args.overrides).model
  compile_s = [0.0]
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, secs, **kw: compile_s.__setitem__(0, compile_s[0] + secs)
      if name.endswith("backend_compile_duration") else None)
  device = jax.devices()[0]
  stats = lambda: device.memory_stats() or {}
  pieces = tfm._stacked
  rows = []
  for form in args.forms.split(","):
    tfm._stacked = pieces if form == "pieces" else _stack_all
    gc.collect()
    base = stats().get("bytes_in_use", 0)
    c0, t0 = compile_s[0], time.perf_counter()
    model = tfm.Transformer(cfg, rngs=nnx.Rngs(cfg.param_seed))
    params = jax.block_until_ready(nnx.state(model))
    secs = time.perf_counter() - t0
    held = sum(x.nbytes for x in jax.tree.leaves(params))
    peak = stats().get("peak_bytes_in_use", 0)
    rows.append({"form": form, "seconds": secs, "compile_seconds": compile_s[0] - c0,
                 "params_gib": held / 2**30, "in_use_before_gib": base / 2**30,
                 "peak_gib": peak / 2**30})
    print(json.dumps(rows[-1]), flush=True)
    del model, params
  tfm._stacked = pieces
  print(f"\n{'form':<10} {'s':>7} {'compile s':>9} {'params GiB':>10} {'peak GiB':>9}")
  for r in rows:
    print(f"{r['form']:<10} {r['seconds']:7.1f} {r['compile_seconds']:9.1f} "
          f"{r['params_gib']:10.2f} {r['peak_gib']:9.2f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": args.config, "overrides": args.overrides, "device": device.device_kind,
                 "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
