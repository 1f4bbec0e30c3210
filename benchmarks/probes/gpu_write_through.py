"""Do a memory system's host and device copies of each decoded token's entry hold the bits
the model computed? GLM-5 geometry on one GPU (any config with ``--config``).

Serves ``--requests`` requests of ``--prompt`` tokens with ``engine.record_digests``, then
reads back, for every decoded token of every request and every layer, the row of the
system's host pool at the token's address (``hisparse``'s write-through copy) and, where
the token still has a device slot, that row of the device pool; each row's digest is
compared with the digest of the entry as the model computed it (``digest_new``). The
host rows are read twice: by the reference row copy (host compute) and by the system's
own ``fetch_rows`` implementation, so a wrong host row and a wrong read of a right one
are told apart.

With ``--check-reads`` (``hisparse`` only) every layer of every decode step also compares,
inside the step, each device row attention reads with the host row of the address its
slot holds (the host copy is authoritative), and prints the first steps and layers where
they differ, split into entries fetched by that step and entries already there.

    python benchmarks/probes/gpu_write_through.py --json OUT.json [a.b=v ...]
"""

from __future__ import annotations

import argparse
import json
import sys

CONFIG = "experiments/glm5_summarization/config.yaml"


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--config", default=CONFIG)
  p.add_argument("--system", default="hisparse")
  p.add_argument("--requests", type=int, default=4)
  p.add_argument("--prompt", type=int, default=65536)
  p.add_argument("--output", type=int, default=8)
  p.add_argument("--json", default="write_through.json")
  p.add_argument("--check-reads", action="store_true")
  p.add_argument("--plain-scatter", action="store_true",
                 help="write rows with a scatter that does not declare its indices unique "
                      "(memory.base.set_rows otherwise does), to see whether that matters")
  args = p.parse_intermixed_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np

  from ula_jax.bench.common import environment, same_length_requests
  from ula_jax.config import load_config
  from ula_jax.core import digest
  from ula_jax.engine import Engine, resolve_max_context
  from ula_jax.kernels.fetch import fetch_rows
  from ula_jax.mesh import build_mesh, configure_platform

  cfg = load_config(args.config, [f"memory={args.system}", "engine.progress=false",
                                  "engine.record_digests=true",
                                  f"engine.max_batch={args.requests}"] + args.overrides)
  configure_platform(cfg)
  reqs = same_length_requests(args.requests, args.prompt, args.output, cfg.model.vocab_size,
                              seed=0)
  if args.plain_scatter:
    plain_scatter()
  checks: list = []
  if args.check_reads:
    watch_reads(checks)
  engine = Engine(cfg, build_mesh(cfg), max_context=resolve_max_context(cfg))
  N, S, L = engine.mem.num_logical, engine.mem.device_slots, engine.geo.num_layers
  gsize, ps = engine.geo.group_size, engine.page_size
  impl, interpret = engine.mem.fetch_impl, engine.mem.fetch_interpret

  @jax.jit
  def read(host, dev, host_rows, dev_rows):
    # host [1, L * N, W], dev [1, L * S, W]: the engine's arrays (dp = 1), never sliced
    # outside a program (that would copy a whole pool).
    n, W = host_rows.shape[0], host.shape[-1]
    scratch = jnp.zeros((n, W), host.dtype)
    idx = jnp.arange(n, dtype=jnp.int32)
    ref = fetch_rows(host.reshape(-1, W), host_rows, scratch, idx, impl="xla")
    own = fetch_rows(host.reshape(-1, W), host_rows, scratch, idx, impl=impl,
                     interpret=interpret)
    on_dev = dev[0, jnp.maximum(dev_rows, 0)]
    return tuple(digest.values_digest(x) for x in (ref, own, on_dev))

  # Each finished request is read just before its release frees its slots. Its decoded
  # token t (t >= 1; token 0 comes from the prefill) was the input of decode step t, whose
  # entry, at position prompt + t - 1, the step wrote.
  seen: dict[str, list] = {}
  release_round = engine._release_round

  def read_then_release(done):
    state = engine.state
    slot_of = np.asarray(state.slot_of)[0]  # [G, N] (dp = 1)
    layer = np.arange(L, dtype=np.int32)
    for l in done:
      out = seen[l.req.id] = []
      for t in range(1, len(l.generated)):
        pos = l.req.prompt_len + t - 1
        addr = int(l.pages[pos // ps] * ps + pos % ps)
        slot = slot_of[layer // gsize, addr]
        h_rows = jnp.asarray(layer * N + addr, jnp.int32)
        d_rows = jnp.asarray(np.where(slot >= 0, layer * S + slot, -1), jnp.int32)
        got = read(state.host_pool, state.dev_pool, h_rows, d_rows)
        out.append((t, addr, slot >= 0, *(np.asarray(x) for x in got)))
    return release_round(done)

  engine._release_round = read_then_release
  dg = engine.run(reqs).digests
  rows = []
  for rid in sorted(seen):
    sel = dg["request"] == rid
    new = dict(zip(dg["token"][sel].tolist(), dg["new"][sel]))
    for t, addr, has_slot, ref, own, on_dev in seen[rid]:
      want = new[t]
      rows.append({"request": rid, "token": t, "address": addr,
                   "host_wrong": int((ref != want).sum()),
                   "host_read_wrong": int((own != ref).sum()),
                   "device_slots": int(has_slot.sum()),
                   "device_wrong": int(((on_dev != want) & has_slot).sum()),
                   "first_host_wrong_layer": int(np.argmax(ref != want))
                   if (ref != want).any() else None})
  out = {"environment": environment(), "system": args.system, "prompt": args.prompt,
         "requests": args.requests, "output": args.output, "layers": L, "rows": rows}
  if args.check_reads:
    bad = [{"group_clock": c, "layer": layer, "wrong_per_row": wrong.tolist(),
            "of_them_fetched_this_step": fetched.tolist()}
           for c, layer, wrong, fetched in sorted(checks, key=lambda r: (r[0], r[1]))
           if wrong.any()]
    out["read_checks"] = {"layer_calls": len(checks), "wrong": bad}
    print(f"read checks: {len(checks)} layer calls, {len(bad)} with device rows that differ "
          "from their host rows")
    for b in bad[:12]:
      print(f"  group clock {b['group_clock']} layer {b['layer']}: wrong per row "
            f"{b['wrong_per_row']}, "
            f"fetched this step {b['of_them_fetched_this_step']}")
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"{'request':<8} {'token':>5} {'host wrong':>10} {'host read wrong':>15} "
        f"{'dev slots':>9} {'dev wrong':>9}  (of {L} layers)")
  for r in rows:
    print(f"{r['request']:<8} {r['token']:>5} {r['host_wrong']:>10} {r['host_read_wrong']:>15}"
          f" {r['device_slots']:>9} {r['device_wrong']:>9}")
  return 0


def plain_scatter() -> None:
  """Every memory system's ``set_rows`` without ``unique_indices`` (the probe's
  ``--plain-scatter``)."""
  import jax.numpy as jnp

  from ula_jax.memory import base, hisparse

  def set_rows(pool, rows, values):
    n = rows.shape[0]
    idx = jnp.where(rows >= 0, rows, pool.shape[0] + jnp.arange(n, dtype=rows.dtype))
    return pool.at[idx].set(values.astype(pool.dtype), mode="drop")

  base.set_rows = hisparse.set_rows = set_rows


def watch_reads(checks: list) -> None:
  """Wraps ``HiSparse.write_token`` (the call just before attention reads the layer) so
  that it compares the device rows at the resolved slots with the host rows of the
  addresses those slots hold, and appends (the group's clock, layer, wrong per batch
  row, of them fetched by this step) to ``checks`` from a host callback (in any order:
  the clock, advanced by each resolve and prefill chunk of the group, orders them)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from ula_jax.kernels.fetch import fetch_rows
  from ula_jax.memory.hisparse import HiSparse

  write_token = HiSparse.write_token

  def checked(self, state, layer, res, entry, active):
    st = write_token(self, state, layer, res, entry, active)
    S, N, (B, k) = self.device_slots, self.num_logical, res.slots.shape
    g = res.plan.group
    slot = jnp.maximum(res.slots, 0)
    addr = st.slot_addr[g, slot]  # [B, k]
    ok = res.valid & (res.slots >= 0) & (addr >= 0)
    dev = st.dev_pool[(layer * S + slot).reshape(-1)]
    host = fetch_rows(st.host_pool, (layer * N + jnp.maximum(addr, 0)).reshape(-1).astype(
        jnp.int32), jnp.zeros_like(dev), jnp.arange(B * k, dtype=jnp.int32), impl="xla")
    wrong = jnp.any(dev != host, axis=-1).reshape(B, k) & ok
    miss = res.plan.dev_idx
    fetched = jnp.zeros((S,), bool).at[jnp.where(miss >= 0, miss, S)].set(True, mode="drop")
    jax.debug.callback(
        lambda c, l, w, f: checks.append((int(c), int(l), np.asarray(w), np.asarray(f))),
        st.clock[g], layer, wrong.sum(axis=1), (wrong & fetched[slot]).sum(axis=1))
    return st

  HiSparse.write_token = checked


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
