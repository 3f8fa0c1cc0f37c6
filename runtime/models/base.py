"""How one model family maps between Hugging Face and megatron-core (in the spirit of torchtitan's
``StateDictAdapter``): the config mapping plus ``from_hf`` / ``to_hf`` on full (TP=1) tensors.

``ModelAdapter`` is the interface. ``DenseDecoderAdapter`` implements the LLaMA-shaped layout that
Qwen2/Qwen3/LLaMA share (fused per-group QKV, fused gate/up, RMSNorm, RoPE); a family module sets a
few flags and overrides a per-layer hook where its checkpoint differs (GLM4's extra post-norms and
fused ``gate_up_proj``, for example).

This module imports torch only: no megatron, so configs can be checked before the heavy imports.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from runtime.errors import ModelError

# The TransformerEngine layer spec fuses the pre-attention/pre-MLP norms into the next linear; the
# local spec (what we build) keeps them as separate modules.
_TE_TO_LOCAL_NAMES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
)


def normalize_mcore_state_dict(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Local-spec names for a megatron state dict from either layer spec, with DDP's ``module.``
    prefixes and TE's ``_extra_state`` entries removed."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if name.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        while name.startswith("module."):
            name = name[len("module."):]
        for te_name, local_name in _TE_TO_LOCAL_NAMES:
            if name.endswith("." + te_name):
                name = name[: -len(te_name)] + local_name
                break
        out[name] = value
    return out


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def rope_parameters(hf_config) -> dict[str, Any]:
    """RoPE settings from transformers 5 (``rope_parameters``) or 4 (``rope_theta``/``rope_scaling``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    scaling = getattr(hf_config, "rope_scaling", None)
    if "rope_type" not in params and isinstance(scaling, Mapping):
        params.update(scaling)
        params.setdefault("rope_type", scaling.get("type", "default"))
    params.setdefault("rope_type", "default")
    return params


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
             dim: int) -> torch.Tensor:
    """HF q [nh*d, ...], k/v [ng*d, ...] -> megatron's fused linear_qkv [ng*(nh/ng+2)*d, ...].

    Megatron lays the fused projection out per query group: [the group's q heads, its k, its v], so
    that a TP shard holds whole groups. Works for weights (2-D) and biases (1-D).
    """
    rest = q.shape[1:]
    per_group = num_heads // num_groups
    q = q.reshape(num_groups, per_group * dim, *rest)
    k = k.reshape(num_groups, dim, *rest)
    v = v.reshape(num_groups, dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(num_groups * (per_group + 2) * dim, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int, dim: int):
    """Inverse of :func:`fuse_qkv`: returns contiguous (q, k, v) in HF layout."""
    rest = qkv.shape[1:]
    per_group = num_heads // num_groups
    grouped = qkv.reshape(num_groups, (per_group + 2) * dim, *rest)
    q, k, v = torch.split(grouped, [per_group * dim, dim, dim], dim=1)
    return (q.reshape(num_heads * dim, *rest).contiguous(),
            k.reshape(num_groups * dim, *rest).contiguous(),
            v.reshape(num_groups * dim, *rest).contiguous())


def add_lora_up(out: torch.Tensor, hidden: torch.Tensor, b: torch.Tensor, scale: float, *,
                in_place: bool = False) -> torch.Tensor:
    """``out + scale * hidden B^T``: a LoRA adapter's up-projection (B [out, rank], ``hidden`` [..., rank]) added
    to its linear's output ``out`` [..., out], the one place the trainer (runtime/trainer/lora.py) and the engine
    (runtime/rollout/lora_forward.py) compute it, so both round the same sum the same way.

    One GEMM accumulating into ``out`` (``addmm``, leading dimensions flattened): it rounds once, and neither it
    nor its backward makes a [tokens, out] tensor besides its result (a matmul, a scaling and an add would make
    two in the forward and the scaled gradient in the backward; addmm's backward scales the [tokens, rank] and
    [out, rank] products and hands ``out`` the gradient as it is). ``in_place`` (no autograd; ``out`` a fresh
    tensor nobody else holds): the sum is written into ``out``, which must be contiguous, and ``out`` returned."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    if in_place:
        _add_lora_up_(out, rows, b, scale)
        return out
    return torch.addmm(out.reshape(-1, out.shape[-1]), rows, b.t(), alpha=scale).view(out.shape)


@torch.library.custom_op("grpoflow::add_lora_up_", mutates_args=("out",))
def _add_lora_up_(out: torch.Tensor, rows: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    # an op of its own so that torch.compile keeps it in place: a plain addmm_ on an intermediate of a compiled
    # graph becomes an addmm whose result sits beside its input
    out.view(-1, out.shape[-1]).addmm_(rows, b.t(), alpha=scale)


class _Take:
    """Reads tensors from an HF state dict, remembering which were used, so that leftovers (weights
    the mapping would silently drop) are reported instead of lost."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], model_type: str):
        self.state_dict = state_dict
        self.model_type = model_type
        self.used: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.state_dict:
            raise ModelError(
                f"the {self.model_type} checkpoint has no tensor '{name}': the weights do not match "
                f"config.json (check that both come from the same model)")
        self.used.add(name)
        return self.state_dict[name]

    def has(self, name: str) -> bool:
        return name in self.state_dict


class ModelAdapter:
    """One model family: HF config -> megatron config, and weights both ways (TP=1 full tensors)."""

    model_types: tuple[str, ...] = ()

    def check_supported(self, hf_config) -> None:
        """Raise ModelError for a config this family's mapping cannot represent exactly."""

    def transformer_config_kwargs(self, hf_config) -> dict[str, Any]:
        """Architecture fields of megatron's ``TransformerConfig`` (precision, dropout and fusions
        are set by ``runtime.mcore.env``)."""
        raise NotImplementedError

    def gpt_model_kwargs(self, hf_config) -> dict[str, Any]:
        """``GPTModel`` constructor arguments other than config and layer spec."""
        raise NotImplementedError

    def layer_spec(self, hf_config):
        """megatron ``ModuleSpec`` of one decoder layer. The default is megatron-core's local spec
        (what ``runtime.mcore.env.build_gpt_model`` builds); a family whose layer megatron-core
        lacks (GLM4's post-attention / post-MLP norms) returns its own. Imports megatron lazily."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        qk_layernorm = bool(self.transformer_config_kwargs(hf_config).get("qk_layernorm", False))
        return get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
        """HF tensors -> megatron local-spec state dict."""
        raise NotImplementedError

    def to_hf(self, mcore_state_dict: Mapping[str, Any], hf_config, *,
              include_tied_lm_head: bool = False) -> dict[str, torch.Tensor]:
        """Megatron state dict (local or TE spec names) -> HF tensors. With tied embeddings the
        ``lm_head.weight`` is left out (as ``save_pretrained`` writes it) unless asked for."""
        raise NotImplementedError


class DenseDecoderAdapter(ModelAdapter):
    """The LLaMA-shaped decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP, optional tied head."""

    qk_layernorm: bool = False  # Qwen3: per-head RMSNorm on q and k
    # HF tensors a checkpoint may carry that have no megatron counterpart and hold no information.
    ignorable_hf_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    # ---- config -------------------------------------------------------------------------------
    def qkv_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_bias", False))

    def o_proj_bias(self, hf_config) -> bool:
        return False

    # RoPE hooks: the rotated fraction of each head, GPT-J-style interleaved pairs (GLM4) or
    # rotate-half (LLaMA/Qwen), and which HF ``rope_type``s the family maps.
    supported_rope_types: tuple[str, ...] = ("default",)
    rotary_interleaved: bool = False

    def rotary_percent(self, hf_config) -> float:
        params = rope_parameters(hf_config)
        return float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))

    def rope_kwargs(self, hf_config) -> dict[str, Any]:
        """The RoPE arguments of ``GPTModel``."""
        return dict(rotary_percent=self.rotary_percent(hf_config),
                    rotary_base=float(rope_parameters(hf_config)["rope_theta"]))

    def check_rope(self, hf_config, name: str) -> None:
        rope_type = rope_parameters(hf_config)["rope_type"]
        if rope_type not in self.supported_rope_types:
            kinds = " or ".join(self.supported_rope_types)
            raise ModelError(
                f"config.json: rope_type '{rope_type}' (RoPE scaling) is not supported for {name}; "
                f"only {'plain RoPE' if kinds == 'default' else kinds} is mapped")
        pct = self.rotary_percent(hf_config)
        if pct != 1.0 and not self.rotary_interleaved:
            raise ModelError(f"config.json: partial_rotary_factor {pct:g} is not supported for {name} "
                             f"(its attention rotates the whole head)")
        rot = head_dim(hf_config) * pct
        if not (0.0 < pct <= 1.0) or rot != int(rot) or int(rot) % 2:
            raise ModelError(f"config.json: partial_rotary_factor {pct:g} must rotate an even number of "
                             f"the {head_dim(hf_config)} head dims")

    def check_supported(self, hf_config) -> None:
        name = self.model_types[0] if self.model_types else type(self).__name__
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"config.json: hidden_act '{act}' is not supported for {name} (only silu)")
        self.check_rope(hf_config, name)
        if getattr(hf_config, "use_sliding_window", False):
            raise ModelError(f"config.json: use_sliding_window=true is not supported for {name}; set it to false")
        if hf_config.num_attention_heads % hf_config.num_key_value_heads:
            raise ModelError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
        if self.o_proj_bias(hf_config):
            raise ModelError(
                f"config.json: attention_bias=true gives {name} an o_proj bias, which megatron's "
                f"layer specs cannot hold without adding MLP biases; only attention_bias=false is supported")

    def transformer_config_kwargs(self, hf_config) -> dict[str, Any]:
        self.check_supported(hf_config)
        return dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_query_groups=hf_config.num_key_value_heads,
            kv_channels=head_dim(hf_config),
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias(hf_config),
            qk_layernorm=self.qk_layernorm,
            rotary_interleaved=self.rotary_interleaved,
            # HF scales scores by 1/sqrt(head_dim) only; megatron's layer-number scaling would not match.
            apply_query_key_layer_scaling=False,
        )

    def gpt_model_kwargs(self, hf_config) -> dict[str, Any]:
        self.check_supported(hf_config)
        return dict(
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            position_embedding_type="rope",
            **self.rope_kwargs(hf_config),
        )

    # ---- weights ------------------------------------------------------------------------------
    def _attention_shape(self, hf_config) -> tuple[int, int, int]:
        return hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim(hf_config)

    def layer_from_hf(self, take: Callable[[str], torch.Tensor], hp: str, mp: str,
                      hf_config) -> dict[str, torch.Tensor]:
        """One decoder layer: ``hp`` is the HF prefix (``model.layers.3.``), ``mp`` megatron's."""
        nh, ng, d = self._attention_shape(hf_config)
        out = {
            mp + "input_layernorm.weight": take(hp + "input_layernorm.weight"),
            mp + "self_attention.linear_qkv.weight": fuse_qkv(
                take(hp + "self_attn.q_proj.weight"), take(hp + "self_attn.k_proj.weight"),
                take(hp + "self_attn.v_proj.weight"), nh, ng, d),
            mp + "self_attention.linear_proj.weight": take(hp + "self_attn.o_proj.weight"),
            mp + "pre_mlp_layernorm.weight": take(hp + "post_attention_layernorm.weight"),
            **self.mlp_from_hf(take, hp, mp, hf_config),
        }
        if self.qkv_bias(hf_config):
            out[mp + "self_attention.linear_qkv.bias"] = fuse_qkv(
                take(hp + "self_attn.q_proj.bias"), take(hp + "self_attn.k_proj.bias"),
                take(hp + "self_attn.v_proj.bias"), nh, ng, d)
        if self.qk_layernorm:
            out[mp + "self_attention.q_layernorm.weight"] = take(hp + "self_attn.q_norm.weight")
            out[mp + "self_attention.k_layernorm.weight"] = take(hp + "self_attn.k_norm.weight")
        return out

    def mlp_from_hf(self, take: Callable[[str], torch.Tensor], hp: str, mp: str,
                    hf_config) -> dict[str, torch.Tensor]:
        """One layer's MLP (a mixture of experts overrides it)."""
        return {mp + "mlp.linear_fc1.weight": self.fc1_from_hf(take, hp),
                mp + "mlp.linear_fc2.weight": take(hp + "mlp.down_proj.weight")}

    def mlp_to_hf(self, take: Callable[[str], torch.Tensor], hp: str, mp: str,
                  hf_config, experts: range | None = None) -> dict[str, torch.Tensor]:
        """One layer's MLP in HF names; ``experts``: a mixture's experts to convert (None: all)."""
        return {**self.fc1_to_hf(take(mp + "mlp.linear_fc1.weight"), hp),
                hp + "mlp.down_proj.weight": take(mp + "mlp.linear_fc2.weight")}

    def fc1_from_hf(self, take: Callable[[str], torch.Tensor], hp: str) -> torch.Tensor:
        """Megatron's fused fc1 is cat(gate, up) along the output dim."""
        return torch.cat([take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")], dim=0)

    def fc1_to_hf(self, fc1: torch.Tensor, hp: str) -> dict[str, torch.Tensor]:
        gate, up = torch.chunk(fc1, 2, dim=0)
        return {hp + "mlp.gate_proj.weight": gate.contiguous(), hp + "mlp.up_proj.weight": up.contiguous()}

    def layer_to_hf(self, take: Callable[[str], torch.Tensor], hp: str, mp: str,
                    hf_config, experts: range | None = None) -> dict[str, torch.Tensor]:
        nh, ng, d = self._attention_shape(hf_config)
        q, k, v = split_qkv(take(mp + "self_attention.linear_qkv.weight"), nh, ng, d)
        out = {
            hp + "input_layernorm.weight": take(mp + "input_layernorm.weight"),
            hp + "self_attn.q_proj.weight": q,
            hp + "self_attn.k_proj.weight": k,
            hp + "self_attn.v_proj.weight": v,
            hp + "self_attn.o_proj.weight": take(mp + "self_attention.linear_proj.weight"),
            hp + "post_attention_layernorm.weight": take(mp + "pre_mlp_layernorm.weight"),
            **self.mlp_to_hf(take, hp, mp, hf_config, experts),
        }
        if self.qkv_bias(hf_config):
            qb, kb, vb = split_qkv(take(mp + "self_attention.linear_qkv.bias"), nh, ng, d)
            out.update({hp + "self_attn.q_proj.bias": qb, hp + "self_attn.k_proj.bias": kb,
                        hp + "self_attn.v_proj.bias": vb})
        if self.qk_layernorm:
            out[hp + "self_attn.q_norm.weight"] = take(mp + "self_attention.q_layernorm.weight")
            out[hp + "self_attn.k_norm.weight"] = take(mp + "self_attention.k_layernorm.weight")
        return out

    def from_hf(self, hf_state_dict, hf_config):
        self.check_supported(hf_config)
        tied = bool(hf_config.tie_word_embeddings)
        take = _Take(hf_state_dict, self.model_types[0])
        out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
        for i in range(hf_config.num_hidden_layers):
            out.update(self.layer_from_hf(take, f"model.layers.{i}.", f"decoder.layers.{i}.", hf_config))
        out["decoder.final_layernorm.weight"] = take("model.norm.weight")
        if not tied:
            if not take.has("lm_head.weight"):
                raise ModelError("config.json says tie_word_embeddings=false but the weights have no "
                                 "lm_head.weight; set tie_word_embeddings to true or fix the checkpoint")
            out["output_layer.weight"] = take("lm_head.weight")
        elif take.has("lm_head.weight"):
            take("lm_head.weight")  # some tied checkpoints store the shared copy too
        leftover = sorted(n for n in hf_state_dict if n not in take.used
                          and not n.endswith(self.ignorable_hf_suffixes))
        if leftover:
            more = f" (+{len(leftover) - 3} more)" if len(leftover) > 3 else ""
            raise ModelError(
                f"the checkpoint has tensors the {self.model_types[0]} mapping does not use: "
                f"{', '.join(leftover[:3])}{more}; check config.json (num_hidden_layers, biases) "
                f"matches the weights")
        return out

    def to_hf(self, mcore_state_dict, hf_config, *, include_tied_lm_head=False):
        sd = normalize_mcore_state_dict(mcore_state_dict)
        out: dict[str, torch.Tensor] = {}
        for unit, _prefixes in self.hf_units(hf_config, include_tied_lm_head=include_tied_lm_head):
            out.update(self.unit_to_hf(unit, sd, hf_config, include_tied_lm_head=include_tied_lm_head))
        return out

    def hf_units(self, hf_config, *, include_tied_lm_head: bool = False) -> list[tuple[str, tuple[str, ...]]]:
        """The model in the pieces :meth:`unit_to_hf` converts one at a time, in HF order, each with the prefixes of
        the (local-spec) megatron names it reads: the embedding, each layer, the final norm with the head. A tied
        head reads the embedding again (a weight sync streams the units and holds one at a time)."""
        self.check_supported(hf_config)
        head = ("decoder.final_layernorm.",)
        if not hf_config.tie_word_embeddings:
            head += ("output_layer.",)
        elif include_tied_lm_head:
            head += ("embedding.",)
        return [("embedding", ("embedding.",)),
                *((f"layer {i}", (f"decoder.layers.{i}.",)) for i in range(hf_config.num_hidden_layers)),
                ("head", head)]

    def unit_to_hf(self, unit: str, sd: Mapping[str, torch.Tensor], hf_config, *,
                   include_tied_lm_head: bool = False, experts: range | None = None) -> dict[str, torch.Tensor]:
        """One unit of :meth:`hf_units` in HF names, from ``sd`` (local-spec names, holding at least its tensors);
        ``experts``: of a mixture's experts only these (an engine shard's; None: all)."""
        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ModelError(f"the megatron state dict has no '{name}': it does not come from a "
                                 f"{self.model_types[0]} model built from this config.json")
            return sd[name]

        if unit == "embedding":
            return {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")}
        if unit.startswith("layer "):
            i = int(unit.split()[1])
            return self.layer_to_hf(take, f"model.layers.{i}.", f"decoder.layers.{i}.", hf_config, experts)
        out = {"model.norm.weight": take("decoder.final_layernorm.weight")}
        if not hf_config.tie_word_embeddings:
            out["lm_head.weight"] = take("output_layer.weight")
        elif include_tied_lm_head:
            out["lm_head.weight"] = take("embedding.word_embeddings.weight")
        return out
