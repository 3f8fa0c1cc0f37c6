"""rollout.true_on_policy (issue 61): the built-in engine and the megatron trainer on one batch-invariant set of
kernels (runtime/kernels/batch_invariant.py), so every sampled token's engine log-prob is bitwise the trainer's,
in its log-prob pass and in its training forward, preempted samples included. CPU, bf16, tiny Qwen3 and GLM4 with
norms and biases away from HF's 1 and 0 (where the two sides' roundings differ); the trainer's micro-batches padded
(Qwen3) and packed (GLM4)."""
from __future__ import annotations

import pytest
import torch

from runtime.config import AlgorithmSection, TrainSection

FAMILIES = {
    "qwen3": ("Qwen3Config", {}, dict(micro_batch_size=2)),
    "glm4": ("Glm4Config", dict(attention_bias=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5}),
             dict(micro_batch_size=1, max_tokens_per_micro_batch=160)),
}
PROMPTS, SAMPLES, PROMPT_LEN, NEW = 2, 4, 12, 24


def _tiny(path, config_class: str, extra: dict, tok_dir, vocab: int):
    """A 2-layer random model of the family in bf16, norms 1 + 0.1 N(0, 1) and biases 0.1 N(0, 1) (the bench's)."""
    import shutil

    import transformers
    from transformers import AutoModelForCausalLM
    cfg = getattr(transformers, config_class)(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512, initializer_range=0.1,
        eos_token_id=2, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tok_dir / f, path / f)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from pathlib import Path

    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models.tiny import build_tiny_qwen3
    work = tmp_path_factory.mktemp("true-on-policy")
    info = build_tiny_qwen3(work / "tok", seed=0)
    out = {}
    for name, (cls, extra, _) in FAMILIES.items():
        hf = _tiny(work / f"{name}_hf", cls, extra, Path(info["path"]), info["vocab_size"])
        hf_to_torch_dist(hf, work / f"{name}_td", dtype="bfloat16", tolerance=1.0)
        out[name] = (str(hf), str(work / f"{name}_td"))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_logprobs_are_the_trainers_bitwise(models, family):
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.trainer.batch import TrainBatch
    from runtime.trainer.megatron_trainer import MegatronTrainer

    hf, td = models[family]
    torch.manual_seed(0)
    # a pool of 10 pages of 16 tokens for 2 prompts and 8 samples of 24 tokens (18 pages): rows are preempted
    page_bytes = 16 * 2 * 2 * 2 * 16 * 2
    engine = BuiltinEngine(hf, dtype=torch.bfloat16, max_batch_size=PROMPTS * SAMPLES, decode_path="paged",
                           kv_cache_gb=10 * page_bytes / 2**30, sync_every=4, true_on_policy=True)
    engine.eos_token_ids = set()  # fixed length: a random model stops at random
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, engine.vocab_size, (PROMPTS, PROMPT_LEN), generator=g).tolist()
    reqs = [SampleRequest(prompt_ids=ids[p], key=(61, 0, p, j)) for p in range(PROMPTS) for j in range(SAMPLES)]
    results = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=NEW))
    assert engine.decoder.stats["preemptions"] > 0 and engine.decoder.stats["attention"] == "batch_invariant"
    engine.shutdown()
    batch = TrainBatch(tokens=[r.prompt_ids + r.response_ids for r in results],
                       prompt_lens=[len(r.prompt_ids) for r in results],
                       advantages=[1.0 if i % 2 == 0 else -1.0 for i in range(len(results))],
                       loss_masks=[r.effective_loss_mask() for r in results],
                       rollout_logprobs=[r.response_logprobs for r in results])
    train = TrainSection(lr=1e-4, num_rollout=1, num_steps_per_rollout=1, global_batch_size=len(results),
                         **FAMILIES[family][2])
    trainer = MegatronTrainer(hf_dir=hf, init_checkpoint=td, train=train, algorithm=AlgorithmSection(),
                              temperature=1.0, dtype="bfloat16", true_on_policy=True)
    scored = trainer.compute_logprobs(batch)
    engine_lp = torch.tensor([x for r in results for x in r.response_logprobs], dtype=torch.float64)
    trainer_lp = torch.tensor([x for row in scored for x in row], dtype=torch.float64)
    assert engine_lp.numel() == PROMPTS * SAMPLES * NEW
    assert (engine_lp - trainer_lp).abs().max().item() == 0.0
    metrics = trainer.train(batch)  # the training forward's log-probs against the engine's
    assert metrics["train_tokens"] == PROMPTS * SAMPLES * NEW
    assert metrics["train_rollout_logp_absdiff"] == 0.0


@pytest.mark.slow  # a run's stages and session: the pipeline's, as the other session tests
@pytest.mark.parametrize("sets", [(), ("train.lora.enabled=true", "train.lr=1e-2")], ids=["full", "lora"])
def test_a_train_session_has_no_gap(tmp_path, sets):
    """The product path (the session `grpoflow run` drives, the built-in engine and the trainer from the config, the
    weights synced after each update; with LoRA the adapters, the engine decoding from the trainer's base):
    train_rollout_logp_absdiff is exactly 0 at every rollout, the second one's under the updated weights."""
    from runtime.config import load_config
    from tests.sessions import prepared_session
    from runtime.run.directory import RunDir
    from tests.conftest import SMALL_BATCH
    cfg = load_config("configs/tiny.yaml", SMALL_BATCH + [
        "rollout.true_on_policy=true", "model.dtype=bfloat16", "rollout.max_new_tokens=8", "train.num_rollout=2",
        "checkpoint.interval=2", "eval.interval=null", "tracking.enabled=false", f"storage.root={tmp_path}", *sets])
    rd = RunDir(str(tmp_path), "onpolicy")
    session = prepared_session(cfg, rd)
    try:
        metrics = session.run_chunk(0, 2)["metrics"]
    finally:
        session.close()
    assert [m["train_rollout_logp_absdiff"] for m in metrics] == [0.0, 0.0]
    assert all(m["train_tokens"] > 0 for m in metrics) and metrics[0]["grad_norm"] > 0  # the update moved them


@pytest.mark.parametrize("override, names", [
    ("train.tensor_parallel=2", "train.tensor_parallel=2 is out of scope"),
    ("train.lora.enabled=true train.lora.dropout=0.1", "train.lora.dropout=0.1 is out of scope"),
    ("rollout.engine=sglang", "rollout.engine=sglang is out of scope"),
    ("rollout.weights_dtype=fp8", "rollout.weights_dtype=fp8 is out of scope"),
    ("rollout.partial=true algorithm.use_tis=true", "rollout.partial is out of scope"),
    ("rollout.cascade_attention=true", "rollout.cascade_attention is out of scope"),
])
def test_what_is_out_of_scope_is_refused_in_one_line(override, names):
    from runtime.config import load_config
    with pytest.raises(Exception) as e:
        load_config("configs/tiny.yaml", ["rollout.true_on_policy=true", *override.split()])
    assert names in str(e.value) and "issue 61" in str(e.value)
    load_config("configs/tiny.yaml", override.split())  # refused for the setting only


def test_common_attention_is_the_engines_decode_reference_row_by_row():
    """The common attention (the trainer's and the engine's prefill under the setting) gives each query row the bits
    the engine's decode reference gives that row from the paged cache in fixed blocks (`common_decode`), whatever rows
    come with it (the reference called on the rows as they come: within float noise); and the common matmul gives a
    row the same bits alone as in a batch. Fails if either drifts from the other."""
    from runtime.kernels import batch_invariant as lga
    from runtime.rollout.decode_attention import reference_paged_decode_attention

    g = torch.Generator().manual_seed(0)
    n, nh, nkv, hd, page, plen = 300, 4, 2, 16, 16, 40  # more than one of the reference's 256-position blocks
    q, k, v = (torch.randn(n, h, hd, generator=g) for h in (nh, nkv, nkv))
    common = lga.common_attention(q, k, v, hd ** -0.5)
    # the same sequence in a paged pool: the prompt's pages, then the row's own pages (shuffled page ids)
    pcols, ocols = -(-plen // page), -(-(n - plen) // page)
    ids = torch.randperm(pcols + ocols + 1, generator=g)[: pcols + ocols] + 1  # page 0 stays the null page
    kp, vp = (torch.zeros(pcols + ocols + 2, page, nkv, hd) for _ in range(2))
    for t in range(n):
        col = t // page if t < plen else pcols + (t - plen) // page
        off = t % page if t < plen else (t - plen) % page
        kp[ids[col], off], vp[ids[col], off] = k[t], v[t]
    rows = torch.tensor([plen - 1, plen, 150, 255, 256, n - 1])  # each the last position of its row (own: 0 to 260)
    for pick in (rows, rows[2:3]):  # several rows in one call, and one alone
        args = (kp, vp, ids[None].expand(len(pick), -1).int(), torch.full((len(pick),), plen), pick + 1 - plen, pcols,
                hd ** -0.5)
        # the reference on the rows as they come: the same sums, but a CPU's BLAS may pick another kernel for another
        # count of rows (an AVX-512 EPYC did): within float noise; the engine's side under the setting takes the rows
        # in the common attention's fixed blocks, and that is bitwise
        assert torch.allclose(reference_paged_decode_attention(q[pick], *args), common[pick], rtol=0, atol=1e-6)
        assert torch.equal(lga.common_decode(q[pick], *args), common[pick])
    assert torch.equal(lga.common_attention(q, k, v, hd ** -0.5, rows=None), common)  # the blocks change no bit here
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(70, 64, generator=g)
    assert torch.equal(lga.fixed_shape_mm(x, w)[5:6], lga.fixed_shape_mm(x[5:6], w))
