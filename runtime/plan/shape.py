"""The model's shape as the plan reads it (megatron-core's GPTModel with the local spec, as the family's adapter
maps an HF config), the parameter counts, and the bytes of a dtype: what every term of the plan is a function of."""
from __future__ import annotations

from typing import Any

GIB = 2**30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, not {dtype!r}")
    return _DTYPE_BYTES[name]


def model_shape(hf_config) -> dict[str, Any]:
    """V (vocab), h (hidden), L (layers), f (ffn), nh / ng (attention heads / key-value groups), d (head dim), rot
    (rotary dims), and the family's switches (qkv bias, q/k norms, GLM4's post-norms, tied embeddings). A mixture of
    experts: E experts of ffn fe each, k routed per token (``aux``: with the load-balancing loss) and the router, and f the
    ffn width a token passes through (its k experts'), what the activation and compute terms read."""
    from runtime.models import get_adapter
    from runtime.models.base import head_dim

    adapter = get_adapter(hf_config)
    kw = adapter.transformer_config_kwargs(hf_config)  # also refuses configs the family cannot map
    d = head_dim(hf_config)
    rot = int(d * float(kw.get("rotary_percent", 1.0)))
    experts, topk, fe = int(kw.get("num_moe_experts") or 0), int(kw.get("moe_router_topk") or 0), \
        int(kw.get("moe_ffn_hidden_size") or 0)
    return dict(
        V=int(hf_config.vocab_size), h=kw["hidden_size"], L=kw["num_layers"],
        f=topk * fe if experts else kw["ffn_hidden_size"], E=experts, fe=fe, k=topk,
        aux=bool(experts) and kw.get("moe_router_load_balancing_type", "none") != "none",
        nh=kw["num_attention_heads"], ng=kw["num_query_groups"], d=d, rot=rot - rot % 2,
        qkv_bias=bool(kw["add_qkv_bias"]), qk_norm=bool(kw["qk_layernorm"]),
        post_norms=bool(getattr(adapter, "post_norms", False)),
        tied=bool(hf_config.tie_word_embeddings))


def param_counts(hf_config, tp: int = 1) -> tuple[int, int]:
    """(parameters of the model, parameters one tensor-parallel rank holds)."""
    return shape_param_counts(model_shape(hf_config), tp)


def largest_unit_params(m: dict[str, Any]) -> int:
    """The parameters of the largest piece a streamed weight sync gathers at once (the adapters' ``hf_units``: the
    embedding, one layer with its experts, the head)."""
    n_params, _ = shape_param_counts(m)
    embedding = m["V"] * m["h"]
    layer = (n_params - (1 if m["tied"] else 2) * embedding - m["h"]) // m["L"]
    return max(embedding, layer)


def expert_params(m: dict[str, Any]) -> int:
    """The parameters of every routed expert (none in a dense model): what expert parallelism splits."""
    return m["L"] * 3 * m["h"] * m["fe"] * m["E"] if m.get("E") else 0


def shape_param_counts(m: dict[str, Any], tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """:func:`param_counts` of a :func:`model_shape`; ``ep`` (``train.expert_parallel``): a rank holds 1/ep of the
    experts (each of them split by TP as the dense layers are)."""
    V, h, L, f, nh, ng, d = m["V"], m["h"], m["L"], m["f"], m["nh"], m["ng"], m["d"]
    if V % tp or nh % tp or ng % tp or f % tp:
        raise ValueError(f"tensor_parallel={tp} must divide vocab_size {V}, attention heads {nh}, "
                         f"key-value heads {ng} and ffn size {f}")
    qkv = (nh + 2 * ng) * d
    mlp = 3 * h * m["fe"] * m["E"] if m.get("E") else 3 * h * f
    split = (1 if m["tied"] else 2) * V * h + L * (h * qkv + (qkv if m["qkv_bias"] else 0) + nh * d * h + mlp)
    router = m["E"] * h if m.get("E") else 0  # megatron replicates the router over TP
    replicated = L * (2 * h + (2 * h if m["post_norms"] else 0) + (2 * d if m["qk_norm"] else 0) + router) + h
    experts = expert_params(m)
    return split + replicated, split // tp - experts // tp + experts // (tp * ep) + replicated
