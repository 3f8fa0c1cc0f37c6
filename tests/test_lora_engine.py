"""The built-in engine with LoRA: one copy of the base (the trainer's own tensors, decoded in megatron's
per-group qkv layout) or a base of its own (HF layout), the adapters applied in the paged decoder's forward from
fixed-rank buffers that a sync copies into in place; the sampled tokens' log-probs equal the trainer's (fp32),
as closely as the full-parameter path's do. Qwen3 (q/k norms, tied head) and GLM4 (q/k/v bias, interleaved
partial RoPE, post-norms, fused gate_up, untied head)."""
from __future__ import annotations

import pytest
import torch

from runtime.config import GrpoConfig
from runtime.rollout.base import SampleRequest, SamplingParams
from runtime.trainer.batch import TrainBatch
from tests.test_parallel import recorded_batch

LORA = {"enabled": True, "rank": 4, "alpha": 8.0}
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8)
TOL = 1e-4  # fp32: engine and trainer differ by float summation order only


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models.tiny import build_tiny_qwen3
    from tests.test_model_families import VARIANTS, build_tiny_family_model
    root = tmp_path_factory.mktemp("lora-engine")
    info = build_tiny_qwen3(root / "qwen3", seed=3)
    cls, kw = VARIANTS["glm4_untied"]
    glm = build_tiny_family_model(root / "glm4", cls, info["vocab_size"], root / "qwen3", seed=5, **kw)
    out = {}
    for name, hf in (("qwen3", root / "qwen3"), ("glm4", glm)):
        hf_to_torch_dist(hf, root / f"{name}_td")
        out[name] = (str(hf), str(root / f"{name}_td"))
    return out


def _trainer(hf: str, td: str, lora: bool):
    from runtime.trainer.megatron_trainer import MegatronTrainer
    cfg = GrpoConfig.model_validate({"algorithm": {"kl_coef": 0.0, "use_tis": True},
                                     "train": {"micro_batch_size": 8, "lr": 1e-2, "lora": LORA if lora else {}}})
    tr = MegatronTrainer(hf_dir=hf, init_checkpoint=td, train=cfg.train, algorithm=cfg.algorithm, temperature=1.0)
    for seed in range(2):  # two updates: B moves at the first, A at the second
        tr.train(recorded_batch(tr.hf_config.vocab_size, n=16, seed=seed))
    return tr, cfg


def _requests(engine) -> list[SampleRequest]:
    tok = engine.tokenizer
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in ("What is 2 + 3?", "Compute 7 * 6.")]
    return [SampleRequest(prompt_ids=ids[p], key=(0, 0, p, s)) for p in range(2) for s in range(4)]


def _gap(trainer, results) -> float:
    """Largest |engine - trainer| log-prob of the sampled tokens."""
    batch = TrainBatch(tokens=[r.prompt_ids + r.response_ids for r in results],
                       prompt_lens=[len(r.prompt_ids) for r in results], advantages=[0.0] * len(results),
                       loss_masks=[r.effective_loss_mask() for r in results],
                       rollout_logprobs=[r.response_logprobs for r in results])
    ours = trainer.compute_logprobs(batch)
    return max(abs(a - b) for got, r in zip(ours, results) for a, b in zip(got, r.response_logprobs))


@pytest.mark.parametrize("family", ["qwen3", "glm4"])
def test_shared_and_own_base_engines_sample_the_trainers_policy(models, family):
    from runtime.rollout.builtin import BuiltinEngine
    hf, td = models[family]
    tr, cfg = _trainer(hf, td, lora=True)
    shared = BuiltinEngine(hf, lora=cfg.train.lora, shared_base=tr.shared_base())
    own = BuiltinEngine(hf, lora=cfg.train.lora)
    fresh = BuiltinEngine(hf, lora=cfg.train.lora)  # never synced: zero adapters, the base alone
    try:
        assert shared.decode_path == own.decode_path == "paged"
        # one copy of the base: every tensor the shared engine decodes with is one of the trainer's
        dec = shared.decoder
        trainer_ptrs = {p.data_ptr() for p in tr.model.parameters()}
        used = [dec.embed, dec.lm, dec.norm] + [t for w in dec.layers for t in
                                                (w.ln1, w.qkv_w, w.qkv_b, w.qn, w.kn, w.o_w, w.ln2, w.gu_w, w.down_w,
                                                 w.pa, w.pm) if t is not None]
        assert all(t.data_ptr() in trainer_ptrs for t in used)
        assert all(p.device.type == "meta" for p in shared.model.parameters())
        # the sync copies the adapters into the rank-sized buffers, in place (captured graphs stay valid)
        buffers = {k: [t.data_ptr() for t in v] for k, v in dec.adapters.b.items()}
        adapters = tr.engine_weights()
        assert adapters and all(".lora_" in k for k in adapters)
        for e in (shared, own):
            e.update_weights(adapters, version=1)
        assert {k: [t.data_ptr() for t in v] for k, v in dec.adapters.b.items()} == buffers
        assert all(b.abs().sum() > 0 for t in dec.adapters.targets for b in dec.adapters.b[t])

        requests = _requests(shared)
        on_shared, on_own = shared.generate(requests, SAMPLING), own.generate(requests, SAMPLING)
        assert [r.response_ids for r in on_shared] == [r.response_ids for r in on_own]
        gaps = {"shared": _gap(tr, on_shared), "own": _gap(tr, on_own)}
        assert max(gaps.values()) <= TOL, gaps
        r = on_shared[0]
        lp = tr.compute_logprobs(TrainBatch([r.prompt_ids + r.response_ids], [len(r.prompt_ids)], [0.0],
                                            [[1] * len(r.response_ids)], [r.response_logprobs]))[0]
        assert max(abs(a - b) for a, b in zip(shared.logprobs_of(r.prompt_ids, r.response_ids), lp)) <= TOL
        # the adapters are what the engines apply: without them the engine is the base, the trainer's reference
        base_lp = fresh.logprobs_of(r.prompt_ids, r.response_ids)
        ref = tr.compute_logprobs(TrainBatch([r.prompt_ids + r.response_ids], [len(r.prompt_ids)], [0.0],
                                             [[1] * len(r.response_ids)], [r.response_logprobs]), "ref")[0]
        assert max(abs(a - b) for a, b in zip(base_lp, ref)) <= TOL
        assert max(abs(a - b) for a, b in zip(base_lp, lp)) > 1e-3
        if family == "qwen3":  # no worse than the full-parameter path, measured the same way
            full, _ = _trainer(hf, td, lora=False)
            engine = BuiltinEngine(hf)
            engine.update_weights(full.hf_weights(), version=1)
            full_gap = _gap(full, engine.generate(requests, SAMPLING))
            engine.shutdown()
            print(f"engine-vs-trainer log-prob gap (fp32): LoRA {gaps}, full-parameter {full_gap:.3g}")
            assert max(gaps.values()) <= max(2 * full_gap, 1e-5), (gaps, full_gap)
    finally:
        for e in (shared, own, fresh):
            e.shutdown()


def test_an_update_that_does_not_fit_the_buffers_is_refused(models):
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.config import LoraSection
    hf, _ = models["qwen3"]
    engine = BuiltinEngine(hf, lora=LoraSection(**LORA))
    try:
        a = engine.decoder.adapters
        good = {"decoder.layers.0.self_attention.linear_qkv.lora_A": torch.ones(4, a.a["linear_qkv"][0].shape[1])}
        with pytest.raises(ValueError, match="rank <= 4"):
            engine.update_weights({k: torch.ones(8, v.shape[1]) for k, v in good.items()}, 1)
        with pytest.raises(ValueError, match="LoRA engine takes the trainer's adapters only"):
            engine.update_weights({**good, "model.norm.weight": torch.ones(1)}, 1)
        assert sum(x.abs().sum() for x in a.a["linear_qkv"]) == 0 and engine.weight_version == 0  # nothing copied
        engine.update_weights({k: v[:2] for k, v in good.items()}, 2)  # a smaller rank fills the first rows
        assert a.a["linear_qkv"][0][:2].eq(1).all() and a.a["linear_qkv"][0][2:].eq(0).all()
    finally:
        engine.shutdown()
