"""Requests in, results out: the engine's host-side records."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  prompt: [T] int32 token ids (T >= 1)
  max_new_tokens: tokens to generate (greedy); the request finishes after that many
  arrival_step: the engine step at which the request joins the queue
  """

  id: str
  prompt: np.ndarray
  max_new_tokens: int
  arrival_step: int = 0

  @property
  def prompt_len(self) -> int:
    return int(self.prompt.shape[0])

  @property
  def total_len(self) -> int:
    """Tokens whose KV the request needs at its end (prompt + generated)."""
    return self.prompt_len + self.max_new_tokens


Status = Literal["finished", "rejected", "interrupted"]


@dataclasses.dataclass
class RequestResult:
  id: str
  prompt_len: int
  max_new_tokens: int
  status: Status
  output_tokens: list[int]
  reason: str | None = None  # why a request was rejected
  device: int | None = None  # dp rank that served it
  arrival_step: int = 0
  admitted_step: int | None = None
  first_token_step: int | None = None
  finished_step: int | None = None
  ttft_s: float | None = None  # wall time from admission to first token
  decode_time_s: float | None = None  # wall time of its decode steps

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class StepMetrics:
  """One engine step (a prefill chunk round and/or a decode step)."""

  step: int
  kind: Literal["prefill", "decode", "mixed", "idle"]
  running: int  # requests decoding this step (all dp ranks)
  prefilling: int  # requests that ran a prefill chunk this step
  waiting: int  # admitted-or-queued requests not yet decoding
  finished: int  # requests finished so far
  decode_tokens: int  # tokens generated this step
  prefill_tokens: int  # prompt tokens processed this step
  step_time_s: float  # wall time of the step (device work included)
  decode_time_s: float  # wall time of the decode part
  tokens_per_s: float  # decode_tokens / decode_time_s
  device_used: int  # physical device slots in use (all devices, all groups)
  host_used: int  # physical host slots in use
  distinct: int  # distinct entries stored
  admitted: int = 0  # requests holding memory (admitted and not yet finished), all ranks
  # wall time this step waited for its synthetic prefill chunk to finish on the device
  # before its decode round began (so that decode_time_s holds the decode round alone)
  prefill_wait_s: float = 0.0
  extra: dict = dataclasses.field(default_factory=dict)  # system-specific (hit rates, ...)

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    extra = d.pop("extra")
    d.update(extra)
    return d


@dataclasses.dataclass
class RunResult:
  steps: list[StepMetrics]
  requests: list[RequestResult]
  capacity: dict  # CapacityReport.as_dict() at the peak of device use
  summary: dict  # totals: wall time, tokens, tokens/s, peak batch, admitted, rejected, ...
  traces: list | None = None  # per dp rank memory.trace.SelectionTrace (engine.record_trace)
  digests: dict | None = None  # digests.npz's arrays (engine.record_digests)
