"""How broad a small trained model's attention is, layer by layer, with byte tokens or
a BPE vocabulary: the dense stage of ``ula-jax train``'s recipe at CPU size, then the
held-out share of each layer's attention that its own top-k holds (the most any
selection of k positions could capture: ``attention_topk_mass_beyond_k``) and the share
the indexer's top-k holds.

    PYTHONPATH=. python benchmarks/probes/attention_breadth.py --tokenizer bytes --layers 4
    PYTHONPATH=. python benchmarks/probes/attention_breadth.py --tokenizer bpe:4096 --layers 4
    PYTHONPATH=. python benchmarks/probes/attention_breadth.py --steps 200 --sparse-steps 200 \
        --concentration 0 1

With ``--sparse-steps N`` the dense stage is followed by N sparse steps (attention over
the indexer's top-k), once for each ``--concentration`` weight
(``train.concentration_weight``), every branch from the same dense-stage state, and each
branch is evaluated. ``--locality`` adds, for the dense stage's model and each branch's,
the locality of its selections while it reads the 8 held-out windows (teacher forced,
``train.forward.read_selections``; positions 256-1023 as decode steps of a 256-token
prompt), imported as SGLang ``indexer_topk`` arrays and measured by ``ula-jax trace
stats``'s ``locality_stats``: the overlap of consecutive steps' top-k and the miss rate of
an exact-LRU buffer of k / 2k / 4k entries per request.

The model: hidden 192, 4 heads, an MLA entry of 64 + 32, dense MLPs, one indexer of
4 x 32 per layer, float32; 1K-token windows (the held-out files of the standard
library, as ``ula-jax train``'s split, 6 MB of text), top-128 (the 16K / 2048 ratio of
``experiments/train_small``), 4 windows a step, AdamW at 2e-3. ``bpe:V`` trains a
byte-level BPE of V - 1 tokens plus a separator on the training files with the
``tokenizers`` package (``pip install tokenizers``; nothing is fetched).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from ula_jax.memory.traces.format import load_traces
from ula_jax.memory.traces.sglang import import_sglang
from ula_jax.memory.traces.stats import locality_stats
from ula_jax.train.config import load_train_config
from ula_jax.train.data import BOS, eval_windows, load_corpus, train_batch
from ula_jax.train.forward import ForwardOptions, read_selections
from ula_jax.train.loop import cast, evaluate, init_model, make_optimizer, train_step

SEQ, TOP_K = 1024, 128
PROMPT = 256  # --locality: the held-out windows' first 256 tokens are the prompt


def _bpe_streams(corpus, vocab: int) -> tuple[np.ndarray, np.ndarray, float]:
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  def documents(stream):
    cuts = list(np.flatnonzero(stream == BOS)) + [len(stream)]
    return [bytes(stream[a + 1:b].astype(np.uint8)).decode("utf-8", "replace")
            for a, b in zip(cuts, cuts[1:])]

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  train_docs, held_docs = documents(corpus.train), documents(corpus.heldout)
  tok.train_from_iterator(train_docs, trainers.BpeTrainer(
      vocab_size=vocab - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  sep = vocab - 1

  def encode(docs):
    return np.concatenate([np.concatenate([[sep], e.ids]) for e in tok.encode_batch(docs)]
                          ).astype(np.int32)

  train = encode(train_docs)
  return train, encode(held_docs), corpus.train.size / train.size


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokenizer", default="bytes", help="bytes or bpe:VOCAB")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--sparse-steps", type=int, default=0)
  p.add_argument("--concentration", type=float, nargs="+", default=[0.0],
                 help="train.concentration_weight of each sparse branch")
  p.add_argument("--locality", action="store_true",
                 help="the selections' locality on the held-out windows (module docstring)")
  p.add_argument("--json", default=None, help="write the result here")
  a = p.parse_args()
  if a.tokenizer == "bytes":
    vocab = 257
  elif a.tokenizer.startswith("bpe:") and a.tokenizer[4:].isdigit():
    vocab = int(a.tokenizer[4:])
  else:
    p.error(f"--tokenizer={a.tokenizer!r}: expected bytes or bpe:VOCAB")
  overrides = [
      f"model.vocab_size={vocab}", f"model.num_layers={a.layers}",
      f"model.num_dense_layers={a.layers}", "model.index_share=1", f"model.index_topk={TOP_K}",
      "model.max_position=2048", "model.hidden_size=192", "model.intermediate_size=512",
      "model.num_heads=4", "model.q_lora_rank=96", "model.kv_lora_rank=64",
      "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32", "model.v_head_dim=32",
      "model.index_n_heads=4", "model.index_head_dim=32", "model.dtype=float32",
      "model.kv_dtype=float32", "data.max_bytes=6000000", "data.heldout_fraction=0.03",
      f"train.seq_len={SEQ}", "train.batch_size=4", f"train.dense_steps={a.steps}",
      f"train.sparse_steps={a.sparse_steps}", "train.lr=2e-3",
      f"train.warmup_steps={min(20, a.steps + a.sparse_steps)}",
      "train.attention_block=256", "eval.sequences=8"]
  cfg = load_train_config("experiments/train_small/tiny.yaml", overrides)
  corpus = load_corpus(cfg.data)
  train, held, bytes_per_token = corpus.train.astype(np.int32), corpus.heldout.astype(np.int32), 1.0
  if vocab != 257:
    train, held, bytes_per_token = _bpe_streams(corpus, vocab)
  graphdef, params = nnx.split(init_model(cfg))
  params = cast(params, "float32")  # float32 master parameters, as ``ula-jax train``
  tx, _ = make_optimizer(cfg.train)
  opt_state = tx.init(params)
  opts = ForwardOptions(False, cfg.block)
  t0 = time.perf_counter()
  for step in range(a.steps):
    windows = train_batch(train, step, cfg.train.batch_size, SEQ, 0)
    params, opt_state, m = train_step(graphdef, tx, opts, cfg, params, opt_state, windows)
    if step % 100 == 0 or step == a.steps - 1:
      print(f"step {step}: loss {float(m['lm']):.3f} ({time.perf_counter() - t0:.0f} s)",
            flush=True)
  held_windows = eval_windows(held, 8, SEQ)

  def measured(ev: dict, loss: str) -> dict:
    return {
        "heldout_loss_nats_per_token": ev[loss],
        "heldout_bits_per_byte": ev[loss] / np.log(2) / bytes_per_token,
        "attention_topk_mass_beyond_k_per_layer": ev["attention_topk_mass_beyond_k_per_layer"],
        "captured_mass_beyond_k_per_layer": ev["captured_mass_beyond_k_per_layer"],
        "captured_mass_beyond_k": ev["captured_mass_beyond_k"],
        "captured_mass": ev["captured_mass"]}

  def locality(params_) -> dict:
    """The held-out windows' teacher-forced selections as a trace, and its statistics."""
    model = nnx.merge(graphdef, params_)
    read = jax.jit(lambda t: read_selections(model, t, PROMPT, cfg.block))
    with tempfile.TemporaryDirectory() as tmp:
      entries = []
      for i, w in enumerate(held_windows):
        np.save(f"{tmp}/w{i}.npy", np.asarray(read(jax.numpy.asarray(w[:SEQ]))))
        entries.append({"id": f"w{i}", "file": f"w{i}.npy", "prompt_len": PROMPT,
                        "first_position": PROMPT})
      with open(f"{tmp}/manifest.json", "w") as f:
        json.dump({"requests": entries}, f)
      trace = import_sglang(tmp, f"{tmp}/trace.npz", cfg.model.kv_geometry(),
                            page_size=64, prefill_chunk=PROMPT)
      st = locality_stats(load_traces(trace))
    return {"overlap": st["overlap"]["mean"], "overlap_per_layer": st["overlap"]["per_group"],
            "lru_miss_rate": {name: v["miss_rate"] for name, v in st["lru_buffer"].items()},
            "decode_steps": st["trace"]["steps"]}

  ev = evaluate(graphdef, params, held_windows, cfg)
  result = {
      "tokenizer": a.tokenizer, "vocab": vocab, "layers": a.layers, "steps": a.steps,
      "seq_len": SEQ, "top_k": TOP_K, "bytes_per_token": bytes_per_token,
      **measured(ev, "loss_dense"), "train_s": time.perf_counter() - t0}
  if a.locality:
    result["locality"] = locality(params)
    print("dense stage:", json.dumps(result["locality"]), flush=True)
  if a.sparse_steps:
    # Every branch starts from the dense stage's state (the step donates its inputs).
    start = jax.tree.map(np.asarray, jax.device_get((params, opt_state)))
    result["sparse_steps"], result["branches"] = a.sparse_steps, []
    for weight in a.concentration:
      bcfg = load_train_config("experiments/train_small/tiny.yaml", overrides + [
          f"train.concentration_weight={weight}"])
      opts = ForwardOptions(True, cfg.block, spill=weight > 0)
      p_, s_ = jax.tree.map(jax.numpy.asarray, start)
      t1 = time.perf_counter()
      for step in range(a.steps, a.steps + a.sparse_steps):
        windows = train_batch(train, step, cfg.train.batch_size, SEQ, 0)
        p_, s_, m = train_step(graphdef, tx, opts, bcfg, p_, s_, windows)
        if (step - a.steps) % 100 == 0 or step == a.steps + a.sparse_steps - 1:
          spill = f", spill {float(m['spill']):.3f}" if "spill" in m else ""
          print(f"weight {weight} step {step}: loss {float(m['lm']):.3f}{spill} "
                f"({time.perf_counter() - t1:.0f} s)", flush=True)
      ev = evaluate(graphdef, p_, held_windows, bcfg)
      result["branches"].append({
          "concentration_weight": weight, **measured(ev, "loss_sparse"),
          "heldout_loss_dense_nats_per_token": ev["loss_dense"],
          "train_s": time.perf_counter() - t1})
      if a.locality:
        result["branches"][-1]["locality"] = locality(p_)
      print(json.dumps(result["branches"][-1]), flush=True)
  result.update({"machine": platform.processor() or platform.machine(), "jax": jax.__version__,
                 "date": datetime.date.today().isoformat()})
  print(json.dumps(result))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
