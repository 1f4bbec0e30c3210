"""Computed prefill of one long prompt: prompt tokens per second, and where the time goes.

``ula-jax bench prefill [--config CONFIG] [--prompt 64K] [--chunk 4096] [a.b=value ...]``
builds the config's model (default ``experiments/glm5_summarization/config.yaml``: GLM-5
geometry, ``glm5_narrow``) on one device and prefills one prompt of ``--prompt`` random
tokens in chunks of ``--chunk`` through ``models.transformer.prefill_chunk`` with the
config's ``kernels.attention``, ``kernels.indexer`` (``auto`` resolved for the device
and a chunk's rows, ``kernels.auto``) and ``engine.prefill_scratch`` (no memory system:
the model's own workspace). The chunk program is compiled first (its
seconds reported apart); the prompt then runs ``--repeats`` times and the fastest run
gives prompt tokens per second, with every chunk's seconds.

``--phases`` (on by default) times the parts of the prompt's last chunk (the longest
prefix) alone, at its shapes, beside a ceiling each (FLOPs at ``--peak-tflops``, bytes
at ``--hbm-gbps``):

* ``selection``: one layer group's ``prefix_topk`` (the chunk's rows in row blocks:
  indexer scores, then the radix top-k), and its two parts for one row block times the
  blocks (``scores``, ``top-k``), beside ``lax.top_k`` of the same block (the sort the
  radix select replaces);
* ``attention``: one layer's sparse attention, every row over its own k picks;
* ``layers``: the rest of the chunk (projections, MLPs and experts, norms), its time
  the chunk's minus the groups' selections and the layers' attention.

With ``kernels.indexer=pallas``, ``--indexer-configs`` times the scores for each
Pallas launch (``IndexerConfig`` tokens such as ``n64t256w8s3``). The phase inputs are
random; the radix top-k's picks are checked against ``lax.top_k``'s, the Pallas scores
against the jnp form's. Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import time

from ula_jax.bench.common import (environment, fmt, parse_sizes, print_table, time_calls,
                                  write_json)

DEFAULT_CONFIG = "experiments/glm5_summarization/config.yaml"


def layer_flops_per_token(m) -> dict[str, int]:
  """Matmul FLOPs per token of the model's projections (everything but attention over
  entries and the indexer's scores), by part, summed over layers and groups."""
  D, H, Q, C = m.hidden_size, m.num_heads, m.q_lora_rank, m.kv_lora_rank
  dn, dr, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
  attn = D * Q + Q * H * (dn + dr) + D * C + D * dr + H * dn * C + H * C * dv + H * dv * D
  dense = 3 * D * m.intermediate_size
  # Every expert runs on every token (models.layers.MoE), plus the router and shared ones.
  moe = D * m.num_experts + 3 * D * m.moe_intermediate_size * (m.num_experts
                                                               + m.num_shared_experts)
  moe_layers = m.num_layers - m.num_dense_layers
  index = Q * m.index_n_heads * m.index_head_dim + D * m.index_head_dim + D * m.index_n_heads
  return {"attention projections": 2 * attn * m.num_layers,
          "MLP and experts": 2 * (dense * m.num_dense_layers + moe * moe_layers),
          "indexer projections": 2 * index * m.num_groups}


def _timed(fn, *args, target_s: float, max_iters: int = 20) -> float:
  """Seconds per call of ``fn(*args)`` (compiled before timing; calls issued back to back
  on the device's stream and waited for once)."""
  import jax
  out = fn(*args)
  jax.block_until_ready(out)
  seconds, _ = time_calls(lambda _: fn(*args), out, min_iters=2, max_iters=max_iters,
                          target_s=target_s, warmup=0)
  return seconds


def run_prompt(cfg, *, prompt: int, chunk: int, repeats: int, seed: int) -> dict:
  """Builds the model and prefills one prompt (``run_prompt`` in the module docstring)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from ula_jax.mesh import interpret_kernels
  from ula_jax.models import transformer as tfm

  m = cfg.model
  t0 = time.perf_counter()
  model = tfm.Transformer(m, rngs=nnx.Rngs(m.param_seed))
  graphdef, params = nnx.split(model)
  jax.block_until_ready(params)
  init_s = time.perf_counter() - t0
  capacity = -(-prompt // chunk) * chunk
  platform = jax.devices()[0].platform
  options = dict(attention=cfg.kernels.attention, indexer=cfg.kernels.indexer,
                 scratch_bytes=cfg.engine.prefill_scratch_bytes,
                 interpret=interpret_kernels(cfg, platform))

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(params, ws, tokens, start, length):
    return tfm.prefill_chunk(nnx.merge(graphdef, params), ws, tokens, start, length,
                             **options)

  tokens = np.random.default_rng(seed).integers(0, m.vocab_size, capacity).astype(np.int32)
  ws = tfm.init_workspace(m, capacity)
  args = (params, ws, jnp.asarray(tokens[:chunk]), jnp.int32(0), jnp.int32(chunk))
  t0 = time.perf_counter()
  compiled = step.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  del ws, args
  # One chunk before timing: first-call work (kernel loading, allocator growth) is not
  # the prompt's.
  ws = tfm.init_workspace(m, capacity)
  jax.block_until_ready(compiled(params, ws, jnp.asarray(tokens[:chunk]), jnp.int32(0),
                                 jnp.int32(chunk))[2])
  del ws
  runs = []
  for _ in range(repeats):
    ws = tfm.init_workspace(m, capacity)
    jax.block_until_ready(ws)
    times = []
    for s in range(0, prompt, chunk):
      n = min(chunk, prompt - s)
      piece = jnp.asarray(tokens[s:s + chunk])
      t0 = time.perf_counter()
      _, _, logits, ws = compiled(params, ws, piece, jnp.int32(s), jnp.int32(n))
      jax.block_until_ready(logits)
      times.append(time.perf_counter() - t0)
    runs.append(times)
    del ws
  best = min(runs, key=sum)
  return {"init_s": init_s, "compile_s": compile_s, "capacity": capacity,
          "options": {k: v for k, v in options.items()}, "chunk_s": best,
          "total_s": sum(best), "tokens_per_s": prompt / sum(best),
          "runs_total_s": [sum(r) for r in runs]}


def run_phases(cfg, *, chunk: int, prefix: int, capacity: int, seed: int,
               indexer_configs: list[str], radix_bits: list[int], target_s: float,
               peak_tflops: float, hbm_gbps: float) -> dict:
  """Times the last chunk's parts alone (``--phases`` in the module docstring)."""
  import jax
  import jax.numpy as jnp

  from ula_jax.kernels.indexer import prefill as sel
  from ula_jax.kernels.indexer.pallas import IndexerConfig
  from ula_jax.kernels.indexer.reference import select_topk
  from ula_jax.kernels.indexer.topk import select_topk_radix
  from ula_jax.kernels.sparse_attention.prefill import sparse_attention_rows
  from ula_jax.mesh import interpret_kernels

  m, kern = cfg.model, cfg.kernels
  C, I, K, k = chunk, m.index_n_heads, m.index_head_dim, m.index_topk
  H, Dl, Dr = m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
  scratch = cfg.engine.prefill_scratch_bytes
  interpret = interpret_kernels(cfg, jax.devices()[0].platform)
  dt = jnp.dtype(m.kv_dtype)
  key = jax.random.key(seed)
  kq, kw, kk, ks, ka, kb, kc = jax.random.split(key, 7)
  q = jax.random.normal(kq, (C, I, K), jnp.float32).astype(m.dtype)
  w = jax.random.normal(kw, (C, I), jnp.float32) * I ** -0.5
  keys = jax.random.normal(kk, (capacity, K), jnp.float32).astype(dt)
  pos = prefix - C + jnp.arange(C, dtype=jnp.int32)
  limit = pos + 1
  out: dict = {"prefix": prefix, "chunk": C, "rows": {}}

  def row(name, seconds, flops=0, nbytes=0, per_chunk=1, **extra):
    ceiling = max(flops / (peak_tflops * 1e12), nbytes / (hbm_gbps * 1e9))
    out["rows"][name] = dict(seconds=seconds, flops=flops, bytes=nbytes,
                             per_chunk=per_chunk, ceiling_s=ceiling, **extra)

  # One group's selection, whole chunk.
  select = jax.jit(functools.partial(sel.prefix_topk, k=k, impl=kern.indexer,
                                     scratch_bytes=scratch, interpret=interpret))
  score_flops = 2 * C * I * K * prefix
  R = sel.block_rows(C, capacity, scratch,
                     minimum=IndexerConfig().block_n if kern.indexer == "pallas" else 1)
  R = min(R, C)
  blocks = -(-C // R)
  tile = sel.column_tile(kern.indexer, capacity, R, I, scratch, IndexerConfig())
  Tp = -(-capacity // tile) * tile
  passes = 32 // radix_bits[0]
  topk_bytes = (passes + 5) * C * Tp * 4  # count passes, then ranks and compaction
  row("selection (one group)", _timed(select, q, w, keys, limit, target_s=target_s),
      score_flops, topk_bytes + C * Tp * 4, per_chunk=m.num_groups, impl=kern.indexer,
      row_block=R, blocks=blocks)

  # Its parts, one row block (times the blocks).
  qb, wb, lb = q[-R:], w[-R:], limit[-R:]
  keys_p = jnp.pad(keys, ((0, Tp - capacity), (0, 0)))
  scores_fn = sel.scores_fn(kern.indexer)
  if kern.indexer == "pallas":
    configs = [IndexerConfig.parse(t) for t in indexer_configs] or [IndexerConfig()]
  else:
    configs = [None]
  for c in configs:
    opts = ({"config": c, "interpret": interpret} if c is not None else {"block_t": tile})
    f = jax.jit(functools.partial(scores_fn, **opts))
    name = "scores" + (f" [{c.label}]" if c is not None else "")
    row(name, _timed(f, qb, wb, keys_p, lb, target_s=target_s) * blocks,
        2 * R * I * K * prefix * blocks, C * Tp * 4, per_chunk=m.num_groups)
  scores = jax.jit(functools.partial(scores_fn, **(
      {"config": configs[0], "interpret": interpret} if kern.indexer == "pallas"
      else {"block_t": tile})))(qb, wb, keys_p, lb)
  cand = jnp.arange(Tp, dtype=jnp.int32)[None, :] < lb[:, None]
  for bits in radix_bits:
    f = jax.jit(functools.partial(sel.select_prefix, k=k, impl=kern.indexer, radix_bits=bits,
                                  interpret=interpret))
    row(f"top-k (radix, {bits} bits a pass)",
        _timed(f, scores, lb, target_s=target_s) * blocks,
        0, (32 // bits + 5) * C * Tp * 4, per_chunk=m.num_groups)
  lax_topk = jax.jit(functools.partial(select_topk, k=k))
  row("top-k (lax.top_k, a sort)", _timed(lax_topk, scores, cand, target_s=target_s) * blocks,
      0, C * Tp * 4, per_chunk=m.num_groups)
  # Checks at this size: the radix picks are lax.top_k's; Pallas scores are the jnp form's.
  p1, v1 = lax_topk(scores, cand)
  p2, v2 = jax.jit(functools.partial(sel.select_prefix, k=k, impl=kern.indexer,
                                     interpret=interpret))(scores, lb)
  s1 = jnp.sort(jnp.where(v1, p1, Tp), axis=1)
  s2 = jnp.sort(jnp.where(v2, p2, Tp), axis=1)
  out["topk_equal_lax"] = bool(jnp.array_equal(s1, s2))
  if kern.indexer == "pallas":
    ref = jax.jit(functools.partial(sel.scores_fn("xla"), block_t=tile))(qb, wb, keys_p, lb)
    err = jnp.where(cand, jnp.abs(scores - ref), 0.0).max()
    out["scores_max_abs_diff_vs_xla"] = float(err)
    out["scores_max_abs"] = float(jnp.where(cand, jnp.abs(ref), 0.0).max())

  # One layer's attention: every row over k picks of its prefix.
  picks = jax.jit(functools.partial(select_topk_radix, k=k))(
      jax.random.uniform(ks, (C, capacity)),
      jnp.arange(capacity, dtype=jnp.int32)[None, :] < limit[:, None])
  q_lat = jax.random.normal(ka, (C, H, Dl), jnp.float32).astype(m.dtype)
  q_rope = jax.random.normal(kb, (C, H, Dr), jnp.float32).astype(m.dtype)
  pool = jax.random.normal(kc, (capacity, Dl + Dr), jnp.float32).astype(dt)
  attend = jax.jit(functools.partial(sparse_attention_rows, scale=(Dl + Dr) ** -0.5,
                                     impl=kern.attention, scratch_bytes=scratch,
                                     interpret=interpret))
  row("attention (one layer)", _timed(attend, q_lat, q_rope, pool, *picks, target_s=target_s),
      2 * C * H * k * (2 * Dl + Dr), C * k * (Dl + Dr) * dt.itemsize,
      per_chunk=m.num_layers, impl=kern.attention)
  return out


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="ula-jax bench prefill", description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*", help="config overrides a.b=value")
  p.add_argument("--config", default=DEFAULT_CONFIG)
  p.add_argument("--prompt", default="64K", help="prompt tokens (K = 1024)")
  p.add_argument("--chunk", default=None,
                 help="tokens per prefill chunk (default: the config's engine.prefill_chunk)")
  p.add_argument("--repeats", type=int, default=1, help="times the prompt is prefilled")
  p.add_argument("--no-prompt", action="store_true", help="skip the prompt (phases only)")
  p.add_argument("--no-phases", action="store_true", help="skip the per-phase timings")
  p.add_argument("--indexer-configs", default="",
                 help="kernels.indexer=pallas: IndexerConfig tokens to time the scores with "
                 "(e.g. n64t256w8s3,n64t128w4s3; default: the production launch)")
  p.add_argument("--radix-bits", default="4", help="radix select bits per pass, comma list")
  p.add_argument("--target-ms", type=float, default=200.0,
                 help="time each phase for about this long")
  p.add_argument("--peak-tflops", type=float, default=989.0,
                 help="the device's dense bf16 rate for the ceilings (H200: 989)")
  p.add_argument("--hbm-gbps", type=float, default=4800.0,
                 help="the device's memory bandwidth for the ceilings (H200: 4800)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default="runs/bench/prefill.json")
  args = p.parse_intermixed_args(argv)
  prompt = parse_sizes(args.prompt, flag="--prompt", minimum=1)
  if len(prompt) != 1:
    p.error(f"--prompt={args.prompt!r}: expected one size")
  prompt = prompt[0]
  bits = parse_sizes(args.radix_bits, flag="--radix-bits", minimum=1)
  if not bits or any(32 % b for b in bits):
    p.error(f"--radix-bits={args.radix_bits!r}: expected divisors of 32 (1, 2, 4, 8, 16)")
  if args.repeats < 1:
    p.error(f"--repeats={args.repeats}: expected >= 1")
  configs = [t.strip() for t in args.indexer_configs.split(",") if t.strip()]
  if configs:
    from ula_jax.kernels.indexer.pallas import IndexerConfig
    for t in configs:
      IndexerConfig.parse(t)  # a bad token is an argument error, before any compute

  from ula_jax.config import load_config
  from ula_jax.mesh import auto_kernels, check_kernels, configure_platform, mesh_devices

  cfg = load_config(args.config, args.overrides)
  configure_platform(cfg, num_devices=1)
  device = mesh_devices(cfg)[0]
  check_kernels(cfg, device.platform)
  chunk = cfg.engine.prefill_chunk if args.chunk is None else parse_sizes(
      args.chunk, flag="--chunk", minimum=1)[0]
  chunk = min(chunk, prompt)
  # kernels.*=auto for this device and a chunk's rows per attention launch (one device:
  # every head); the rest of the benchmark sees the concrete implementations.
  cfg = cfg.model_copy(update={"kernels": auto_kernels(cfg, device, rows=chunk, tp=1)})
  capacity = -(-prompt // chunk) * chunk
  m = cfg.model
  if capacity > m.max_position:
    p.error(f"--prompt={args.prompt!r} in chunks of {chunk}: positions up to {capacity}, "
            f"beyond model.max_position={m.max_position}")
  out = {"environment": environment(), "config": args.config, "overrides": args.overrides,
         "model": m.model_dump(), "prompt": prompt, "chunk": chunk,
         "kernels": {"attention": cfg.kernels.attention, "indexer": cfg.kernels.indexer},
         "prefill_scratch": cfg.engine.prefill_scratch_bytes,
         "peak_tflops": args.peak_tflops, "hbm_gbps": args.hbm_gbps}
  if not args.no_prompt:
    out["prompt_run"] = run_prompt(cfg, prompt=prompt, chunk=chunk, repeats=args.repeats,
                                   seed=args.seed)
    r = out["prompt_run"]
    print_table(f"prefill of one {prompt}-token prompt, chunks of {chunk} "
                f"({out['environment']['device']}; attention={cfg.kernels.attention}, "
                f"indexer={cfg.kernels.indexer})",
                ["prompt tokens/s", "total (s)", "first chunk (s)", "last chunk (s)",
                 "compile (s)", "model init (s)"],
                [[fmt(r["tokens_per_s"], 0), fmt(r["total_s"], 3), fmt(r["chunk_s"][0], 3),
                  fmt(r["chunk_s"][-1], 3), fmt(r["compile_s"], 1), fmt(r["init_s"], 1)]])
    print("seconds per chunk: " + " ".join(fmt(s, 3) for s in r["chunk_s"]))
  if not args.no_phases:
    ph = run_phases(cfg, chunk=chunk, prefix=capacity, capacity=capacity, seed=args.seed,
                    indexer_configs=configs, radix_bits=bits, target_s=args.target_ms / 1e3,
                    peak_tflops=args.peak_tflops, hbm_gbps=args.hbm_gbps)
    out["phases"] = ph
    last = out.get("prompt_run", {}).get("chunk_s", [None])[-1]
    per_token = layer_flops_per_token(m)
    layer_flops = sum(per_token.values()) * chunk
    sel_s = ph["rows"]["selection (one group)"]["seconds"] * m.num_groups
    att_s = ph["rows"]["attention (one layer)"]["seconds"] * m.num_layers
    ph["rows"]["layers (the rest)"] = dict(
        seconds=None if last is None else last - sel_s - att_s, flops=layer_flops, bytes=0,
        per_chunk=1, ceiling_s=layer_flops / (args.peak_tflops * 1e12), parts=per_token)
    table = []
    for name, r in ph["rows"].items():
      n = r["per_chunk"]
      s = r["seconds"]
      table.append([name, str(n), fmt(r["flops"] / 1e9, 1), fmt(r["bytes"] / 1e9, 2),
                    fmt(r["ceiling_s"] * 1e3, 3), fmt(None if s is None else s * 1e3, 3),
                    fmt(None if s is None else r["ceiling_s"] / s if s > 0 else None, 2),
                    fmt(None if s is None or last is None else s * n / last, 2)])
    print_table(f"the last chunk's parts alone (prefix {capacity}, chunk {chunk}; ceilings at "
                f"{args.peak_tflops:g} TFLOP/s, {args.hbm_gbps:g} GB/s)",
                ["part", "per chunk", "GFLOP", "GB", "ceiling (ms)", "measured (ms)",
                 "ceiling / measured", "share of last chunk"], table, left=["part"])
    checks = [f"radix top-k picks = lax.top_k's: {ph['topk_equal_lax']}"]
    if "scores_max_abs_diff_vs_xla" in ph:
      checks.append(f"Pallas scores - jnp scores: max |diff| "
                    f"{ph['scores_max_abs_diff_vs_xla']:.3g} (max |score| "
                    f"{ph['scores_max_abs']:.3g})")
    print("; ".join(checks))
  write_json(args.json, out)
  print(f"wrote {args.json}")
  return 0
