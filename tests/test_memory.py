"""The per-GPU memory estimate (runtime/plan/memory.py) against its own arithmetic, the engine's KV policy,
and what was measured on an H100 (bench/memory_check.py, bench/gpu_grpo.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# torch.cuda.max_memory_allocated on an H100 80GB (torch 2.11, megatron-core 0.16.1), random
# Qwen3-0.6B shape, bf16, the CUDA path (SDPA attention, chunked log-probs, bf16 params + fp32 master).
# Activations of one micro-batch in a steady step (peak - allocated before), GiB, by
# (micro_batch, seq_len, response_len):
H100_ACTIVATIONS = {
    # bench/results/memory_check_H100_2026-11-22_fused.json (activation points; the trainer's CUDA
    # fusions on: RoPE, SwiGLU, bias-dropout-add, K/V not expanded for GQA)
    (1, 9216, 8192): 14.181, (2, 4608, 4096): 14.152, (4, 2304, 2048): 13.995, (16, 768, 683): 17.921,
    # bench/results/gpu_grpo_H100_2026-11-22_run7.json (trainer section: peak - the 9.99 GiB of weights,
    # fp32 grads, fp32 master and Adam moments)
    (16, 768, 512): 28.03 - 9.99, (32, 768, 512): 43.92 - 9.99,
}
# The shipped qwen3-0.6b-dapo config colocated in one process (bench/results/memory_check_H100_2026-11-22_fused.json):
# trainer + engine + one rollout (384 rows, 1024-token prompts, 8192 max new) + full-length optimizer steps
# at micro-batch 1.
H100_GIB = 79.1787109375
H100_DAPO = {"peak": 60.947, "kv_slots": 36, "kv_cache": 35.4375, "free_at_first_rollout": 71.059}
# bench/gpu_grpo.py's stage section (runtime.grpo.session.TrainSession, backend local): 16 prompts x 8 samples,
# 256 + 512 tokens, micro-batch 32 (run7)
H100_STAGE_PEAK = 55.53


@pytest.fixture(autouse=True)
def _production_paths(monkeypatch):
    """The estimate mirrors the trainer's switches: test the defaults."""
    monkeypatch.delenv("GRPOFLOW_CHUNKED_LOGPROBS", raising=False)
    monkeypatch.delenv("GRPOFLOW_MEGATRON_ATTENTION", raising=False)


def _qwen3_06b():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _glm_z1_9b():
    from transformers import Glm4Config

    # GLM-Z1-9B-0414's config.json
    return Glm4Config(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                      num_attention_heads=32, num_key_value_heads=2, head_dim=128, attention_bias=True,
                      partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=32768)


def _llama_known():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


# ---- arithmetic ------------------------------------------------------------------------------------------

def test_cpu_path_exact_arithmetic_on_a_known_config():
    from runtime.plan.memory import GIB, estimate_memory, param_counts

    cfg = _llama_known()
    # embeddings + lm_head 2*1000*64; per layer qkv 64*(4+2*2)*16, o 64*64, mlp 3*64*128, 2 norms; final norm
    layer = 64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    n = 2 * 1000 * 64 + 2 * layer + 64
    assert n == 202048 and param_counts(cfg) == (n, n)
    # tp=2 splits everything but the norms
    assert param_counts(cfg, tp=2) == (n, (n - 2 * 2 * 64 - 64) // 2 + 2 * 2 * 64 + 64)

    est = estimate_memory(cfg, tp=1, dp=1, micro_batch_size=2, seq_len=8, rollout_batch=4, max_new_tokens=4,
                          dtype="bfloat16", colocate=True, gpu_mem_gb=80, device="cpu")
    b = est["bytes"]
    assert (est["attention"], est["logprobs"], est["decode_path"]) == ("unfused", "full logits", "dynamic")
    assert (b["weights"], b["grads"], b["optimizer"], b["engine_weights"]) == (2 * n, 4 * n, 12 * n, 2 * n)
    # per token and layer: 2 pre-norms (12 B/unit), 2 norm outputs, q/k/v/context (4 x 64 units), SwiGLU (5 x 128), bf16
    per_token_layer = 2 * 12 * 64 + 2 * 2 * 64 + 4 * 2 * 64 + 5 * 2 * 128
    scores = 2 * 4 * 8 * 8 * (4 + 2)  # b * heads * s * s * (fp32 softmax + bf16 probs)
    logits = 2 * 8 * 1000 * 20
    assert per_token_layer == 3584 and b["activations"] == 2 * (2 * 8 * per_token_layer + scores) + logits == 440832
    kv = 4 * 8 * (2 * 2 * 2 * 16 * 2)  # rows * seq * (layers * k,v * kv heads * head dim * bf16)
    assert b["kv_cache"] == kv == 8192
    assert b["rollout_activations"] == kv // 2 + 4 * 1000 * 40  # one layer's concat copy + sampler temporaries
    # the slow path's dynamic cache lives for one generate call: the peak is the larger of the two phases
    assert b["total"] == 2 * n + 4 * n + 12 * n + 2 * n + max(440832, kv + b["rollout_activations"]) + GIB
    assert est["total"] == b["total"] / GIB and est["fits"] and est["reason"] is None

    apart = estimate_memory(cfg, tp=1, dp=1, micro_batch_size=2, seq_len=8, rollout_batch=4, max_new_tokens=4,
                            dtype="bfloat16", colocate=False, gpu_mem_gb=80, device="cpu")["bytes"]
    assert apart["trainer_total"] == 18 * n + 440832 + GIB and apart["rollout_total"] == 2 * n + kv + b["rollout_activations"] + GIB
    assert apart["total"] == max(apart["trainer_total"], apart["rollout_total"])
    # fp32 weights need no master copy
    assert estimate_memory(cfg, micro_batch_size=1, seq_len=8, rollout_batch=1, max_new_tokens=1,
                           dtype="float32")["bytes"]["optimizer"] == 8 * n


def test_cuda_layer_bytes_count_what_the_sdpa_layer_saves(monkeypatch):
    from runtime.plan.memory import layer_bytes_per_token

    h, q, kv, f = 1024, 2048, 1024, 3072
    # Qwen3-0.6B, bf16, the trainer's CUDA fusions on (the default): norm inputs + outputs 4h, fused qkv
    # (q+2kv) + q-norm input q, SDPA q, k at its own heads (v is a view of the fused qkv), out q, fused
    # SwiGLU's fc1 output 2f + product f (elements x 2 bytes); lse 4 B/head; rstd 4 B per normalised row
    stats = 4 * 16 + 4 * 2 + 4 * (16 + 8)
    expected = 2 * (4 * h + (q + 2 * kv) + q + q + kv + q + 3 * f) + stats
    assert layer_bytes_per_token(_qwen3_06b(), device="cuda") == expected == 49320
    # tensor parallelism splits the head and ffn parts, not the hidden-size ones
    assert layer_bytes_per_token(_qwen3_06b(), tp=2, device="cuda") == 2 * (
        4 * h + (q + 2 * kv) // 2 + q // 2 + q // 2 + kv // 2 + q // 2 + 3 * f // 2) + 4 * 8 + 8 + 4 * 12
    # fusions off: K/V copied to every head, a context copy, the unfused SwiGLU's silu output
    monkeypatch.setenv("GRPOFLOW_TRAINER_FUSIONS", "none")
    assert layer_bytes_per_token(_qwen3_06b(), device="cuda") == \
        2 * (4 * h + (q + 2 * kv) + q + 4 * q + q + 4 * f) + stats == 65704


def test_cuda_activations_grow_linearly_with_micro_batch_tokens(monkeypatch):
    from runtime.plan.memory import activation_terms

    cfg = _qwen3_06b()

    def act(b, s, device="cuda"):
        return activation_terms(cfg, tp=1, micro_batch_size=b, seq_len=s, response_len=s // 2, device=device)

    # no [heads, s, s] scores and no [b, s, vocab] logits on CUDA: linear in the micro-batch and in the length
    assert act(4, 9216)["attention_scores"] == 0
    a1, a2, a4 = (act(b, 4096)["total"] for b in (1, 2, 4))
    assert a4 - a2 == 2 * (a2 - a1) > 0
    s1, s2, s3 = (act(1, s)["total"] for s in (2048, 4096, 6144))
    assert s3 - 2 * s2 + s1 == 0 and s2 > s1
    # the log-prob head is mostly a constant ([vocab, hidden] gradients and one [2048, vocab] chunk), not b*s*vocab
    head = act(4, 9216)["logprob_head"]
    assert head < 2.5 * 2**30 < 4 * 9216 * 151936 * 4
    # CPU keeps megatron's unfused attention: quadratic in the length
    c1, c2, c3 = (act(1, s, "cpu")["total"] for s in (2048, 4096, 6144))
    assert c3 - 2 * c2 + c1 > 0 and act(1, 4096, "cpu")["attention_scores"] > 0
    # the trainer's switches are honoured (GRPOFLOW_MEGATRON_ATTENTION=local: megatron's unfused attention)
    monkeypatch.setenv("GRPOFLOW_MEGATRON_ATTENTION", "local")
    assert act(1, 4096)["attention_scores"] > 0


# ---- the KV cache is the engine's own policy --------------------------------------------------------------

def test_kv_term_equals_the_engines_policy():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from runtime.plan.memory import builtin_kv_cache
    from runtime.rollout.static_decode import StaticDecoder, kv_budget_bytes

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    per_slot = 128 * 2 * 2 * 2 * 8 * 4  # slot_len 100 -> 128; layers, k/v, kv heads, head dim, fp32
    # (kv_cache_gb, rows, max_slots) -> slots: budget-, rows- and max_slots-limited
    for gb, rows, max_slots, slots in ((per_slot * 5.5 / 1e9, 20, 16, 5), (1.0, 3, 16, 3), (1.0, 50, 7, 7)):
        dec = StaticDecoder(model, max_slots=max_slots, kv_cache_gb=gb, cuda_graphs=False, compile=False)
        dec._ensure_cache(40, 60, rows)
        est = builtin_kv_cache(cfg, slot_tokens=100, rows=rows, max_slots=max_slots, free_bytes=0, dtype="float32",
                               device="cpu", kv_cache_gb=gb)
        assert (dec.slots, dec.slot_len, dec.kv_cache_bytes()) == (est["slots"], est["slot_len"], est["bytes"]) \
            == (slots, 128, slots * per_slot)
        dec.release()
    # under one slot the engine refuses and the estimate says 0 slots
    dec = StaticDecoder(model, max_slots=4, kv_cache_gb=per_slot / 2e9, cuda_graphs=False, compile=False)
    with pytest.raises(MemoryError):
        dec._ensure_cache(40, 60, 4)
    assert builtin_kv_cache(cfg, slot_tokens=100, rows=4, max_slots=4, free_bytes=0, dtype="float32", device="cpu",
                            kv_cache_gb=per_slot / 2e9)["slots"] == 0
    # on CUDA without kv_cache_gb: half of what is free when the cache is made
    free = 10**9 + 12345
    assert kv_budget_bytes(None, "cuda", free, 0) == free // 2
    est = builtin_kv_cache(cfg, slot_tokens=100, rows=10**6, max_slots=10**6, free_bytes=free, dtype="float32")
    assert est["slots"] == (free // 2) // per_slot and est["budget"] == free // 2


def test_fast_path_is_chosen_per_family():
    from runtime.plan.memory import estimate_memory

    kw = dict(micro_batch_size=1, seq_len=2048, rollout_batch=64, max_new_tokens=1024)
    assert estimate_memory(_qwen3_06b(), **kw)["decode_path"] == "static"
    assert estimate_memory(_qwen3_06b(), device="cpu", **kw)["decode_path"] == "dynamic"
    assert estimate_memory(_glm_z1_9b(), tp=2, **kw)["decode_path"] == "dynamic"  # no fast path for GLM4


# ---- against the H100 --------------------------------------------------------------------------------------

def test_activations_are_within_5_percent_of_the_h100_measurements():
    from runtime.plan.memory import GIB, activation_bytes

    for (b, s, r), measured in H100_ACTIVATIONS.items():
        est = activation_bytes(_qwen3_06b(), tp=1, micro_batch_size=b, seq_len=s, response_len=r) / GIB
        assert abs(est / measured - 1) <= 0.05, (b, s, est, measured)


def test_qwen3_dapo_config_fits_80gib_and_matches_the_h100_peak():
    from runtime.config import load_config
    from runtime.plan.memory import estimate_for_config, format_estimate

    cfg = load_config(ROOT / "configs" / "qwen3-0.6b-dapo.yaml")
    est = estimate_for_config(cfg, _qwen3_06b(), gpu_mem_gb=80)
    assert est["fits"] and est["total"] < 80 and est["reason"] is None
    assert (est["decode_path"], est["attention"], est["logprobs"]) == ("static", "flash (SDPA)", "chunked")
    assert "36 slots x 9216 tokens" in format_estimate(est)
    # the H100's 79.18 GiB: the engine's KV slots exactly, the peak (max_memory_allocated) within 5%
    est = estimate_for_config(cfg, _qwen3_06b(), gpu_mem_gb=H100_GIB)
    assert est["kv_slots"] == H100_DAPO["kv_slots"] and abs(est["kv_cache"] - H100_DAPO["kv_cache"]) < 1e-3
    assert abs(est["kv"]["free"] / 2**30 / H100_DAPO["free_at_first_rollout"] - 1) <= 0.02
    peak = est["total"] - est["overhead"]  # max_memory_allocated has no CUDA context
    assert abs(peak / H100_DAPO["peak"] - 1) <= 0.05, peak


def test_qwen3_dapo_at_micro_batch_4_does_not_fit_and_says_which_does():
    from runtime.config import load_config
    from runtime.plan.memory import estimate_for_config, format_estimate

    # measured before the trainer's fusions: out of memory in the first micro-batch
    # (bench/results/memory_check_H100_2026-11-22_micro_batch4.json); with them a micro-batch takes ~14.2 GiB
    # at 9216 tokens, so 4 still does not fit and 2 would (not measured)
    cfg = load_config(ROOT / "configs" / "qwen3-0.6b-dapo.yaml", ["train.micro_batch_size=4"])
    est = estimate_for_config(cfg, _qwen3_06b(), gpu_mem_gb=80)
    assert not est["fits"] and est["fit_micro_batch"] == 2
    assert est["reason"].startswith(f"needs {est['total']:.1f} GiB per GPU but the GPU has 80; largest: ")
    assert "train.micro_batch_size=2" in est["reason"]
    text = format_estimate(est)
    for word in ("weights", "gradients", "optimizer", "activations", "KV cache", "DOES NOT FIT"):
        assert word in text


def test_colocated_stage_matches_the_h100_peak():
    from runtime.plan.memory import estimate_memory

    est = estimate_memory(_qwen3_06b(), micro_batch_size=32, seq_len=256 + 512, rollout_batch=128, max_slots=128,
                          max_new_tokens=512, gpu_mem_gb=H100_GIB, global_batch_size=128)
    assert est["fits"] and est["kv_slots"] == 128  # every row gets a slot: the budget is far above 128 x 768 tokens
    assert abs((est["total"] - est["overhead"]) / H100_STAGE_PEAK - 1) <= 0.05


def test_glm_z1_9b_at_its_shipped_layout_does_not_fit_80gib():
    from runtime.config import load_config
    from runtime.plan.memory import GIB, estimate_for_config, param_counts

    cfg = load_config(ROOT / "configs" / "glm-z1-9b-dapo.yaml")
    glm = _glm_z1_9b()
    assert (cfg.train.tensor_parallel, cfg.cluster.colocate) == (2, True)
    est = estimate_for_config(cfg, glm, gpu_mem_gb=80)
    # 2 key-value heads: TP 2 is the most megatron allows; the optimizer is not sharded over data parallelism,
    # so every GPU holds half the model's bf16 weights, fp32 grads, fp32 master and Adam moments: 18 B/param
    assert est["max_tp"] == 2 and est["params_per_gpu"] == param_counts(glm, 2)[1]
    state = est["bytes"]["weights"] + est["bytes"]["grads"] + est["bytes"]["optimizer"]
    assert state == 18 * est["params_per_gpu"] and state / GIB > 78
    assert not est["fits"] and est["fit_micro_batch"] == 0
    assert "tensor_parallel=2, this model's limit" in est["reason"]
    # not an activation problem: even one 1024-token sample does not fit beside that state
    short = estimate_for_config(load_config(ROOT / "configs" / "glm-z1-9b-dapo.yaml", ["rollout.max_new_tokens=1"]),
                                glm, gpu_mem_gb=80)
    assert not short["fits"]


def test_errors():
    from runtime.plan.memory import estimate_memory

    cfg = _qwen3_06b()
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide"):
        estimate_memory(cfg, tp=3, micro_batch_size=1, seq_len=8, rollout_batch=1, max_new_tokens=1)
    with pytest.raises(ValueError, match="must be >= max_new_tokens"):
        estimate_memory(cfg, micro_batch_size=1, seq_len=8, rollout_batch=1, max_new_tokens=9)
    with pytest.raises(ValueError, match="device must be"):
        estimate_memory(cfg, micro_batch_size=1, seq_len=8, rollout_batch=1, max_new_tokens=1, device="tpu")
