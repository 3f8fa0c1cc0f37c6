"""A mixture of experts' terms (Qwen3-MoE, runtime/models/qwen3_moe.py): what the experts, the router and the token
dispatcher hold on one GPU, each a named share of the plan's rows (runtime/plan/memory.py adds them up; nothing here
is counted twice). Read from megatron-core 0.16.1 (``megatron/core/transformer/moe/``) as the trainer builds it: the
local spec's ``SequentialMLP`` experts (``experts.py``), the ``TopKRouter`` in fp32 (``router.py``, ``moe_utils.py``)
and the ``allgather`` dispatcher (``token_dispatcher.py``, ``MoEAllGatherTokenDispatcher``).

* Experts per EP rank: ``train.expert_parallel`` = EP gives a rank E / EP experts (each split by TP as the dense
  layers are): their weights, gradients and optimizer state. Megatron gives the experts an optimizer of their own,
  which the distributed optimizer shards over the expert-data-parallel group (DP / EP ranks), not over all DP
  (runtime/plan/trainer_terms.py); ``train.optimizer_on_host``: that state in host memory instead (12 B a parameter).
* The router: its ``[E, hidden]`` weight, replicated over TP and EP. Per token and MoE layer it keeps for the
  backward, in fp32 (``moe_router_dtype``): the softmax over every expert's logit that the load-balancing loss reads
  (``compute_routing_scores_for_aux_loss``, 4 E bytes; none without the loss), and the top-k's indices (int64) and
  renormalised probabilities (``topk_routing_with_score_function``; 12 k bytes).
* The dispatcher (``MoEAllGatherTokenDispatcher``): ``token_dispatch`` all-gathers the hidden states over the TP x EP
  group into megatron's global buffer (``gather_from_sequence_parallel_region(..., use_global_buffer=True)``):
  ``[tokens x EP, hidden]`` in bf16, one buffer reused by every layer (none at TP = EP = 1); with them the routing
  map and probabilities ``[tokens x EP, E]``. ``dispatch_postprocess`` keeps its experts' columns of the map
  (``local_map`` and the transposed copy ``masked_select`` saves: 2 x ``[tokens x EP, E / EP]`` bool = 2 E bytes a
  token), their probabilities (fp32) and the permutation's indices (int64) of each routed copy, and ``permute`` makes
  the routed copies ``[tokens x EP x k x (E / EP) / E, hidden]`` in bf16 (``index_select``), which the experts'
  fc1 saves for the backward: per token of the rank, k copies of its hidden state when the routes are balanced (the
  load-balancing loss's aim; a rank whose experts receive more holds proportionally more), whatever EP is.
* The experts' activations: each routed copy's fc1 output ``[2 ffn]`` and the SwiGLU product ``[ffn]`` (the fused
  weighted SwiGLU; unfused also silu's output), bf16: k x ffn per token, what the dense layer's MLP holds at ffn
  = k x expert ffn. ``train.recompute_modules: [mlp]`` does not recompute a MoE layer (megatron's
  ``TransformerLayer`` sets ``recompute_mlp`` only for dense ones): the router's, dispatcher's and experts' tensors
  stay; ``train.recompute: full`` drops them with the rest of the layer.
* The engine's experts: the built-in engine (runtime/rollout/decode_model.py) keeps every expert of its replica, in
  the fused ``[E, 2 ffn, hidden]`` / ``[E, hidden, ffn]`` layout its grouped GEMMs read (with
  ``rollout.weights_dtype: fp8`` in e4m3, a scale per expert row: engine_terms.py); SGLang splits them over its TP.
"""
from __future__ import annotations

from typing import Any

from runtime.plan.shape import expert_params


def is_moe(m: dict[str, Any]) -> bool:
    return bool(m.get("E"))


def expert_params_per_rank(m: dict[str, Any], tp: int, ep: int) -> int:
    """The experts' parameters one rank holds: E / EP experts, each 1/TP."""
    return expert_params(m) // (tp * ep)


def router_params(m: dict[str, Any]) -> int:
    """The routers' ``[E, hidden]`` weights over every layer (replicated over TP and EP)."""
    return m["L"] * m["E"] * m["h"] if is_moe(m) else 0


def router_bytes_per_token(m: dict[str, Any]) -> int:
    """What one MoE layer's router keeps for the backward per token (module doc): the load-balancing loss's fp32
    softmax over every expert, the top-k's int64 indices and fp32 probabilities."""
    if not is_moe(m):
        return 0
    return (4 * m["E"] if m.get("aux") else 0) + (8 + 4) * m["k"]


def dispatcher_bytes_per_token(m: dict[str, Any], e: int) -> int:
    """What one MoE layer's allgather dispatcher keeps per token of the rank (module doc): the k routed copies of its
    hidden state (balanced routes), their probabilities and permutation indices, the local routing map twice."""
    if not is_moe(m):
        return 0
    return m["k"] * (m["h"] * e + 4 + 8) + 2 * m["E"]


def dispatcher_gather_buffer(m: dict[str, Any], e: int, *, tokens: int, tp: int, ep: int) -> int:
    """Megatron's global buffer the dispatcher gathers the TP x EP group's hidden states into: ``[tokens x EP,
    hidden]``, one for the model (none at TP = EP = 1: nothing is gathered)."""
    if not is_moe(m) or tp * ep == 1:
        return 0
    return tokens * ep * m["h"] * e


def expert_bytes_per_token(m: dict[str, Any], e: int, *, tp: int, elems: int = 3) -> int:
    """The experts' activations per token and layer: k routed copies' ``elems`` ffn-wide tensors (module doc: 3, the
    fc1 output and the fused SwiGLU's product; the activation terms say how many their path keeps)."""
    if not is_moe(m):
        return 0
    return elems * e * m["k"] * m["fe"] // tp


def engine_experts(m: dict[str, Any], e: int, *, engine: str, sglang_tp: int = 1, weights_dtype: str = "bf16",
                   shards: int = 1) -> int:
    """The engine's experts: every expert of its replica (the built-in engine; FP8: a byte a weight and an fp32 scale
    per expert row), 1/``shards`` of them on each engine of a replica split by its experts (``rollout.expert_shards``),
    1/TP of them (SGLang)."""
    if engine == "sglang":
        return expert_params(m) * e // sglang_tp
    if weights_dtype == "fp8":
        return (expert_params(m) + 4 * m["L"] * m["E"] * (2 * m["fe"] + m["h"])) // shards
    return expert_params(m) * e // shards


def engine_prefill_bytes_per_token(m: dict[str, Any], e: int) -> int:
    """What the built-in engine's MoE layer holds per prefill token beyond the dense MLP's (its k x ffn already counted):
    the router's fp32 input, logits and probabilities, and the k routed copies in (``xs``) and out (``slots``) of the
    grouped GEMMs (``_experts_mlp``)."""
    if not is_moe(m):
        return 0
    return 4 * m["h"] + 8 * m["E"] + 2 * m["k"] * m["h"] * e
