"""Platform probe for the GPU machine: host-memory access paths and their bandwidth.

Prints what works: the XLA host-gather path (compute_on), Pallas kernels handed
pinned_host arrays (does the compiled HLO copy the pool?), and the contiguous
host->device ceiling.
"""
import json, os, sys, time, traceback
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from jax.experimental import pallas as pl

sys.path.insert(0, os.getcwd())
from ula_jax.core import compat

out_dir = os.environ.get("OUT", "/tmp")
res = {"jax": jax.__version__, "devices": str(jax.devices())}
dev = jax.devices()[0]
host_s = SingleDeviceSharding(dev, memory_kind="pinned_host")
dev_s = SingleDeviceSharding(dev, memory_kind="device")

def timeit(f, *a, n=20):
  r = f(*a); jax.block_until_ready(r)
  t = time.perf_counter()
  for _ in range(n):
    r = f(*a)
  jax.block_until_ready(r)
  return (time.perf_counter() - t) / n, r

SH, W, N = 1 << 18, 288, 16384   # host rows of 1152 B (uint32 x 288)
host = jax.device_put(np.random.randint(0, 2**31, (SH, W), dtype=np.int64).astype(np.uint32), host_s)
idx = jax.device_put(np.random.permutation(SH)[:N].astype(np.int32), dev_s)
nbytes = N * W * 4

# ceiling: contiguous host->device of the same bytes
src = jax.device_put(np.ones((N, W), np.uint32), host_s)
t, _ = timeit(lambda x: jax.device_put(x, dev_s), src)
res["h2d_contig_GBps"] = nbytes / t / 1e9
t, _ = timeit(lambda x: jax.device_put(x, host_s), jax.device_put(np.ones((N, W), np.uint32), dev_s))
res["d2h_contig_GBps"] = nbytes / t / 1e9

# XLA path: host gather under compute_on, then to device
try:
  f = jax.jit(lambda h, i: compat.to_device(compat.on_host(lambda h, i: h[i], h, compat.to_host(i))))
  t, r = timeit(f, host, idx)
  ok = bool((np.asarray(r) == np.asarray(host)[np.asarray(idx)]).all())
  res["xla_fetch"] = {"GBps": nbytes / t / 1e9, "ok": ok}
except Exception as e:
  res["xla_fetch"] = {"error": repr(e)[:600]}

# Pallas (default GPU lowering) gather reading a pinned_host array directly
def gather_kernel(idx_ref, src_ref, out_ref):
  i = pl.program_id(0)
  r = idx_ref[i]
  out_ref[pl.ds(i, 1), :] = src_ref[pl.ds(r, 1), :]

for name, w in [("w288", W), ("w256", 256)]:
  try:
    h2 = host if w == W else jax.device_put(np.asarray(host)[:, :w], host_s)
    call = lambda i, h: pl.pallas_call(gather_kernel, out_shape=jax.ShapeDtypeStruct((i.shape[0], h.shape[1]), h.dtype),
                                       grid=(i.shape[0],))(i, h)
    f = jax.jit(call)
    hlo = f.lower(idx, h2).compile().as_text()
    t, r = timeit(f, idx, h2)
    ok = bool((np.asarray(r) == np.asarray(h2)[np.asarray(idx)]).all())
    copies = [l for l in hlo.splitlines() if ("copy" in l or "memcpy" in l.lower() or "S(5)" in l) and "=" in l][:8]
    res[f"pallas_fetch_{name}"] = {"GBps": N * w * 4 / t / 1e9, "ok": ok, "hlo_copy_lines": copies}
    with open(os.path.join(out_dir, f"pallas_{name}.hlo.txt"), "w") as fh:
      fh.write(hlo)
  except Exception as e:
    res[f"pallas_fetch_{name}"] = {"error": traceback.format_exc()[-1500:]}

print(json.dumps(res, indent=1))
with open(os.path.join(out_dir, "probe.json"), "w") as fh:
  json.dump(res, fh, indent=1)
