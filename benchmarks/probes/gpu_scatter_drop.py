"""Does a masked scatter lose real updates on this backend? ``x.at[g, where(keep, s,
S)].set(v, mode="drop")`` into an ``[G, S]`` array, the way the memory systems' tables
were written, against ``core.scatter.set_where`` (every index of a skipped entry past
its axis), on random trials, each with real updates at ``[g + 1, 0]`` next to skipped
entries ``[g, S]``. With ``--xla_gpu_deterministic_ops`` (set by ``configure_platform``,
here through ``--deterministic``) XLA orders a scatter's updates by row-major offset, and
``[g, S]`` has the offset of ``[g + 1, 0]``.

    python benchmarks/probes/gpu_scatter_drop.py [--deterministic] [--trials 200]
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--deterministic", action="store_true")
  p.add_argument("--trials", type=int, default=200)
  p.add_argument("--groups", type=int, default=20)
  p.add_argument("--slots", type=int, default=64)
  args = p.parse_args(argv)
  if args.deterministic:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_deterministic_ops=true").strip()
  import jax
  import jax.numpy as jnp
  import numpy as np

  from ula_jax.core.scatter import set_where

  G, S = args.groups, args.slots

  @jax.jit
  def both(x, gi, si, v, keep):
    old = x.at[gi, jnp.where(keep, si, S)].set(v, mode="drop")
    return old, set_where(x, (gi, si), v, keep)

  rng = np.random.default_rng(0)
  lost = {"old": 0, "set_where": 0}
  for _ in range(args.trials):
    x = np.full((G, S), -1, np.int32)
    n = G * S // 2
    flat = rng.permutation(G * S)[:n]
    gi, si = flat // S, flat % S
    keep = rng.random(n) < 0.5
    first = si == 0  # every [g, 0] written: it shares its offset with skipped [g - 1, S]
    keep |= first
    v = rng.integers(0, 1000, n).astype(np.int32)
    want = x.copy()
    want[gi[keep], si[keep]] = v[keep]
    old, new = both(*(jnp.asarray(a) for a in (x, gi, si, v, keep)))
    lost["old"] += int((np.asarray(old) != want).sum())
    lost["set_where"] += int((np.asarray(new) != want).sum())
  print(f"{jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: {args.trials} trials of [{G}, {S}]")
  print(f"elements wrong: masked by one index {lost['old']}, set_where {lost['set_where']}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
