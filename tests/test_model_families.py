"""GLM4, LLaMA, Qwen2 and Qwen3-MoE families: tiny random models built from the transformers config classes,
converted HF -> torch_dist (fp32 logit parity with HF eager <= 1e-4) and back (bitwise), then one
GRPO rollout through the megatron trainer and the built-in engine.

Norm weights and biases are randomised (HF initialises them to 1 and 0) so that a swapped or
dropped tensor shows in the logits.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime.errors import ModelError
from runtime.models import get_adapter, load_hf_config, supported_model_types
from runtime.models.glm4 import Glm4Adapter
from runtime.models.tiny import build_tiny_qwen3

TOL = 1e-4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOS_ID, PAD_ID = 2, 0  # the tiny tokenizer's <|im_end|> and <|endoftext|>

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
GLM4_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           router_aux_loss_coef=0.01, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

# name -> (transformers config class name, extra config kwargs)
VARIANTS = {
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen2_untied": ("Qwen2Config", dict(tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_tied_llama3_rope": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE,
                                                   max_position_embeddings=16384)),
    "llama_untied": ("LlamaConfig", dict(tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "glm4_untied": ("Glm4Config", dict(tie_word_embeddings=False, attention_bias=True, rope_parameters=GLM4_ROPE)),
    "glm4_tied": ("Glm4Config", dict(tie_word_embeddings=True, attention_bias=True, rope_parameters=GLM4_ROPE)),
    # both routers: top-k of the softmax renormalised (norm_topk_prob, Qwen3-30B-A3B's) and as it is
    "qwen3_moe_untied": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, **MOE)),
    "qwen3_moe_tied": ("Qwen3MoeConfig", dict(tie_word_embeddings=True, **dict(MOE, norm_topk_prob=False))),
}
ROLLOUT_VARIANTS = ("qwen2_untied", "llama_tied_llama3_rope", "glm4_untied", "qwen3_moe_untied")


def build_tiny_family_model(path: Path, config_class: str, vocab_size: int, tokenizer_dir: Path, seed: int = 0,
                            **overrides) -> Path:
    """A 2-layer random HF model of one family with the tiny tokenizer; norms ~N(1, 0.2), biases ~N(0, 0.1)."""
    import transformers
    from transformers import AutoModelForCausalLM

    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  max_position_embeddings=2048, initializer_range=0.1, hidden_act="silu",
                  eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None, dtype="float32")
    kwargs.update(overrides)
    cfg = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / f, path / f)
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def tokenizer(work):
    info = build_tiny_qwen3(work / "tokenizer_src", seed=0)
    return Path(info["path"]), info["vocab_size"]


@pytest.fixture(scope="module")
def hf_dirs(work, tokenizer):
    tok_dir, vocab = tokenizer
    return {name: build_tiny_family_model(work / f"{name}_hf", cls, vocab, tok_dir, seed=i, **kw)
            for i, (name, (cls, kw)) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="module")
def converted(work, hf_dirs):
    """Every variant converted once: name -> (hf_dir, torch_dist_dir, parity report)."""
    from runtime.mcore.convert import hf_to_torch_dist

    out = {}
    for name, hf_dir in hf_dirs.items():
        td = work / f"{name}_torch_dist"
        out[name] = (hf_dir, td, hf_to_torch_dist(hf_dir, td, tolerance=TOL))
    return out


# ---- parity and round trip ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logit_parity_with_hf(converted, name):
    from runtime.mcore.convert import hf_logits, load_torch_dist_into, mcore_logits, probe_batch
    from runtime.mcore.env import build_gpt_model

    hf_dir, td, report = converted[name]
    print(f"{name}: max |logit diff| {report['max_abs_logit_diff']:.3e} "
          f"(max |logit| {report['max_abs_logit']:.2f})")
    assert report["max_abs_logit_diff"] <= TOL
    assert report["model_type"] == ("qwen3_moe" if name.startswith("qwen3_moe") else name.split("_")[0])
    assert report["tie_word_embeddings"] == ("_tied" in name)
    assert report["max_abs_logit"] > 1000 * TOL  # the logits are not trivially ~0
    # a fresh model from the saved checkpoint, on a longer probe
    cfg = load_hf_config(hf_dir)
    model = build_gpt_model(cfg, init_weights=False).eval()
    load_torch_dist_into(model, td)
    ids = probe_batch(cfg.vocab_size, (1, 96), seed=3)
    assert (mcore_logits(model, ids) - hf_logits(hf_dir, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("name", list(VARIANTS))
def test_round_trip_is_bitwise(converted, work, name):
    from safetensors.torch import load_file

    from runtime.mcore.convert import torch_dist_to_hf

    hf_dir, td, _ = converted[name]
    out = work / f"{name}_export"
    torch_dist_to_hf(td, hf_dir, out)
    assert (out / "model.safetensors").read_bytes() == (hf_dir / "model.safetensors").read_bytes()
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) == ("_untied" in name)
    for f in ("config.json",) + TOKENIZER_FILES:
        assert (out / f).read_bytes() == (hf_dir / f).read_bytes()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_from_hf_to_hf_is_exact_and_uses_every_tensor(hf_dirs, name):
    from runtime.mcore.convert import load_hf_state_dict

    cfg = load_hf_config(hf_dirs[name])
    hf = load_hf_state_dict(hf_dirs[name])
    adapter = get_adapter(cfg)
    back = adapter.to_hf(adapter.from_hf(hf, cfg), cfg)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


# ---- what each family maps ------------------------------------------------------------------------
def test_config_mapping_per_family(hf_dirs):
    glm = load_hf_config(hf_dirs["glm4_untied"])
    a = get_adapter(glm)
    tc, gk = a.transformer_config_kwargs(glm), a.gpt_model_kwargs(glm)
    assert (tc["rotary_interleaved"], tc["add_qkv_bias"], tc["qk_layernorm"]) == (True, True, False)
    assert (gk["rotary_percent"], gk["rotary_base"], gk["share_embeddings_and_output_weights"]) == (0.5, 10000.0, False)
    assert a.layer_spec(glm).module.__name__ == "Glm4TransformerLayer"

    qwen2 = load_hf_config(hf_dirs["qwen2_tied"])
    a = get_adapter(qwen2)
    tc, gk = a.transformer_config_kwargs(qwen2), a.gpt_model_kwargs(qwen2)
    assert (tc["add_qkv_bias"], tc["rotary_interleaved"], tc["qk_layernorm"]) == (True, False, False)
    assert (gk["rotary_percent"], gk["share_embeddings_and_output_weights"]) == (1.0, True)
    assert a.layer_spec(qwen2).module.__name__ == "TransformerLayer"

    llama = load_hf_config(hf_dirs["llama_tied_llama3_rope"])
    a = get_adapter(llama)
    tc, gk = a.transformer_config_kwargs(llama), a.gpt_model_kwargs(llama)
    assert tc["add_qkv_bias"] is False
    assert (gk["rope_scaling"], gk["rope_scaling_factor"], gk["rotary_base"]) == (True, 32.0, 500000.0)
    assert "rope_scaling" not in get_adapter("llama").gpt_model_kwargs(load_hf_config(hf_dirs["llama_untied"]))


@pytest.mark.parametrize("name", ["llama_tied_llama3_rope", "glm4_untied", "qwen2_tied"])
def test_rotary_frequencies_equal_hf(hf_dirs, name):
    """The RoPE inverse frequencies megatron builds are HF's (llama3 scaling, GLM4's partial dims):
    a short probe barely exercises the low frequencies that llama3 scaling changes."""
    from transformers import AutoModelForCausalLM

    from runtime.mcore.env import build_gpt_model

    cfg = load_hf_config(hf_dirs[name])
    hf = AutoModelForCausalLM.from_pretrained(hf_dirs[name], dtype=torch.float32)
    ours = build_gpt_model(cfg, init_weights=False).rotary_pos_emb.inv_freq.cpu()
    ref = hf.model.rotary_emb.inv_freq
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    if name.startswith("glm4"):
        assert ours.numel() * 2 == 8  # half of head_dim 16 is rotated


def _swap_post_norms(out):
    for i in range(2):
        a, b = f"decoder.layers.{i}.post_self_attn_layernorm.weight", f"decoder.layers.{i}.post_mlp_layernorm.weight"
        out[a], out[b] = out[b], out[a]


def test_a_wrong_glm4_mapping_fails_parity(hf_dirs, work, monkeypatch):
    """Swapped post-norms, or rotate-half instead of interleaved RoPE, are caught by the parity check."""
    from runtime.mcore.convert import hf_to_torch_dist

    original = Glm4Adapter.from_hf

    def wrong_from_hf(self, hf_state_dict, hf_config):
        out = original(self, hf_state_dict, hf_config)
        _swap_post_norms(out)
        return out

    with monkeypatch.context() as m:
        m.setattr(Glm4Adapter, "from_hf", wrong_from_hf)
        with pytest.raises(ModelError, match=r"max \|logit diff\| .* > tolerance 0\.0001"):
            hf_to_torch_dist(hf_dirs["glm4_untied"], work / "glm4_wrong_norms", tolerance=TOL)
    with monkeypatch.context() as m:
        m.setattr(Glm4Adapter, "rotary_interleaved", False)
        m.setattr(Glm4Adapter, "check_rope", lambda self, cfg, name: None)
        with pytest.raises(ModelError, match=r"max \|logit diff\| .* > tolerance 0\.0001"):
            hf_to_torch_dist(hf_dirs["glm4_untied"], work / "glm4_wrong_rope", tolerance=TOL)
    assert not (work / "glm4_wrong_norms").exists() and not (work / "glm4_wrong_rope").exists()


def test_a_wrong_moe_router_fails_parity(hf_dirs, work, monkeypatch):
    """The other norm_topk_prob semantics (top-k weights renormalised or not) is caught by the parity check."""
    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models.qwen3_moe import Qwen3MoeAdapter

    original = Qwen3MoeAdapter.transformer_config_kwargs

    def flipped(self, hf_config):
        kwargs = original(self, hf_config)
        return dict(kwargs, moe_router_pre_softmax=not kwargs["moe_router_pre_softmax"])

    monkeypatch.setattr(Qwen3MoeAdapter, "transformer_config_kwargs", flipped)
    with pytest.raises(ModelError, match=r"max \|logit diff\| .* > tolerance 0\.0001"):
        hf_to_torch_dist(hf_dirs["qwen3_moe_untied"], work / "moe_wrong_router", tolerance=TOL)
    assert not (work / "moe_wrong_router").exists()


def test_unmappable_configs_are_refused(hf_dirs):
    llama = load_hf_config(hf_dirs["llama_untied"])
    a = get_adapter(llama)
    for field, match in (("attention_bias", "attention_bias=true"), ("mlp_bias", "mlp_bias=true")):
        setattr(llama, field, True)
        with pytest.raises(ModelError, match=match):
            a.transformer_config_kwargs(llama)
        setattr(llama, field, False)
    llama.rope_parameters = dict(LLAMA3_ROPE, low_freq_factor=2.0)
    with pytest.raises(ModelError, match="low_freq_factor=2.0 is not supported"):
        a.gpt_model_kwargs(llama)
    llama.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ModelError, match="rope_type 'yarn'"):
        a.gpt_model_kwargs(llama)
    llama.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ModelError, match="partial_rotary_factor 0.5 is not supported for llama"):
        a.gpt_model_kwargs(llama)

    qwen2 = load_hf_config(hf_dirs["qwen2_untied"])
    qwen2.use_sliding_window = True
    with pytest.raises(ModelError, match="use_sliding_window=true"):
        get_adapter(qwen2).transformer_config_kwargs(qwen2)

    moe = load_hf_config(hf_dirs["qwen3_moe_untied"])
    moe.mlp_only_layers = [1]
    with pytest.raises(ModelError, match="mlp_only_layers=\\[1\\]: dense MLP layers between the MoE layers"):
        get_adapter(moe).transformer_config_kwargs(moe)

    glm = load_hf_config(hf_dirs["glm4_untied"])
    glm.rope_parameters = dict(GLM4_ROPE, partial_rotary_factor=0.3)
    with pytest.raises(ModelError, match="must rotate an even number"):
        get_adapter(glm).gpt_model_kwargs(glm)


def test_unsupported_architecture_names_the_supported_ones(work):
    assert supported_model_types() == ["glm4", "llama", "qwen2", "qwen3", "qwen3_moe"]
    d = work / "gpt2_dir"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ModelError) as e:
        load_hf_config(d)
    assert str(e.value) == ("model_type 'gpt2' is not supported (supported: glm4, llama, qwen2, qwen3, qwen3_moe); "
                            "add a family in runtime/models/ (see docs/model-families.md)")
    assert Path(__file__).resolve().parents[1].joinpath("docs", "model-families.md").is_file()


# ---- one GRPO rollout: engine -> trainer -> engine ------------------------------------------------
@pytest.mark.parametrize("name", ROLLOUT_VARIANTS)
def test_one_grpo_rollout_with_trainer_and_builtin_engine(converted, name):
    from runtime.config import GrpoConfig
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.trainer.batch import TrainBatch
    from runtime.trainer.megatron_trainer import MegatronTrainer

    hf_dir, td, _ = converted[name]
    cfg = GrpoConfig()
    trainer = MegatronTrainer(hf_dir=str(hf_dir), init_checkpoint=str(td), train=cfg.train,
                              algorithm=cfg.algorithm, temperature=1.0)
    engine = BuiltinEngine(str(hf_dir))
    try:
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in ("What is 2 + 3?", "Compute 7 * 6.")]
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        n = 4
        requests = [SampleRequest(prompt_ids=prompt_ids[p], key=(0, 0, p, s)) for p in range(2) for s in range(n)]
        results = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=8))
        assert all(r.response_ids for r in results)
        # a fixed advantage pattern (+1, -1 alternating within each group): the update is not zero
        batch = TrainBatch(
            tokens=[r.prompt_ids + r.response_ids for r in results],
            prompt_lens=[len(r.prompt_ids) for r in results],
            advantages=[1.0 if i % 2 == 0 else -1.0 for i in range(len(results))],
            loss_masks=[r.effective_loss_mask() for r in results],
            rollout_logprobs=[r.response_logprobs for r in results])
        # same weights on both sides: the trainer's log-probs are the engine's
        before = trainer.compute_logprobs(batch)
        for got, r in zip(before, results):
            assert max(abs(a - b) for a, b in zip(got, r.response_logprobs)) <= TOL
        metrics = trainer.train(batch)
        assert metrics["train_tokens"] == batch.response_token_count()
        assert metrics["train_rollout_logp_absdiff"] <= TOL
        if name.startswith("qwen3_moe"):  # the load-balancing loss: 1 at perfect balance, up to E / top-k
            assert 1.0 <= metrics["router_aux_loss"] <= 2.0 and "router_z_loss" not in metrics
        engine.update_weights(trainer.hf_weights(), version=1)
        assert engine.weight_version == 1
        after = trainer.compute_logprobs(batch)
        moved = 0.0
        for i, r in enumerate(results):
            ours = engine.logprobs_of(r.prompt_ids, r.response_ids)
            assert max(abs(a - b) for a, b in zip(ours, after[i])) <= TOL
            moved = max(moved, max(abs(a - b) for a, b in zip(after[i], before[i])))
        assert moved > 1e-3  # the weights really changed
    finally:
        engine.shutdown()


# ---- memory estimate (the rest is in tests/test_memory.py) ---------------------------------------
@pytest.mark.parametrize("name", ["qwen2_tied", "llama_untied", "glm4_untied", "qwen3_moe_untied"])
def test_param_count_matches_hf(hf_dirs, name):
    from transformers import AutoModelForCausalLM

    from runtime.plan.memory import param_counts

    cfg = load_hf_config(hf_dirs[name])
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    assert param_counts(cfg)[0] == sum(p.numel() for p in hf.parameters())  # tied: counted once


def test_qwen3_30b_a3b_shipped_config_counts_its_parameters():
    """30.5 B parameters, as Qwen publishes, and the experts split over tensor parallelism, the router not."""
    from runtime.plan.memory import param_counts
    from runtime.plan.summary import KNOWN_CONFIGS
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig.from_json_file(str(KNOWN_CONFIGS / "Qwen3-30B-A3B.json"))
    n, per_rank = param_counts(cfg, tp=2)
    assert 30.4e9 < n < 30.6e9
    router = 48 * 128 * 2048
    assert per_rank - router - 48 * (2 * 2048 + 2 * 128) - 2048 == (n - router - 48 * (2 * 2048 + 2 * 128) - 2048) // 2


def test_glm_z1_9b_config_and_its_estimate():
    from transformers import Glm4Config

    from runtime.config import load_config
    from runtime.plan.memory import estimate_for_config, param_counts

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "glm-z1-9b-dapo.yaml")
    r, t = cfg.rollout, cfg.train
    assert (r.rollout_batch_size, r.n_samples_per_prompt, t.global_batch_size, t.num_steps_per_rollout) == (16, 8, 128, 1)
    assert cfg.data.train.format == "dapo" and list(cfg.data.eval) == ["aime-2024"]
    # GLM-Z1-9B-0414's config.json
    glm = Glm4Config(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=2, head_dim=128, attention_bias=True,
                     partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     max_position_embeddings=32768)
    n = param_counts(glm)[0]
    assert 9.3e9 < n < 9.5e9
    est = estimate_for_config(cfg, glm, gpu_mem_gb=80)
    assert est["tp"] == t.tensor_parallel and est["params_per_gpu"] < n
    assert est["fits"] is (est["total"] <= 80)


# ---- the built-in engine's paged fast path: every family draws the HF path's tokens -------------------------
@pytest.mark.parametrize("name", ["glm4_untied", "glm4_tied", "qwen2_untied", "llama_tied_llama3_rope",
                                  "qwen3_moe_untied"])
def test_paged_fast_path_draws_the_hf_paths_tokens(hf_dirs, name):
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.rollout.decode_model import unsupported_reason
    from runtime.rollout.kv_pages import kv_bytes_per_token

    hf = BuiltinEngine(str(hf_dirs[name]), decode_path="hf")
    reason = unsupported_reason(hf.model)
    if name.startswith("llama_tied_llama3"):  # llama3 RoPE scaling: the HF path only, said in one line
        assert reason and "rope_type 'llama3'" in reason
        return
    assert reason is None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    # groups of 3 share a prompt; 4 rows for 12 requests (continuous batching)
    reqs = [SampleRequest(prompt_ids=prompts[i // 3], key=(5, 1, i // 3, i % 3)) for i in range(12)]
    per_page = 4 * kv_bytes_per_token(hf.model.config, "float32")
    # 4 rows for 12 requests; then 12 pages of 4 tokens for 6 rows: rows are preempted and continued
    for rows, pages, new in ((4, None, 12), (6, 12, 20)):
        paged = BuiltinEngine(str(hf_dirs[name]), decode_path="paged", max_batch_size=rows, page_size=4,
                              kv_cache_gb=None if pages is None else pages * per_page / 2**30)
        preempted = 0
        for sp in (SamplingParams(max_new_tokens=new), SamplingParams(temperature=0.7, top_k=20, max_new_tokens=new)):
            a, b = hf.generate(reqs, sp), paged.generate(reqs, sp)
            preempted += paged.decoder.stats["preemptions"]
            assert [r.response_ids for r in a] == [r.response_ids for r in b]
            assert max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.response_logprobs, y.response_logprobs)) < 1e-4
        assert paged.decoder.pool.used == 0
        assert (preempted > 0) == (pages is not None), preempted


# ---- a mixture of experts: the router's loss, and a resumed trainer ------------------------------------------
def _moe_batch(vocab: int, seed: int, routes: bool = False):
    """8 random samples; ``routes``: each token's 2 of 4 experts drawn at random, as the engine's (R3) would come."""
    from runtime.trainer.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, vocab, (int(torch.randint(8, 16, (1,), generator=g)),), generator=g).tolist()
              for _ in range(8)]
    recorded = [torch.rand(len(t) - 1, 2, 4, generator=g).argsort(-1)[..., :2].to(torch.uint8) for t in tokens]
    return TrainBatch(tokens=tokens, prompt_lens=[4] * 8, advantages=[(-1.0) ** i for i in range(8)],
                      loss_masks=[[1] * (len(t) - 4) for t in tokens],
                      rollout_logprobs=[[-1.0] * (len(t) - 4) for t in tokens], routes=recorded if routes else None)


def test_moe_trainer_resumes_bitwise_and_the_router_losses_train(converted, tmp_path):
    """Two updates unbroken against one, a checkpoint, a new trainer loading it and the second: the same weights
    bit for bit (experts, router, their optimizer state), the second update replaying recorded routes (R3; with several
    trainers in the process each replays into its own routers, none left on megatron's process-wide list). With the z-loss
    on, it is reported and moves the router differently (it is in the gradient)."""
    from runtime.config import GrpoConfig
    from runtime.trainer.megatron_trainer import MegatronTrainer

    hf_dir, td, _ = converted["qwen3_moe_untied"]
    vocab = load_hf_config(hf_dir).vocab_size
    batches = [_moe_batch(vocab, 0), _moe_batch(vocab, 1, routes=True)]

    def trainer(**train):
        cfg = GrpoConfig()
        t = cfg.train.model_copy(update=dict(micro_batch_size=4, global_batch_size=8, **train))
        return MegatronTrainer(hf_dir=str(hf_dir), init_checkpoint=str(td), train=t, algorithm=cfg.algorithm,
                               temperature=1.0)

    unbroken = trainer()
    for b in batches:
        unbroken.train(b)
    first = trainer()
    first.train(batches[0])
    first.save(str(tmp_path / "ckpt"))
    resumed = trainer()
    resumed.load(str(tmp_path / "ckpt"))
    resumed.train(batches[1])
    want, got = unbroken.hf_weights(), resumed.hf_weights()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    from dataclasses import replace

    from megatron.core.transformer.moe.router_replay import RouterReplay
    assert RouterReplay.global_router_replay_instances == []
    own = replace(batches[1], routes=None)  # the random routes are not the trainer's own: replaying them shows
    assert resumed.compute_logprobs(batches[1]) != resumed.compute_logprobs(own)

    router = "model.layers.0.mlp.gate.weight"
    z = trainer(router_z_loss_coef=0.1)
    metrics = z.train(batches[0])
    assert metrics["router_z_loss"] > 0 and metrics["router_aux_loss"] >= 1.0
    assert not torch.equal(z.hf_weights()[router], first.hf_weights()[router])
    assert "router_z_loss" not in trainer().train(batches[0])  # the process's tracker still has the name


@pytest.mark.parametrize("name", ["qwen3_moe_untied", "qwen3_moe_tied"])
def test_the_engines_moe_forward_is_hfs(hf_dirs, name):
    """The engine's forward (routing with and without norm_topk_prob, grouped expert GEMMs) gives HF's logits, and
    a weight update by the hub's per-expert names lands in transformers' fused experts that it reads."""
    from transformers import AutoModelForCausalLM

    from runtime.rollout.decode_model import FusedModel
    from runtime.rollout.hf_weights import update_targets

    hf = AutoModelForCausalLM.from_pretrained(hf_dirs[name], dtype=torch.float32).eval()
    ids = torch.randint(3, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
    fused = FusedModel(hf, compile=False)
    assert (fused.sequence_logits(ids) - want).abs().max().item() <= 1e-5
    targets = update_targets(hf)
    down = "model.layers.1.mlp.experts.2.down_proj.weight"
    with torch.no_grad():
        targets[down].mul_(-1.0)
    assert torch.equal(hf.model.layers[1].mlp.experts.down_proj[2], targets[down])
    assert (fused.sequence_logits(ids) - want).abs().max().item() > 1e-3


def _broadcast_checkpoint(hf_dir: str, port: int) -> None:
    """A trainer rank 0's side of the weight sync, in a process of its own: the checkpoint's tensors by its names."""
    from runtime.mcore.convert import load_hf_state_dict
    from runtime.placement import weight_sync
    group = weight_sync.init_group("127.0.0.1", port, 0, 2, group_name="moe_bcast")
    weight_sync.send(group, load_hf_state_dict(hf_dir), "cpu")
    weight_sync.destroy_group(group)


def test_a_broadcast_by_the_hubs_expert_names_lands_in_the_engines_fused_experts(hf_dirs):
    """The trainer broadcasts a checkpoint's names (one tensor per expert); each lands in its block of the engine's
    fused expert weights, the parameters it decodes with (not replaced by new tensors)."""
    import multiprocessing

    from runtime.mcore.convert import load_hf_state_dict
    from runtime.placement import weight_sync
    from runtime.placement.ports import free_port
    from runtime.rollout.builtin import BuiltinEngine

    engine = BuiltinEngine(str(hf_dirs["qwen3_moe_untied"]))
    experts = engine.model.model.layers[1].mlp.experts
    fused_ptr = experts.gate_up_proj.data_ptr()
    sent = load_hf_state_dict(hf_dirs["qwen3_moe_tied"])  # other weights, the same shapes
    port = free_port("127.0.0.1")
    sender = multiprocessing.get_context("spawn").Process(target=_broadcast_checkpoint,
                                                          args=(str(hf_dirs["qwen3_moe_tied"]), port))
    sender.start()
    try:
        engine.init_weight_sync("127.0.0.1", port, 1, 2, "moe_bcast")
        engine.receive_weights(weight_sync.metadata_of(sent), version=3)
    finally:
        sender.join(timeout=120)
        engine.shutdown()
    assert sender.exitcode == 0 and engine.weight_version == 3 and experts.gate_up_proj.data_ptr() == fused_ptr
    assert torch.equal(experts.gate_up_proj[2, 32:], sent["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert torch.equal(experts.down_proj[3], sent["model.layers.1.mlp.experts.3.down_proj.weight"])
