"""What a Pallas (Triton) kernel becomes on a Hopper GPU, read on any machine.

``triton_kernels(text)`` takes the text of a module lowered for CUDA
(``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()``, which works
on a CPU-only machine too) and returns each Pallas kernel's Triton IR and launch
(warps, pipelining stages). ``sm90_report(kernel)`` compiles that IR for ``sm_90a`` with
the ``triton`` package (``pip install triton``; its wheel carries ``ptxas`` and
``cuobjdump``) and reads what decides a kernel's speed before it ever runs: shared memory
per program, registers and spills per thread, and the shape of its main loop (async row
copies, global loads, how many copy groups a wait leaves in flight, tensor-core
instructions, spill instructions).

The GPU's jax compiles the same IR with the Triton bundled in its XLA, not with the
``triton`` package: the report is what that Triton version makes of the kernel (use the
release closest to the GPU's jax: 3.6 for jax 0.11), a guide to the GPU's binary, not
the binary itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  """One Pallas kernel of a lowered module: its Triton IR (text) and launch."""

  name: str
  ir: str
  num_warps: int
  num_stages: int


def _field(body: str, key: str) -> int | None:
  m = re.search(rf"{key} = (\d+)", body)
  return int(m.group(1)) if m else None


def triton_kernels(lowered_text: str) -> dict[str, TritonKernel]:
  """Every Pallas (Triton) kernel of a lowered module's text: ``{name: TritonKernel}``."""
  # jax has no public way to print the Triton IR it embeds (as bytecode) in its custom
  # calls; jaxlib's own MLIR bindings with its Triton dialect read it back.
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt

  out = {}
  # One custom call's backend config: {... ir = "<bytecode>", name = "...", num_stages
  # = .., num_warps = ..} with its fields in either order around the bytecode.
  for m in re.finditer(r"backend_config = \{([^{}]*?ir = \"(?:[^\"\\]|\\.)*\"[^{}]*)\}",
                       lowered_text):
    body = m.group(1)
    name = re.search(r'name = "([^"]+)"', body)
    raw = re.search(r'ir = "((?:[^"\\]|\\.)*)"', body)
    if not (name and raw):
      continue
    data = re.sub(rb"\\([0-9A-Fa-f]{2})", lambda h: bytes([int(h.group(1), 16)]),
                  raw.group(1).encode("latin1"))
    data = data.replace(b'\\"', b'"').replace(b"\\\\", b"\\")
    with ir.Context() as ctx:
      tt.register_dialect(ctx)
      ctx.allow_unregistered_dialects = True
      text = str(ir.Module.parse(data))
    rest = body[:raw.start()] + body[raw.end():]
    out[name.group(1)] = TritonKernel(name.group(1), text, _field(rest, "num_warps") or 4,
                                      _field(rest, "num_stages") or 1)
  return out


def lowered_kernels(fn, *args) -> dict[str, TritonKernel]:
  """``triton_kernels`` of ``jax.jit(fn)`` lowered for CUDA on ``args`` (arrays or
  ``jax.ShapeDtypeStruct``s); works on a CPU-only machine."""
  import jax

  from ula_jax.core.compat import lower_for

  return triton_kernels(lower_for(jax.jit(fn).trace(*args)).as_text())


def triton_kernels_ir(lowered_text: str) -> dict[str, str]:
  """``{kernel name: Triton IR text}`` of a lowered module (see ``triton_kernels``)."""
  return {name: k.ir for name, k in triton_kernels(lowered_text).items()}


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """What ``sm90_report`` read off a kernel compiled for ``sm_90a``.

  shared_bytes:      shared memory per program (Triton's allocation)
  registers:         registers per thread (ptxas); 255 is the cap
  spill_stores / spill_loads: bytes per thread spilled to local memory (ptxas)
  loop_instructions: SASS instructions of the main loop (the longest backward branch)
  loop_spills:       local-memory loads and stores in it (LDL / STL)
  loop_async_copies: asynchronous global-to-shared copies in it (LDGSTS)
  loop_loads:        plain global loads in it (LDG)
  loop_waits:        the copy-group waits in it, as groups left in flight (a wait that
                     leaves 0 waits for every copy issued so far)
  loop_mma:          tensor-core instructions in it by shape ({'HGMMA.64x32x16': 72})
  triton_version:    the ``triton`` package that compiled it
  """

  name: str
  num_warps: int
  num_stages: int
  shared_bytes: int
  registers: int
  spill_stores: int
  spill_loads: int
  loop_instructions: int
  loop_spills: int
  loop_async_copies: int
  loop_loads: int
  loop_waits: tuple[int, ...]
  loop_mma: dict
  triton_version: str

  def programs_per_sm(self, smem_per_sm: int = 227 * 1024, regs_per_sm: int = 65536,
                      warps_per_sm: int = 64, blocks_per_sm: int = 32) -> int:
    """Programs that fit on one H100/H200 SM at once: the least of what its shared
    memory, its registers (allocated in 8s per thread), its warp slots and its block
    slots allow."""
    threads = 32 * self.num_warps
    by_regs = regs_per_sm // (threads * max(8, -(-self.registers // 8) * 8))
    by_smem = smem_per_sm // self.shared_bytes if self.shared_bytes else blocks_per_sm
    return min(by_regs, by_smem, warps_per_sm // self.num_warps, blocks_per_sm)


def _tool(triton_dir: str, name: str) -> str:
  path = os.path.join(triton_dir, "backends", "nvidia", "bin", name)
  if not os.path.exists(path):
    raise RuntimeError(f"{path} is missing: this triton wheel carries no {name}")
  return path


def _ptxas(triton_dir: str) -> str:
  """The ptxas Triton itself runs for sm_90 (its wheels carry two; newer releases emit
  PTX that only the newer one reads)."""
  try:
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(90).path
  except (ImportError, AttributeError, TypeError):
    return _tool(triton_dir, "ptxas")


def main_loop(sass: str) -> list[str]:
  """The instructions of the longest loop of one kernel's SASS (the span of its longest
  backward branch), one string per instruction; [] when it has none."""
  lines = [ln.split(";")[0].strip() for ln in sass.splitlines()]
  at = {}
  for i, ln in enumerate(lines):
    m = re.match(r"/\*([0-9a-f]{4,})\*/", ln)
    if m:
      at[int(m.group(1), 16)] = i
  best = None
  for i, ln in enumerate(lines):
    m, here = re.search(r"BRA (0x[0-9a-f]+)", ln), re.match(r"/\*([0-9a-f]{4,})\*/", ln)
    if m and here:
      target = int(m.group(1), 16)
      if target < int(here.group(1), 16) and target in at:
        if best is None or i - at[target] > best[1] - best[0]:
          best = (at[target], i)
  if best is None:
    return []
  return [ln for ln in lines[best[0]:best[1] + 1] if re.match(r"/\*[0-9a-f]{4,}\*/", ln)]


def loop_summary(loop: list[str]) -> dict:
  """Counts over a loop's instructions (``main_loop``): spills, async copies, plain
  global loads, copy-group waits (groups left in flight) and tensor-core shapes."""
  text = "\n".join(loop)
  mma: dict[str, int] = {}
  for m in re.finditer(r"\b(HGMMA\.\w+|HMMA\.\w+)", text):
    mma[m.group(1)] = mma.get(m.group(1), 0) + 1
  return dict(loop_instructions=len(loop),
              loop_spills=len(re.findall(r"\b(?:LDL|STL)\b", text)),
              loop_async_copies=len(re.findall(r"\bLDGSTS\b", text)),
              loop_loads=len(re.findall(r"\bLDG\.", text)),
              loop_waits=tuple(int(x, 16) for x in
                               re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", text)),
              loop_mma=mma)


def sm90_report(kernel: TritonKernel) -> KernelReport:
  """Compiles ``kernel`` for ``sm_90a`` with the ``triton`` package and reports its
  resources and main loop (``KernelReport``). Needs no GPU."""
  try:
    import triton
    from triton.backends.compiler import GPUTarget
  except ImportError as e:
    raise RuntimeError("sm90_report needs the triton package (pip install triton; the "
                       "version the GPU's jax bundles, e.g. 3.6 for jax 0.11)") from e
  triton_dir = os.path.dirname(triton.__file__)
  # jaxlib's MLIR prints a CTA barrier (``debug_barrier``) with a property that older
  # MLIR releases (Triton 3.6's) do not parse; the plain op is the same barrier.
  ir = re.sub(r'"gpu\.barrier"\(\) <[^>]*> : \(\) -> \(\)', "gpu.barrier", kernel.ir)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, f"{kernel.name}.ttir")
    with open(path, "w") as f:
      f.write(ir)
    compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=kernel.num_warps,
                                           num_stages=kernel.num_stages))
    ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
    with open(ptx, "w") as f:
      f.write(compiled.asm["ptx"])
    with open(cubin, "wb") as f:
      f.write(compiled.asm["cubin"])
    usage = subprocess.run([_ptxas(triton_dir), "-arch=sm_90a", "-v", ptx, "-o",
                            os.path.join(tmp, "v.cubin")], capture_output=True, text=True)
    sass = subprocess.run([_tool(triton_dir, "cuobjdump"), "--dump-sass", cubin],
                          capture_output=True, text=True, check=True).stdout
  info = usage.stderr
  regs = re.search(r"Used (\d+) registers", info)
  if usage.returncode or not regs:
    raise RuntimeError(f"ptxas failed on {kernel.name}: {info[-500:]}")
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
  return KernelReport(
      name=kernel.name, num_warps=kernel.num_warps, num_stages=kernel.num_stages,
      shared_bytes=int(compiled.metadata.shared), registers=int(regs.group(1)),
      spill_stores=int(spills.group(1)) if spills else 0,
      spill_loads=int(spills.group(2)) if spills else 0,
      triton_version=triton.__version__, **loop_summary(main_loop(sass)))


__all__ = ["KernelReport", "TritonKernel", "loop_summary", "lowered_kernels", "main_loop",
           "sm90_report", "triton_kernels", "triton_kernels_ir"]
