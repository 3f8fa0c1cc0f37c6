"""Rollout routing replay (R3, `rollout.routing_replay`) through SGLang: each token's experts asked of the servers
and decoded into the built-in engine's layout, `SampleResult.routed_experts` [tokens - 1, MoE layers, top-k].

Read from SGLang 0.5.17's source (`sglang/srt/`):
- `server_args.py`: `--enable-return-routed-experts` makes the server capture each MoE layer's top-k expert ids
  per forward (`state_capturer/routed_experts.py`: a host buffer [KV slots, num_hidden_layers,
  num_experts_per_tok] of int32, written at each token's KV slot). A dense model has no `num_experts_per_tok`:
  the flag is passed only for a mixture of experts.
- `managers/io_struct.py` GenerateReqInput: `return_routed_experts` asks for them, `routed_experts_start_len` (in
  [0, prompt tokens], else the request is aborted with a 400) is the first position returned. The answer covers
  positions [start, prompt + output tokens - 1): every token that was an input - the prompt's and the response's
  but its last, as the built-in engine records (`managers/scheduler_components/batch_result_processor.py`
  `_maybe_collect_routed_experts`, run when a request finishes, by an abort too).
- `managers/detokenizer_manager.py`, `managers/tokenizer_manager.py`: `meta_info["routed_experts"]` is the base64
  of that int32 array's bytes, row-major [positions, layers, k]; absent when the server runs without the flag, or
  the request never ran (aborted while queued).

A prompt position served from SGLang's prefix cache has the route recorded when it was computed (the KV slot's):
under the same weights, as every weight update here flushes the cache. A continued sample (partial rollout) keeps
the routes it has (those its tokens were drawn under) and asks only from its last token on, which SGLang's prefill
runs as an input under the new weights - the route that stands is the first one, as in the built-in engine.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import ModelError
from runtime.rollout.base import routes_dtype
from runtime.rollout.sglang.http_protocol import SGLangError

SERVER_FLAG = "--enable-return-routed-experts"


@dataclass(frozen=True)
class RouteLayout:
    """What a route row of the model holds: its MoE layers, the experts per token, how many experts there are."""

    layers: int
    topk: int
    experts: int

    @property
    def dtype(self) -> torch.dtype:
        return routes_dtype(self.experts)  # the built-in engine's: a byte an index up to 256 experts

    @classmethod
    def read(cls, model_dir: str) -> "RouteLayout | None":
        """The layout from the model's config.json; None for a dense model (nothing to record, as in the built-in
        engine)."""
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ModelError(f"rollout.routing_replay on SGLang reads the model's experts from {path}, which cannot "
                             f"be read: point the engine at a local HF checkpoint directory, or set "
                             f"rollout.routing_replay: false") from None
        if not cfg.get("num_experts_per_tok"):
            return None
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes the latter
        if not experts:
            raise ModelError(f"{path} names num_experts_per_tok but not how many experts there are (num_experts or "
                             f"num_local_experts): rollout.routing_replay cannot lay out the routes")
        # SGLang's capturer has a row per hidden layer; the families here refuse dense layers between MoE layers
        # (runtime/models/qwen3_moe.py), so every hidden layer is an MoE layer
        return cls(layers=int(cfg["num_hidden_layers"]), topk=int(cfg["num_experts_per_tok"]), experts=int(experts))

    def decode(self, encoded: str | None, rows: int, server_index: int) -> torch.Tensor:
        """`meta_info["routed_experts"]` of an answer that must cover `rows` positions, as [rows, layers, k]."""
        if encoded is None:
            raise SGLangError(f"SGLang engine {server_index} answered without meta_info.routed_experts: it needs "
                              f"{SERVER_FLAG} (the client passes it with rollout.routing_replay) and a release that "
                              f"returns routes (0.5.17 does)")
        raw = base64.b64decode(encoded)
        per_row = self.layers * self.topk
        if len(raw) != 4 * rows * per_row:
            raise SGLangError(f"SGLang engine {server_index} returned {len(raw) // 4} routed expert ids, expected "
                              f"{rows} positions x {self.layers} layers x {self.topk} = {rows * per_row}")
        ids = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(rows, self.layers, self.topk)
        if rows and (int(ids.min()) < 0 or int(ids.max()) >= self.experts):
            raise SGLangError(f"SGLang engine {server_index} returned expert ids outside [0, {self.experts})")
        return ids.to(self.dtype)


def kept_routes(routes: torch.Tensor | None, prompt_len: int, tokens: int) -> torch.Tensor | None:
    """A continued sample's routes that stand: its prompt's and its `tokens` kept tokens' but the last."""
    return None if routes is None else routes[:prompt_len + max(tokens - 1, 0)]
