"""A tiny random Qwen3 with a locally trained tokenizer: the model every offline test and the
default config use (no weights can be downloaded here).

The directory it writes is a complete Hugging Face model dir, loadable with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` offline. The same
arguments always give the same bytes (weights from a private seeded generator, a deterministic
corpus, a deterministic BPE trainer), so the builder can be re-run instead of cached.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from runtime.storage import atomic_dir

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
UNK_TOKEN = "<unk>"

# Qwen-style chat template: what the real Qwen3 template renders for plain user/assistant turns.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2/3's pre-tokenizer split: a lone \p{N} alternative makes every digit its own pre-token, so
# BPE can never merge digits and each digit is exactly one token.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# 256 byte symbols + 3 specials + ~125 merges: small enough that a random model emits digits often.
DEFAULT_VOCAB_SIZE = 384
MAX_POSITIONS = 2048  # max_position_embeddings: a prompt and its response together

_WORDS = (
    "the answer is what plus minus times divided by sum of difference product number numbers "
    "solve compute find let x y equals total each if then so we have a an and or of to in is "
    "are how many apples books more less than twice half step reason final put your within "
    "boxed please question problem value integer positive negative result first second"
).split()


def builtin_corpus(seed: int = 0, n_lines: int = 3000) -> list[str]:
    """Deterministic training text: arithmetic Q/A lines, DAPO-style instructions, short words."""
    rng = random.Random(seed)
    lines: list[str] = []
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for i in range(n_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(sorted(ops))
        ans = ops[op](a, b)
        kind = i % 4
        if kind == 0:
            lines.append(f"What is {a} {op} {b}? Answer: {ans}")
        elif kind == 1:
            lines.append(
                f"Compute {a} {op} {b}. Please reason step by step, and put your final answer "
                f"within \\boxed{{}}. The answer is \\boxed{{{ans}}}."
            )
        elif kind == 2:
            lines.append(f"Question: what is the sum of {a} and {b}? Answer: {a + b}")
        else:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))) + ".")
    return lines


def _char_tokenizer(corpus: list[str]):
    """One token per character of the corpus (plus digits and newline), no merges.

    A vocab of ~56 means a random-init policy emits a digit about one token in six, so GRPO on the
    one-digit arithmetic task starts from a reward it can climb; a byte-level vocab of 384 left the
    reward at ~0 for dozens of rollouts (measured). Characters outside the alphabet become <unk>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set("".join(corpus)) | set("0123456789\n"))
    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + [UNK_TOKEN] + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return _pad_vocab(tok)


def _pad_vocab(tok):
    # Pad with reserved special tokens to a multiple of 8 so that every id the model can emit is a
    # real token (decode skips them) and the vocab splits evenly under tensor parallelism.
    n = tok.get_vocab_size(with_added_tokens=True)
    pad = (-n) % 8
    if pad:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(pad)])
    return tok


def _train_tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Byte-level: any text (LaTeX, unicode) encodes without an unknown token.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return _pad_vocab(tok)


def _write_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    common = {"eos_token": IM_END, "pad_token": PAD_TOKEN, "bos_token": None, "unk_token": None}
    tokenizer_config = {
        # The generic fast tokenizer loads tokenizer.json as written; a family class (Qwen2Tokenizer)
        # would rebuild the pipeline from vocab/merges in transformers 5.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        **common,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: v for k, v in common.items() if v is not None}, indent=2) + "\n"
    )


def _init_weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    """HF-style init (normal(0, initializer_range), norms 1) from a private generator: the global
    RNG is untouched and the bytes do not depend on transformers' own init code. A mixture of experts is
    written as the hub's checkpoints hold it: one tensor per expert and projection."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # what save_pretrained writes for tied embeddings
        if "norm" in name:
            out[name] = torch.ones(shapes[name], dtype=torch.float32)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shapes[name], dtype=torch.float32)
        else:
            out[name] = torch.empty(shapes[name], dtype=torch.float32).normal_(
                0.0, cfg.initializer_range, generator=g)
    for name in [n for n in out if n.endswith("mlp.experts.gate_up_proj")]:  # transformers' fused experts
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = out.pop(name), out.pop(prefix + "down_proj")
        gate, up = gate_up.chunk(2, dim=1)
        for e in range(gate_up.shape[0]):
            out.update({f"{prefix}{e}.gate_proj.weight": gate[e].clone(), f"{prefix}{e}.up_proj.weight": up[e].clone(),
                        f"{prefix}{e}.down_proj.weight": down[e].clone()})
    return out


def build_tiny_qwen3(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    ffn_hidden_size: int = 256,
    tie_word_embeddings: bool = True,
    corpus: list[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer: str = "chars",
    num_experts: int = 0,
    experts_per_token: int = 2,
    expert_ffn_size: int = 64,
) -> dict[str, Any]:
    """Write a random tiny Qwen3 HF model dir to ``out_dir`` (atomically); return
    ``{"path", "vocab_size", "n_params"}``. ``tokenizer``: "chars" (one token per character,
    ~56 tokens; the default, learnable from scratch) or "bpe" (byte-level BPE of ``vocab_size``).
    ``num_experts`` > 0: a Qwen3-MoE instead, every layer's MLP ``num_experts`` experts of ``expert_ffn_size``,
    ``experts_per_token`` routed per token (renormalised, as Qwen3-30B-A3B; load-balancing coefficient 0.001)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3Config, Qwen3MoeConfig

    text = corpus if corpus is not None else builtin_corpus(seed)
    tok = _char_tokenizer(text) if tokenizer == "chars" else _train_tokenizer(text, vocab_size)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    pad_id, eos_id = tok.token_to_id(PAD_TOKEN), tok.token_to_id(IM_END)
    moe = dict(num_experts=num_experts, num_experts_per_tok=experts_per_token, moe_intermediate_size=expert_ffn_size,
               norm_topk_prob=True, router_aux_loss_coef=0.001) if num_experts else {}
    cfg = (Qwen3MoeConfig if num_experts else Qwen3Config)(
        **moe,
        vocab_size=n_vocab,
        hidden_size=hidden_size,
        intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    cfg.architectures = ["Qwen3MoeForCausalLM" if num_experts else "Qwen3ForCausalLM"]
    weights = _init_weights(cfg, seed)
    gen = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, temperature=1.0,
                           top_p=1.0, top_k=0)

    with atomic_dir(out_dir) as tmp:
        cfg.save_pretrained(tmp)
        gen.save_pretrained(tmp)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_tokenizer(tok, tmp)
    return {
        "path": str(out_dir),
        "vocab_size": n_vocab,
        "n_params": sum(t.numel() for t in weights.values()),
    }
