"""LoRA (train.lora) on the megatron trainer: only the adapters train (the base frozen: no gradients, no
optimizer state), the KL reference is the base with the adapters off, dropout acts in the training forward
only, recomputed layers still reach their adapters, checkpoints hold the adapters and resume bitwise, and
tensor parallelism 2 trains as one rank."""
from __future__ import annotations

import os

import pytest
import torch

from runtime.config import GrpoConfig
from tests.test_parallel import recorded_batch

LORA = {"enabled": True, "rank": 4, "alpha": 8.0}


def _cfg(lora: dict | None = None, **train) -> GrpoConfig:
    return GrpoConfig.model_validate({
        "cluster": {"backend": "local"}, "algorithm": {"kl_coef": 0.1, "use_tis": True},
        "train": {"micro_batch_size": 8, "lr": 1e-2, "lora": {**LORA, **(lora or {})}, **train}})


def _trainer(tiny_checkpoint, cfg: GrpoConfig):
    from runtime.trainer.megatron_trainer import MegatronTrainer
    hf, td = tiny_checkpoint
    return MegatronTrainer(hf_dir=hf, init_checkpoint=td, train=cfg.train, algorithm=cfg.algorithm, temperature=1.0)


def _batch(tiny_checkpoint, seed: int = 0, n: int = 32):
    from runtime.models import load_hf_config
    return recorded_batch(load_hf_config(tiny_checkpoint[0]).vocab_size, n=n, seed=seed)


def _maxdiff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _adapters(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.engine_weights().items()}


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
    """A LoRA trainer (KL on, dropout 0.3): its state before, two updates, a checkpoint, a third update."""
    from runtime.trainer import lora
    tr = _trainer(tiny_checkpoint, _cfg({"dropout": 0.3}))
    batches = [_batch(tiny_checkpoint, s) for s in range(3)]
    base = {k: v.clone() for k, v in lora.base_tensors(tr.model).items()}
    out = {"trainer": tr, "batches": batches, "base": base,
           "ref0": tr.compute_logprobs(batches[0], "ref"), "policy0": tr.compute_logprobs(batches[0])}
    for b in batches[:2]:
        out.setdefault("metrics", []).append(tr.train(b))
    out["ckpt"] = str(tmp_path_factory.mktemp("lora-ckpt") / "model")
    tr.save(out["ckpt"])
    out["saved_adapters"] = _adapters(tr)
    tr.train(batches[2])
    out["adapters3"] = _adapters(tr)
    return out


def test_only_the_adapters_train(trained):
    from runtime.trainer import lora
    tr = trained["trainer"]
    names = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert names and all(lora.is_adapter(n) for n in names)
    assert len(names) == 2 * 4 * 2  # A and B of qkv, proj, fc1, fc2 in each of the 2 layers
    adapter_params = sum(p.numel() for n, p in tr.model.named_parameters() if n in names)
    # megatron's DDP and optimizer see the adapters only: no gradient buffer, master or Adam state for the base
    assert sum(b.grad_data.numel() for b in tr.ddp.buffers) == adapter_params
    opt_params = [p for g in tr.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == adapter_params
    state = [v for s in tr.optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    assert sum(v.numel() for v in state) == 2 * adapter_params  # Adam's m and v of the adapters
    assert tr.ref_model is None  # kl_coef > 0, yet no second model
    # the base did not move, bitwise; the adapters did
    now = lora.base_tensors(tr.model)
    assert all(torch.equal(now[k], v) for k, v in trained["base"].items())
    assert any(not torch.equal(trained["saved_adapters"][k], trained["adapters3"][k]) for k in trained["adapters3"])
    assert all(m["grad_norm"] > 0 for m in trained["metrics"])


def test_the_reference_is_the_base_with_the_adapters_off(trained):
    tr, b = trained["trainer"], trained["batches"][0]
    assert _maxdiff(trained["ref0"], trained["policy0"]) == 0.0  # B = 0 at the start: the policy is the base
    assert _maxdiff(tr.compute_logprobs(b, "ref"), trained["ref0"]) == 0.0  # unchanged by the updates
    assert _maxdiff(tr.compute_logprobs(b), trained["policy0"]) > 1e-3  # the policy moved
    assert trained["metrics"][1]["kl"] > 0


def test_dropout_acts_in_the_training_forward_only(trained):
    from runtime.trainer import lora
    tr, b = trained["trainer"], trained["batches"][0]
    with_dropout = tr.compute_logprobs(b)
    mods = [m for _, m in lora.lora_modules(tr.model)]
    assert mods and all(m.lora_dropout == 0.3 for m in mods)
    for m in mods:
        m.lora_dropout = 0.0
    try:
        assert _maxdiff(tr.compute_logprobs(b), with_dropout) == 0.0  # log-prob forwards: no dropout
    finally:
        for m in mods:
            m.lora_dropout = 0.3
    x = torch.randn(5, 1, mods[0].lora_A.shape[1])
    out = torch.zeros(5, 1, mods[0].lora_B.shape[0])
    mods[0].train()
    lora.set_dropout_key(tr.model, (1, 2, 3, 4))
    drawn = mods[0]._add_lora(out, x)
    assert torch.equal(drawn, mods[0]._add_lora(out, x))  # keyed: a recomputed forward draws the same mask
    mods[0].eval()
    assert not torch.equal(drawn, mods[0]._add_lora(out, x))


def test_checkpoint_holds_the_adapters_and_resumes_bitwise(trained, tiny_checkpoint, tmp_path):
    from tests.test_parallel import _checkpoint_tensors
    ckpt = trained["ckpt"]
    tensors = _checkpoint_tensors(ckpt, tmp_path)
    # the adapters (stacked over layers: decoder.layers.<linear>.lora_A) and their Adam state, not the base
    model_keys = {k for k in tensors if not k.startswith("optimizer.")}
    expected = {f"decoder.layers.{k.split('.', 3)[3]}" for k in trained["saved_adapters"]}
    assert model_keys == expected and len(expected) == 8
    assert {k.removeprefix("optimizer.state.exp_avg.") for k in tensors
            if k.startswith("optimizer.state.exp_avg.")} == expected
    assert os.path.isfile(os.path.join(ckpt, "lora.json"))
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    base = sum(v.numel() * v.element_size() for v in trained["base"].values())
    assert size < base / 2, (size, base)
    # a fresh trainer loads it and makes the third update bitwise as the unbroken one did
    resumed = _trainer(tiny_checkpoint, _cfg({"dropout": 0.3}))
    resumed.load(ckpt)
    assert all(torch.equal(resumed.engine_weights()[k], v) for k, v in trained["saved_adapters"].items())
    resumed.train(trained["batches"][2])
    after = resumed.engine_weights()
    assert all(torch.equal(after[k], v) for k, v in trained["adapters3"].items())


def test_recomputed_layers_reach_their_adapters(tiny_checkpoint, trained):
    """Full recompute checkpoints every layer over its input, which nothing upstream (frozen) makes require
    grad: the adapters still get the gradients of the plain forward."""
    tr = _trainer(tiny_checkpoint, _cfg({"dropout": 0.3}, recompute="full"))
    for b in trained["batches"][:2]:
        m = tr.train(b)
    assert m["grad_norm"] == pytest.approx(trained["metrics"][1]["grad_norm"], rel=1e-5)
    grads = tr.grads()
    assert all(g.abs().sum() > 0 for g in grads.values()) and len(grads) == 16


def test_tensor_parallel_2_trains_as_one_rank(tiny_checkpoint, trained):
    """TP 2 in two processes (gloo): column-parallel B split on its rows, row-parallel A on its columns; the
    loss, grad norm, gathered adapters (dropout masks included) match one rank's. The engine, in another
    process with a base of its own, receives the adapters alone over the weight-sync broadcast."""
    from runtime.placement.cluster import Cluster
    from runtime.placement.groups import LocalGroup
    from runtime.placement.handles import EngineHandle
    from runtime.placement.weight_sync import TrainerToEngine
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.trainer.batch import TrainBatch
    cfg = _cfg({"dropout": 0.3}, tensor_parallel=2)
    hf, td = tiny_checkpoint
    trainer = Cluster(cfg).trainer(in_subprocesses=True, hf_dir=hf, init_checkpoint=td, train=cfg.train,
                                   algorithm=cfg.algorithm, temperature=1.0)
    group = trainer.group
    engine = BuiltinEngine(hf, lora=cfg.train.lora)
    try:
        for b, ref in zip(trained["batches"][:2], trained["metrics"]):
            for m in group.call("train", b):
                for key in ("loss", "grad_norm", "entropy"):
                    assert m[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-8), key
                assert m["kl"] == pytest.approx(ref["kl"], abs=1e-6)  # k3 of log-ratios ~1e-3: float noise ~1e-8
        adapters = {k: v.clone() for k, v in group.call("engine_weights")[0].items()}
        sync = TrainerToEngine(trainer, EngineHandle(LocalGroup([engine])), "broadcast", transport="host",
                               group_name="lora_bcast")
        assert [n for n, _, _ in sync.metadata] == list(adapters)  # the adapters, nothing of the base
        sync.push(version=3)
        b = trained["batches"][0]
        one = TrainBatch(b.tokens[:1], b.prompt_lens[:1], [0.0], b.loss_masks[:1], b.rollout_logprobs[:1])
        want = trainer.compute_logprobs(one)[0]
        p = b.prompt_lens[0]
        got = engine.logprobs_of(b.tokens[0][:p], b.tokens[0][p:])
        assert engine.weight_version == 3 and max(abs(x - y) for x, y in zip(got, want)) <= 1e-4
    finally:
        group.kill()
        engine.shutdown()
    ref = trained["saved_adapters"]
    assert adapters.keys() == ref.keys()
    # Adam's normalised step carries float-order differences of the gradient up to ~lr where |g| ~ eps: the
    # project's layout contract is 0.01 x lr per update (docs/resume.md, "Resume contract across layouts"); 2 updates here
    assert max(float((adapters[k] - ref[k]).abs().max()) for k in ref) <= 2 * 0.01 * 1e-2


def test_export_merged_and_peft_adapter_match_the_trainer(trained, tiny_checkpoint, tmp_path):
    """The checkpoint's two exports: the merged HF model (fp32 merge on the host), and the adapter alone in
    PEFT's layout, which `peft` loads onto the HF base; both give the trainer's logits."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from runtime.mcore.convert import mcore_logits, probe_batch
    from runtime.tracking.model_registry import export_trainer_checkpoint
    hf, td = tiny_checkpoint
    out, adapter_dir = tmp_path / "hf", str(tmp_path / "adapter")
    info = export_trainer_checkpoint(trained["ckpt"], hf, out, base_dir=td, adapter_dir=adapter_dir)
    assert info["weights"] == "lora-merged" and info["adapter"] == adapter_dir
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]

    tr = _trainer(tiny_checkpoint, _cfg({"dropout": 0.3}))
    tr.load(trained["ckpt"])
    tr.model.eval()
    ids = probe_batch(tr.hf_config.vocab_size, (2, 24))
    ours = mcore_logits(tr.model, ids)
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager")
        merged_logits = merged.eval()(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, adapter_dir).eval()(input_ids=ids).logits
    assert (ours - base_logits).abs().max() > 1e-2  # the adapters change the model
    assert (merged_logits - ours).abs().max() < 1e-4
    assert (peft_logits - ours).abs().max() < 1e-4


def test_adapter_gradients_are_the_full_gradients_projected(tiny_checkpoint):
    """Exact math: at the first step (B = 0: the policy is the base) each linear's LoRA gradients are the
    full-parameter run's weight gradient G seen through the adapter: dB = scale G A^T, dA = scale B^T G = 0."""
    batch = _batch(tiny_checkpoint, seed=5)
    def cfg(lora: dict) -> GrpoConfig:
        return GrpoConfig.model_validate({"algorithm": {"kl_coef": 0.0, "use_tis": True},
                                          "train": {"micro_batch_size": 8, "lr": 1e-2, "lora": lora}})
    lora_tr, full_tr = _trainer(tiny_checkpoint, cfg(LORA)), _trainer(tiny_checkpoint, cfg({}))
    a = {k: v.clone() for k, v in lora_tr.engine_weights().items() if k.endswith("lora_A")}
    m_lora, m_full = lora_tr.train(batch), full_tr.train(batch)
    assert m_lora["loss"] == pytest.approx(m_full["loss"], rel=1e-6)
    g_lora, g_full = lora_tr.grads(), full_tr.grads()
    scale = LORA["alpha"] / LORA["rank"]
    checked = 0
    for name, A in a.items():
        linear = name.removesuffix(".lora_A")
        want = scale * g_full[linear + ".weight"] @ A.T
        got = g_lora[linear + ".lora_B"]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-7), (linear, float((got - want).abs().max()))
        assert float(g_lora[name].abs().max()) == 0.0
        checked += 1
    assert checked == 8
