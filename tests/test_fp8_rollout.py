"""FP8 weights in the built-in engine (rollout.weights_dtype: fp8) on CPU: rowwise e4m3 linears through
torch._scaled_mm, deterministic, near the full-precision engine's log-probs, re-quantised at each weight sync (by
call and by broadcast) in place, the same trainer weights giving the same bits; GLM4 and a shared LoRA base
(an FP8 copy of the trainer's base, the adapters in the activation dtype); the config's TIS default and the plan."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest
import torch

from runtime.rollout import BuiltinEngine, SampleRequest, SamplingParams

PAGE = 4
SAMPLING = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module", autouse=True)
def single_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return str(tiny_checkpoint[0])


def _engine(model_dir, weights_dtype: str) -> BuiltinEngine:
    return BuiltinEngine(model_dir, decode_path="paged", max_batch_size=8, page_size=PAGE,
                         weights_dtype=weights_dtype)


def _requests() -> list[SampleRequest]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (7,), generator=g).tolist() for _ in range(4)]
    return [SampleRequest(prompt_ids=prompts[i // 2], key=(1, 2, i // 2, i % 2)) for i in range(8)]


# trainer rank 0 of a weight-sync group of two: broadcasts the model dir's tensors (argv: model dir, port)
# It ends with os._exit once its sends are done: under load, gloo's threads tearing down at interpreter exit
# aborted it now and then (SIGABRT after a complete broadcast), which is the process's end, not what is tested.
SENDER = """
import os, sys
from safetensors.torch import load_file
from runtime.placement import weight_sync
group = weight_sync.init_group("127.0.0.1", int(sys.argv[2]), 0, 2, group_name="t_fp8_bcast")
weight_sync.send(group, load_file(sys.argv[1] + "/model.safetensors"), "cpu")
print("sent", flush=True)
os._exit(0)
"""


def _linears(engine) -> list[torch.Tensor]:
    return [t for w in engine.decoder.layers for t in (w.qkv_w, w.qkv_s, w.o_w, w.o_s, w.gu_w, w.gu_s, w.down_w,
                                                       w.down_s)]


def test_rowwise_quantisation_of_row_ranges_gives_the_whole_matrix_bits(monkeypatch):
    """What a sync relies on: q, k, v quantised one by one into row ranges of the fused buffer (and in chunks of
    rows) give the bits of the fused matrix quantised whole; a zero row quantises to zeros."""
    from runtime.rollout import fp8_weights
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 48, generator=g) * scale for n, scale in ((32, 1.0), (16, 30.0), (16, 1e-3))]
    parts[1][3] = 0
    whole_w, whole_s = fp8_weights.quantize_rows(torch.cat(parts))
    monkeypatch.setattr(fp8_weights, "_CHUNK_ELEMENTS", 48 * 5)
    into, scales = torch.empty_like(whole_w), torch.empty_like(whole_s)
    start = 0
    for p in parts:
        fp8_weights.quantize_rows_into(p, into[start:start + len(p)], scales[:, start:start + len(p)])
        start += len(p)
    assert torch.equal(into.view(torch.uint8), whole_w.view(torch.uint8)) and torch.equal(scales, whole_s)
    assert not into[32 + 3].float().any()
    x = torch.randn(5, 48, generator=g)
    exact = x @ torch.cat(parts).t()
    # e4m3 keeps 3 mantissa bits: each product a few % off, weight and input both rounded (measured 0.030-0.042 here, rows of every scale alike)
    for rows in (slice(0, 32), slice(32, 48), slice(48, 64)):
        got = fp8_weights.fp8_linear(x, into[rows], scales[:, rows])
        assert 0 < torch.linalg.norm(got - exact[:, rows]) / torch.linalg.norm(exact[:, rows]) < 0.06


def test_fp8_engine_is_deterministic_near_full_precision_and_holds_half_the_weights(model_dir):
    full, fp8 = _engine(model_dir, "bf16"), _engine(model_dir, "fp8")
    try:
        dec = fp8.decoder
        assert all(getattr(w, a).dtype == torch.float8_e4m3fn for w in dec.layers
                   for a in ("qkv_w", "o_w", "gu_w", "down_w"))
        assert dec.embed.dtype == dec.lm.dtype == torch.float32  # embeddings and head stay
        # the HF linears are gone (meta: shapes only); the engine holds e4m3 + a scale per row instead
        linear = {n: p for n, p in fp8.model.named_parameters() if n in dec.fp8_targets}
        assert len(linear) == 2 * 7 and all(p.device.type == "meta" for p in linear.values())
        n_linear = sum(p.numel() for p in linear.values())
        rows = sum(p.shape[0] for p in linear.values())
        assert dec.weight_bytes == full.decoder.weight_bytes - 4 * n_linear + n_linear + 4 * rows
        assert fp8.health()["weights_dtype"] == "fp8"

        reqs = _requests()
        a, b = fp8.generate(reqs, SAMPLING), fp8.generate(reqs, SAMPLING)
        assert [r.response_ids for r in a] == [r.response_ids for r in b]
        assert [r.response_logprobs for r in a] == [r.response_logprobs for r in b]
        # the engine's log-probs against the full-precision forward's (the trainer's) on its own samples: a random
        # tiny fp32 model measured mean 0.006, max 0.021 nats
        gaps = [abs(p - q) for r in a for p, q in zip(full.logprobs_of(r.prompt_ids, r.response_ids),
                                                       r.response_logprobs)]
        assert 0 < statistics.mean(gaps) < 0.03 and max(gaps) < 0.1, (statistics.mean(gaps), max(gaps))
        # teacher-forced log-probs are the FP8 forward's too (what a check of the engine against the trainer reads)
        for r in a[:2]:
            assert fp8.logprobs_of(r.prompt_ids, r.response_ids) == pytest.approx(r.response_logprobs, abs=1e-5)
    finally:
        full.shutdown()
        fp8.shutdown()


def test_a_weight_sync_requantises_in_place_and_the_same_weights_give_the_same_bits(model_dir):
    from transformers import AutoModelForCausalLM

    from runtime.placement import weight_sync
    from runtime.placement.ports import free_port
    # the trainer's rank 0 of a broadcast below, started first: its start-up overlaps the rest
    port = free_port()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, model_dir, str(port)], env={**os.environ},
                              stdout=subprocess.PIPE, text=True)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    g = torch.Generator().manual_seed(5)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in trainer.items()}
    eng, fresh = _engine(model_dir, "fp8"), _engine(model_dir, "fp8")
    try:
        reqs = _requests()
        before = eng.generate(reqs, SAMPLING)
        buffers = [t.data_ptr() for t in _linears(eng)]
        eng.update_weights(moved, 1)
        assert eng.last_quantize_s is not None and eng.last_quantize_s >= 0
        assert [t.data_ptr() for t in _linears(eng)] == buffers  # in place: captured graphs stay valid
        after = eng.generate(reqs, SAMPLING)
        assert [r.response_logprobs for r in after] != [r.response_logprobs for r in before]
        # a rebuilt engine (a resumed run's) given the same trainer weights decodes the same bits
        fresh.update_weights(moved, 1)
        assert [r.response_logprobs for r in fresh.generate(reqs, SAMPLING)] == [r.response_logprobs for r in after]
        # by broadcast from another process (the trainer's rank 0), one tensor at a time: back to the first
        # weights, and to the first bits
        from safetensors.torch import load_file
        eng.init_weight_sync("127.0.0.1", port, 1, 2, "t_fp8_bcast")
        eng.receive_weights(weight_sync.metadata_of(load_file(f"{model_dir}/model.safetensors")), 2)
        assert sender.communicate(timeout=60)[0].split() == ["sent"] and sender.returncode == 0
        assert [t.data_ptr() for t in _linears(eng)] == buffers
        again = eng.generate(reqs, SAMPLING)
        assert [r.response_ids for r in again] == [r.response_ids for r in before]
        assert [r.response_logprobs for r in again] == [r.response_logprobs for r in before]
    finally:
        eng.shutdown()
        fresh.shutdown()
        if sender.poll() is None:  # the test failed before the broadcast
            sender.kill()
            sender.wait()


def test_glm4_and_a_shared_lora_base_in_fp8(tmp_path):
    """GLM4 (q/k/v bias, interleaved partial RoPE, post-norms): FP8 logits near the full-precision forward's; its
    megatron tensors as a shared base (LoRA) decode as the engine's own FP8 base does (rowwise scales: the
    grouped qkv's rows quantise as HF's), the adapters added beside FP8 weights."""
    from transformers import AutoModelForCausalLM, Glm4Config

    from runtime.config import LoraSection
    from runtime.models import get_adapter
    from runtime.rollout.decode_model import FusedModel
    cfg = Glm4Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=False, pad_token_id=0,
                     eos_token_id=1, bos_token_id=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    ids = torch.randint(0, 96, (20,))
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
    base = {k: v.clone() for k, v in get_adapter(cfg).from_hf(model.state_dict(), cfg).items()}
    lora = LoraSection(enabled=True, rank=4, alpha=8.0)
    own = FusedModel(model, compile=False, weights_dtype="fp8", lora=lora)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg).float().eval()
    shared = FusedModel(skeleton, compile=False, weights_dtype="fp8", lora=lora, shared_base=base)
    assert shared.layers[0].qkv_w.dtype == torch.float8_e4m3fn
    assert shared.layers[0].qkv_w.data_ptr() != base["decoder.layers.0.self_attention.linear_qkv.weight"].data_ptr()
    g = torch.Generator().manual_seed(1)
    adapters = {}
    for i in range(2):
        for t, b in shared.adapters.b.items():
            adapters[f"decoder.layers.{i}.{'mlp' if 'fc' in t else 'self_attention'}.{t}.lora_A"] = \
                0.1 * torch.randn(shared.adapters.a[t][i].shape, generator=g)
            adapters[f"decoder.layers.{i}.{'mlp' if 'fc' in t else 'self_attention'}.{t}.lora_B"] = \
                0.1 * torch.randn(b[i].shape, generator=g)
    lp = {}
    for name, m in (("own", own), ("shared", shared)):
        lp[name + "_base"] = torch.log_softmax(m.sequence_logits(ids).float(), -1)
        m.adapters.load(adapters)
        lp[name] = torch.log_softmax(m.sequence_logits(ids).float(), -1)
    assert (lp["own_base"] - ref).abs().max() < 0.1 and (lp["own_base"] - ref).abs().max() > 0
    assert (lp["shared"] - lp["own"]).abs().max() < 1e-4
    assert (lp["shared"] - lp["shared_base"]).abs().max() > 1e-2  # the adapters are applied


def test_fp8_turns_tis_on_unless_set_and_the_plan_counts_fp8_weights():
    from runtime.config import GrpoConfig
    from runtime.plan.engine_terms import engine_weights, linear_params
    from runtime.plan.shape import model_shape, param_counts
    from runtime.plan.summary import known_config, plan_lines
    assert GrpoConfig().algorithm.use_tis is False
    on = GrpoConfig.model_validate({"rollout": {"weights_dtype": "fp8"}})
    assert on.algorithm.use_tis is True
    assert any(line.startswith("fp8 rollout") and "TIS on" in line for line in plan_lines(on))
    off = GrpoConfig.model_validate({"rollout": {"weights_dtype": "fp8"}, "algorithm": {"use_tis": False}})
    assert off.algorithm.use_tis is False
    assert any("TIS off" in line for line in plan_lines(off))
    # what fp8 refuses (SGLang, HF's decode path): tests/test_validate_refusals.py
    # GLM-Z1-9B's shape: the engine's weights near half of bf16's (embeddings and head stay bf16)
    glm = known_config("zai-org/GLM-Z1-9B-0414")
    m, (n, _) = model_shape(glm), param_counts(glm)
    kw = dict(engine="builtin", sglang_tp=1, shared_base=False, lora=False, m=m)
    bf16, fp8 = engine_weights(n, 0, 2, **kw), engine_weights(n, 0, 2, weights_dtype="fp8", **kw)
    linear, rows = linear_params(m)
    assert fp8 == bf16 - linear + 4 * rows and 0.5 < fp8 / bf16 < 0.6


def test_a_mixture_of_experts_in_fp8_decodes_near_bf16_and_a_sync_requantises_its_experts(tmp_path):
    """rollout.weights_dtype fp8 on a Qwen3-MoE: every expert's rows e4m3 with a scale each ([E, rows, cols] and
    [E, rows]), the router in the model's dtype; the experts' grouped GEMMs quantise their routed copies per row
    (CPU: a _scaled_mm per expert; CUDA: one _scaled_grouped_mm). Deterministic, near the bf16 engine's log-probs,
    the experts re-quantised in place by a sync (the same weights: the same bits), and the plan counts them."""
    from transformers import AutoModelForCausalLM

    from runtime.models.tiny import build_tiny_qwen3
    from runtime.plan.engine_terms import linear_params
    from runtime.plan.shape import model_shape
    model_dir = build_tiny_qwen3(tmp_path / "moe", num_experts=4, expert_ffn_size=64)["path"]
    full, fp8 = _engine(model_dir, "bf16"), _engine(model_dir, "fp8")
    try:
        dec = fp8.decoder
        for w in dec.layers:
            assert w.gu_w.dtype == w.down_w.dtype == torch.float8_e4m3fn and w.gu_w.shape == (4, 128, 128)
            assert w.gu_s.shape == (4, 128) and w.down_s.shape == (4, 128) and w.router.dtype == torch.float32
        assert len(dec.fp8_targets) == 2 * 6  # q, k, v, o and the two fused expert tensors per layer
        reqs = _requests()
        a, b = fp8.generate(reqs, SAMPLING), fp8.generate(reqs, SAMPLING)
        assert [r.response_logprobs for r in a] == [r.response_logprobs for r in b]
        gaps = [abs(p - q) for r in a for p, q in zip(full.logprobs_of(r.prompt_ids, r.response_ids),
                                                       r.response_logprobs)]
        assert 0 < statistics.mean(gaps) < 0.03 and max(gaps) < 0.1, (statistics.mean(gaps), max(gaps))
        # a sync: moved experts change the samples in place; the first weights bring the first bits back
        state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        experts = {k: v for k, v in state.items() if ".experts." in k}
        assert experts and all(k in dec.fp8_targets for k in experts)
        buffers = [t.data_ptr() for w in dec.layers for t in (w.gu_w, w.gu_s, w.down_w, w.down_s)]
        g = torch.Generator().manual_seed(5)
        fp8.update_weights({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in experts.items()}, 1)
        assert [t.data_ptr() for w in dec.layers for t in (w.gu_w, w.gu_s, w.down_w, w.down_s)] == buffers
        assert [r.response_logprobs for r in fp8.generate(reqs, SAMPLING)] != [r.response_logprobs for r in a]
        fp8.update_weights(experts, 2)
        assert [r.response_logprobs for r in fp8.generate(reqs, SAMPLING)] == [r.response_logprobs for r in a]
        # the plan: a byte a weight and a scale per row, every expert's
        linear, rows = linear_params(model_shape(full.model.config))
        assert dec.weight_bytes == full.decoder.weight_bytes - 4 * linear + linear + 4 * rows
    finally:
        full.shutdown()
        fp8.shutdown()
