"""Checkpointing large pools on one GPU: shard files (``core.shard_files``) against orbax.

Makes a ``pinned_host`` pool of ``--host-gib`` GiB (``memory.host_alloc`` as given) and a
device pool of ``--device-gib`` GiB, both of random rows, then for each method in
``--methods``:

* ``files``: ``shard_files.save`` of both into ``--dir``, then ``restore`` into fresh
  pools (the host one in place);
* ``orbax``: ``StandardCheckpointHandler`` save and restore of the same two arrays.

Each reports seconds and GB/s of the save and of the restore (which makes the new pools:
the files' restore fills pools made as a resumed run makes them, orbax's makes its own),
and the extra resident memory of the process while each ran (``VmHWM`` after
``clear_refs`` against ``VmRSS`` before; a restore's includes its new host pool), and
checks the restored arrays equal
the saved ones (a digest of every 64th row on the device). The folder is removed after
each method (the disk holds one checkpoint at a time).

    python benchmarks/probes/gpu_checkpoint_pools.py --host-gib 24 --device-gib 16 \\
        --dir /tmp/ckpt [--methods files,orbax] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ula_jax.core import pinned_region, shard_files
from ula_jax.memory.base import device_zeros, host_zeros

W = 1152  # bytes of a bf16 GLM-5 entry


def _status(key: str) -> int:
  for line in open("/proc/self/status"):
    if line.startswith(key + ":"):
      return int(line.split()[1]) << 10
  raise KeyError(key)


def _peak_extra(fn):
  """(fn's result, seconds, bytes of resident memory above the start while it ran)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to VmRSS
  rss0 = _status("VmRSS")
  t0 = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return out, time.perf_counter() - t0, _status("VmHWM") - rss0


@jax.jit
def _digest(x):
  rows = x.reshape(-1, x.shape[-1])[::64].astype(jnp.uint32)
  return jnp.sum(rows * (jnp.arange(rows.shape[1], dtype=jnp.uint32) + 1)), jnp.sum(rows ** 2)


def _digest_host(x):
  # the host pool's digest on the device, a chunk at a time
  dev = jax.devices()[0]
  view = shard_files._bytes_view(x.addressable_shards[0].data).reshape(-1, W)
  acc = np.zeros(2, np.uint64)
  for lo in range(0, view.shape[0], 1 << 20):
    a, b = _digest(jax.device_put(view[lo:lo + (1 << 20)], dev))
    acc += np.array([int(a), int(b)], np.uint64)
  return tuple(int(v) for v in acc)


def _fill_random(x, seed):
  """Random bytes into every row of ``x`` (host: through its bytes; device: a chunk of
  rows at a time, donated)."""
  if x.sharding.memory_kind == "pinned_host":
    view = shard_files._bytes_view(x.addressable_shards[0].data)
    rng = np.random.default_rng(seed)
    step = 256 << 20
    for lo in range(0, view.size, step):
      n = min(step, view.size - lo)
      view[lo:lo + n] = rng.integers(0, 256, n, dtype=np.uint8)
    return x
  rows = min(x.shape[1], 1 << 18)
  put = jax.jit(lambda x, lo: jax.lax.dynamic_update_slice_in_dim(
      x, jax.random.bits(jax.random.fold_in(jax.random.key(seed), lo), (1, rows, x.shape[2]),
                         jnp.uint8), lo, 1), donate_argnums=0)
  for lo in range(0, x.shape[1], rows):
    x = put(x, min(lo, x.shape[1] - rows))
  return x


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--host-gib", type=float, default=24)
  ap.add_argument("--device-gib", type=float, default=16)
  ap.add_argument("--dir", default="/tmp/ckpt_pools")
  ap.add_argument("--methods", default="files,orbax")
  ap.add_argument("--host-alloc", default="auto")
  ap.add_argument("--json")
  args = ap.parse_args()
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "tp"))
  host_rows = int(args.host_gib * (1 << 30)) // W
  dev_rows = int(args.device_gib * (1 << 30)) // W

  def make():
    h = host_zeros(mesh, (1, host_rows, W), jnp.uint8, args.host_alloc)
    d = device_zeros(mesh, (1, dev_rows, W), jnp.uint8, "device")
    return h, d

  t0 = time.perf_counter()
  host, dev = make()
  host, dev = _fill_random(host, 1), _fill_random(dev, 2)
  jax.block_until_ready((host, dev))
  print(f"pools made and filled in {time.perf_counter() - t0:.1f} s; host on a region: "
        f"{pinned_region.holds(host)}", flush=True)
  want = (_digest_host(host), tuple(int(v) for v in _digest(dev)))
  nbytes = (host_rows + dev_rows) * W
  rows = []
  for method in args.methods.split(","):
    folder = Path(args.dir) / method
    shutil.rmtree(folder, ignore_errors=True)
    if method == "files":
      docs, t_save, ram_save = _peak_extra(lambda: (
          shard_files.save(host, folder / "host"), shard_files.save(dev, folder / "dev")))

      def restore():  # a resumed run's pools are made, then filled
        fresh_h, fresh_d = make()
        return (shard_files.restore(fresh_h, folder / "host", docs[0]),
                shard_files.restore(fresh_d, folder / "dev", docs[1]))
    elif method == "orbax":
      import orbax.checkpoint as ocp
      ckpt = ocp.Checkpointer(ocp.StandardCheckpointHandler())
      _, t_save, ram_save = _peak_extra(lambda: ckpt.save(
          folder, args=ocp.args.StandardSave({"host": host, "dev": dev})) or 0)
      abstract = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                  for k, x in (("host", host), ("dev", dev))}

      def restore():
        out = ckpt.restore(folder, args=ocp.args.StandardRestore(abstract))
        return out["host"], out["dev"]
    else:
      raise SystemExit(f"--methods: {method!r} is not files or orbax")
    (rh, rd), t_restore, ram_restore = _peak_extra(restore)
    got = (_digest_host(rh), tuple(int(v) for v in _digest(rd)))
    row = {"method": method, "gib": nbytes / (1 << 30), "save_s": t_save,
           "save_gb_s": nbytes / t_save / 1e9, "save_extra_ram_gib": ram_save / (1 << 30),
           "restore_s": t_restore, "restore_gb_s": nbytes / t_restore / 1e9,
           "restore_extra_ram_gib": ram_restore / (1 << 30), "equal": got == want,
           "restored_host_on_region": pinned_region.holds(rh)}
    rows.append(row)
    print(json.dumps(row), flush=True)
    del rh, rd
    shutil.rmtree(folder, ignore_errors=True)
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1))
  print(f"\n{'method':8s} {'GiB':>6s} {'save s':>7s} {'GB/s':>6s} {'+RAM GiB':>9s} "
        f"{'restore s':>9s} {'GB/s':>6s} {'+RAM GiB':>9s} equal")
  for r in rows:
    print(f"{r['method']:8s} {r['gib']:6.1f} {r['save_s']:7.1f} {r['save_gb_s']:6.2f} "
          f"{r['save_extra_ram_gib']:9.2f} {r['restore_s']:9.1f} {r['restore_gb_s']:6.2f} "
          f"{r['restore_extra_ram_gib']:9.2f} {r['equal']}")


if __name__ == "__main__":
  main()
