"""LoRA in the config and the memory plan: train.lora's checks (SGLang refused in one line, the LoRA
learning-rate default), the plan's terms against their arithmetic (frozen base, adapter state, the shared base
counted once, the frozen output layer's head), the 32 GB GLM-Z1-9B config, and what `validate` says at 24 GB."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_memory import _glm_z1_9b, _qwen3_06b

ROOT = Path(__file__).resolve().parents[1]
LORA_32GB = ROOT / "configs" / "glm-z1-9b-dapo-lora-32gb.yaml"


def test_lora_config_checks():
    from runtime.config import LORA_DEFAULT_LR, config_from_dict
    from runtime.errors import ConfigError
    on = {"enabled": True}
    assert config_from_dict({"train": {"lora": on}}).train.lr == LORA_DEFAULT_LR  # lr unset: LoRA's default
    assert config_from_dict({"train": {"lr": 3e-4, "lora": on}}).train.lr == 3e-4
    assert config_from_dict({"train": {}}).train.lr == 1e-3  # the full-parameter default stays
    for tree, words in (({"rollout": {"engine": "sglang"}}, "not wired to SGLang"),
                        ({"rollout": {"decode_path": "hf"}}, "rollout.decode_path: auto"),
                        ({"train": {"lora": {**on, "target_modules": ["q_proj"]}}}, "target_modules"),
                        ({"train": {"lora": {**on, "rank": 0}}}, "rank")):
        tree = {**tree, "train": {"lora": on, **tree.get("train", {})}}
        with pytest.raises(ConfigError, match=words) as e:
            config_from_dict(tree)
        assert "\n" not in str(e.value)


def _estimate(hf_config, **kw):
    from runtime.plan.memory import estimate_memory
    base = dict(micro_batch_size=1, seq_len=2048, rollout_batch=64, max_new_tokens=1024, kv_cache_gb=4.0,
                max_tokens=4096)
    return estimate_memory(hf_config, **{**base, **kw})


def test_lora_terms_against_their_arithmetic():
    from runtime.plan.memory import param_counts
    glm = _glm_z1_9b()
    r, L, h, f = 32, 40, 4096, 13696
    q, kv = 32 * 128, 2 * 128
    per_layer = r * ((h + q + 2 * kv) + (q + h) + (h + 2 * f) + (f + h))
    adapters = L * per_layer
    lora = {"rank": r, "targets": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), "dropout": 0.0}
    n = param_counts(glm)[0]
    full = _estimate(glm)
    shared = _estimate(glm, lora=lora, shared_base=True, ref_model=True)
    own = _estimate(glm, lora=lora, shared_base=False)
    b = shared["bytes"]
    assert shared["lora"]["params"] == adapters == shared["lora"]["params_per_gpu"]
    # the frozen bf16 base and the adapters; no reference copy although kl_coef > 0 (adapters off)
    assert b["weights"] == 2 * (n + adapters)
    assert b["grads"] == 4 * adapters and b["optimizer"] == 12 * adapters  # fp32 grads, master, Adam m + v
    assert b["engine_weights"] == 2 * adapters  # shared: the adapters' buffers only
    assert own["bytes"]["engine_weights"] == 2 * (n + adapters)  # its own base as well
    assert full["bytes"]["engine_weights"] == 2 * n and full["bytes"]["grads"] == 4 * n
    # the frozen output layer: the chunked head keeps no fp32 [vocab, hidden] weight-gradient accumulator
    assert full["bytes"]["act_logprob_head"] - b["act_logprob_head"] == 151552 * h * 10
    # each linear's [tokens, r] hidden, one [tokens, ffn] at a time (fc2's input gradient through A beside the base's;
    # fc1's addmm result beside its output) and the embedding's gradient
    assert b["act_lora"] == 40 * 4096 * 4 * r * 2 + 4096 * (f + h) * 2
    # dropout: each linear's dropped input and mask saved; the mask's draw (fp32 + bool, 5 bytes) over fc2's input
    dropped = _estimate(glm, lora={**lora, "dropout": 0.1}, shared_base=True)["bytes"]["act_lora"]
    assert dropped == 40 * 4096 * (4 * r * 2 + 2 * 2 * (h + q + h + f)) + 4096 * (5 * f + 2 * h)
    # tensor parallelism 2: column-parallel B and row-parallel A are halved
    tp2 = _estimate(glm, lora=lora, tp=2)
    assert tp2["lora"]["params_per_gpu"] == L * r * ((h + (q + 2 * kv) // 2) + (q // 2 + h) + (h + f) + (f // 2 + h))


def test_the_32gb_config_fits_and_24gb_says_what_it_would_need(capsys):
    from cli.main import main
    from runtime.config import load_config
    from runtime.plan.memory import estimate_for_config
    cfg = load_config(LORA_32GB)
    r = cfg.rollout
    assert (r.rollout_batch_size, r.n_samples_per_prompt, cfg.data.max_prompt_len, r.max_new_tokens) == (16, 8, 1024, 8192)
    assert cfg.train.lora.enabled and "aime-2024" in cfg.data.eval
    est = estimate_for_config(cfg, _glm_z1_9b())
    assert est["fits"] and est["shared_base"] and est["gpu_mem_gb"] == 32 and est["kv_slots"] >= 8
    # the host holds the adapters' offloaded state only (the frozen base has none): ~1.3 GiB, not a 9B model's 105
    assert est["host"]["pinned"] < 2.0
    assert main(["validate", str(LORA_32GB)]) == 0
    out = capsys.readouterr().out
    assert "lora          rank 32" in out and "the engine decodes with the trainer's base (one copy)" in out
    assert main(["validate", str(LORA_32GB), "--gpu-mem-gb", "24"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "LoRA keeps the frozen bfloat16 base (17.5 GiB) once" in err
    assert "still needs 25.4 GiB" in err and "a quantized base is not supported" in err
    # 0.6 GiB of it is train.deterministic's: the flash backward's dQ buffers for one 9216-token sample, 32 heads
    assert main(["validate", str(LORA_32GB), "--gpu-mem-gb", "24", "--set", "train.deterministic=false"]) == 2
    assert "still needs 24.8 GiB" in capsys.readouterr().err


def test_qwen3_lora_plan_is_below_the_full_parameter_one():
    from runtime.config import load_config
    from runtime.plan.memory import estimate_for_config
    q = _qwen3_06b()
    full = estimate_for_config(load_config(ROOT / "configs" / "qwen3-0.6b-dapo-24gb.yaml", ["rollout.kv_cache_gb=10"]), q)
    lora = estimate_for_config(load_config(ROOT / "configs" / "qwen3-0.6b-dapo-24gb.yaml",
                                           ["rollout.kv_cache_gb=10", "train.lora.enabled=true"]), q)
    assert lora["fits"] and lora["shared_base"]
    assert full["total"] - lora["total"] > full["engine_weights"] - 0.1  # at least the engine's copy of the base
