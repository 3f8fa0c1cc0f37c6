"""The optimizer on the host (issue 36, `train.optimizer_on_host`, runtime/trainer/host_optimizer.py) on CPU:
its updates against megatron's own optimizer on the same batches (bf16 weights and gradients, clipping active,
full recompute), at DP 1, DP 2 with the distributed optimizer and TP 2 (gloo, one process per rank); and its
checkpoints through the layout-free optimizer format, across a change of DP size and of where the optimizer
lives. On CPU "device" and "host" are the same memory, so what is compared is the step itself: the same
masters and moments, stepped by our host loop (chunked, fused AdamW) or by megatron's."""
from __future__ import annotations

import pytest
import torch

from runtime.config import AlgorithmSection, GrpoConfig, TrainSection
from runtime.trainer.batch import TrainBatch
from tests.batches import ragged_batch
from tests.checkpoints import checkpoint_tensors, fp32_masters

LR = 1e-3
# clip_grad small enough that every step clips: the clip coefficient comes from the grad norm, the one place
# where the host step and megatron's could diverge beyond rounding
TRAIN = {"micro_batch_size": 8, "lr": LR, "clip_grad": 0.1, "grad_dtype": "bfloat16", "recompute": "full",
         "weight_decay": 0.1}
# docs/resume.md's contract: every weight within 0.01 x lr per update of the reference. Compared on the fp32 masters
# (the state the updates accumulate in); the bf16 weights are those masters rounded (checked separately).
PER_UPDATE = 1e-2 * LR
CHUNK = 1000  # elements per host chunk in these tests: chunks cut through weights and through DP shards


def _batch(vocab: int, n: int = 32, seed: int = 0) -> TrainBatch:
    return ragged_batch(vocab, n, seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models import load_hf_config
    from runtime.models.tiny import build_tiny_qwen3
    root = tmp_path_factory.mktemp("host-optimizer")
    hf = build_tiny_qwen3(root / "hf", seed=3, hidden_size=64, num_layers=2, head_dim=16, ffn_hidden_size=128)["path"]
    hf_to_torch_dist(hf, str(root / "td"))
    return {"hf": str(hf), "td": str(root / "td"), "root": root, "vocab": load_hf_config(hf).vocab_size}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---- one process: the step itself ------------------------------------------------------------------------

def _trainer(tiny, **train):
    from runtime.trainer.megatron_trainer import MegatronTrainer
    t = TrainSection(**{**TRAIN, "global_batch_size": 32, "num_rollout": 4, **train})
    tr = MegatronTrainer(hf_dir=tiny["hf"], init_checkpoint=tiny["td"], train=t,
                         algorithm=AlgorithmSection(use_tis=True), temperature=1.0, dtype="bfloat16")
    if tr.host_optimizer is not None:  # small chunks: pieces of weights, several per chunk
        from runtime.trainer.host_optimizer import HostAdam
        tr.host_optimizer = HostAdam(tr.optimizer, tr.ddp, "cpu", chunk_elems=CHUNK)
    return tr


def _live_masters(tr) -> dict[str, torch.Tensor]:
    return {n: p.main_param.detach().clone() for n, p in tr.model.named_parameters()}


def _inner_state(tr) -> dict:
    return tr.optimizer.chained_optimizers[0].optimizer.state


@torch.no_grad()
def _copy_state(src, dst) -> None:
    """dst's weights, masters and Adam state := src's (bitwise): the next updates start from one state."""
    for (_, a), (_, b) in zip(src.model.named_parameters(), dst.model.named_parameters()):
        b.copy_(a)
        b.main_param.copy_(a.main_param)
        sa, sb = _inner_state(src).get(a.main_param, {}), _inner_state(dst)
        if sa:
            sb[b.main_param] = {k: v.clone() for k, v in sa.items()}


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed_optimizer"])
def test_host_step_equals_megatrons_step(tiny, distributed):
    """Update by update from one state (bf16 weights chaotically amplify a last-bit difference over several
    updates, so each update is compared on its own): the same loss and grad norm, the masters within the contract,
    the weights exactly the masters rounded to bf16."""
    dev, host = (_trainer(tiny, distributed_optimizer=distributed, optimizer_on_host=on) for on in (False, True))
    hopt = host.host_optimizer
    assert len(hopt.chunks) > 10 and any(len(c.pieces) > 1 for c in hopt.chunks)  # chunks cut across weights
    # the state is megatron's own: its masters (made on the host) and the Adam state torch keeps
    assert {id(m) for m in hopt.masters()} == {id(p.main_param) for p in host.model.parameters()}
    initial = _live_masters(host)
    for step in range(3):
        batch = _batch(tiny["vocab"], seed=step)
        m_dev, m_host = dev.train(batch), host.train(batch)
        assert m_host["loss"] == m_dev["loss"]  # the same forward
        assert m_host["grad_norm"] == pytest.approx(m_dev["grad_norm"], rel=1e-6)  # summed in another order
        assert m_dev["grad_norm"] > TRAIN["clip_grad"]  # clipping was active
        assert m_host["optimizer_step_s"] > 0
        a, b = _live_masters(dev), _live_masters(host)
        diff = _max_diff(a, b)
        print(f"update {step + 1}: max |master_host - master_megatron| = {diff:.3g} ({diff / LR:.2g} lr)")
        assert diff <= PER_UPDATE, (step, diff)
        for n, w in host.model.named_parameters():  # the weights are the masters, rounded to bf16
            assert torch.equal(w.detach().reshape(-1), b[n].reshape(-1).to(torch.bfloat16)), n
        assert {float(s["step"]) for s in _inner_state(host).values()} == {float(step + 1)}
        for m in hopt.masters():
            assert _inner_state(host)[m]["exp_avg"].shape == m.shape
        _copy_state(dev, host)
    assert moved_away(b, initial)


def moved_away(after: dict, before: dict) -> bool:
    """The updates moved the masters (two untrained optimizers would compare equal too)."""
    return _max_diff(after, before) > LR


def test_offload_with_the_host_optimizer_drops_only_gradients(tiny):
    """The state offload of the colocated hand-off: with the optimizer on the host only the gradient buffer is
    on the device, and it is freed without a copy (every step zeroes it first); the next update is bitwise the
    one without the round trip."""
    a, b = (_trainer(tiny, optimizer_on_host=True) for _ in range(2))
    a.train(_batch(tiny["vocab"]))
    b.train(_batch(tiny["vocab"]))
    assert [t.untyped_storage().data_ptr() for t in a.offload._tensors()] == \
        [buf.grad_data.untyped_storage().data_ptr() for buf in a.ddp.buffers]  # no optimizer state among them
    grad_bytes = sum(buf.grad_data.untyped_storage().nbytes() for buf in a.ddp.buffers)
    moved = a.offload_state(force=True)
    assert moved["bytes"] == 0 and moved["dropped_bytes"] == grad_bytes > 0
    assert all(buf.grad_data.untyped_storage().nbytes() == 0 for buf in a.ddp.buffers)
    assert a.offload.buffers and all(buf.is_meta for buf in a.offload.buffers.values())  # nothing pinned
    a.reload_state()
    assert all(float(buf.grad_data.abs().max()) == 0 for buf in a.ddp.buffers)
    a.offload_state(force=True)
    a.train(_batch(tiny["vocab"], seed=1))
    b.train(_batch(tiny["vocab"], seed=1))
    assert _max_diff(_live_masters(a), _live_masters(b)) == 0


def test_the_plan_counts_what_the_host_optimizer_holds(tiny):
    """runtime/plan/host_memory.py against the trainer: the parameter tensors it lists are megatron's, and the
    host holds 12 B (fp32 master, two fp32 moments) per parameter of the rank."""
    from runtime.models import load_hf_config
    from runtime.plan.host_memory import param_tensor_numels
    from runtime.plan.memory import _shape, param_counts
    hf = load_hf_config(tiny["hf"])
    tr = _trainer(tiny, optimizer_on_host=True, distributed_optimizer=True)
    tr.train(_batch(tiny["vocab"]))
    assert sorted(param_tensor_numels(_shape(hf), 1)) == sorted(p.numel() for p in tr.model.parameters())
    held = tr.host_optimizer.host_bytes()
    assert held["masters"] + held["moments"] == 12 * param_counts(hf, 1)[1]
    assert held["buffers"] > 0 and held["scratch"] > 0


def test_optimizer_on_host_refuses_fp32_weights():
    from runtime.errors import ConfigError
    from runtime.config import config_from_dict
    with pytest.raises(ConfigError, match=r"train.optimizer_on_host .* model.dtype: bfloat16") as e:
        config_from_dict({"cluster": {"device": "cpu"}, "train": {"optimizer_on_host": True}}, "cfg.yaml")
    assert "\n" not in str(e.value)
    config_from_dict({"cluster": {"device": "cpu"}, "model": {"dtype": "bfloat16"},
                      "train": {"optimizer_on_host": True}}, "cfg.yaml")


# ---- one process per rank (gloo): DP 2 with the distributed optimizer, TP 2, and checkpoints ---------------

def _group(tiny, dp: int = 1, tp: int = 1, host: bool = False, distributed: bool = False, **train):
    from runtime.placement.cluster import Cluster
    samples = train.setdefault("global_batch_size", 32)  # one optimizer step per batch
    cfg = GrpoConfig.model_validate({
        "model": {"dtype": "bfloat16"}, "cluster": {"backend": "local", "device": "cpu"},
        "rollout": {"rollout_batch_size": samples // 8, "n_samples_per_prompt": 8},
        "algorithm": {"kl_coef": 0.0, "use_tis": True},
        "train": {**TRAIN, "data_parallel": dp, "tensor_parallel": tp, "distributed_optimizer": distributed,
                  "optimizer_on_host": host, **train}})
    return Cluster(cfg).trainer(in_subprocesses=True, hf_dir=tiny["hf"], init_checkpoint=tiny["td"], train=cfg.train,
                                algorithm=cfg.algorithm, temperature=1.0).group


@pytest.fixture(scope="module")
def ranked(tiny):
    """Single updates from one bitwise state (bf16 weights amplify a last-bit difference over several updates,
    so every comparison is of one update):

    tp2_dev / tp2_host  TP 2, bf16 gradients, megatron's optimizer / the host one: b0 from the initial weights,
                        save @1
    host_dp2   the host optimizer, DP 2 distributed (each rank's shard on its host): b0, b1, save @2, b2, save @3;
               later: load dev_dp1 @3, save it again at once (@3b), b3, save @4
    dev_dp1    megatron's optimizer, DP 1 replicated: load host_dp2 @2, save it again at once (@2b), b2, save @3,
               b3, save @4
    With bf16 weights a change of DP size regroups the samples into other micro-batches, whose bf16 forward
    rounds otherwise (measured 0.06 lr per update here, beyond docs/resume.md's contract, stated for fp32): the
    checkpoint chain runs one sample per micro-batch with fp32 gradients, so that only fp32 sums change order.
    """
    root, vocab = tiny["root"], tiny["vocab"]
    b = [_batch(vocab, seed=0)]
    small = [_batch(vocab, n=16, seed=s) for s in range(4)]  # the chain's batches, one sample per micro-batch
    metrics: dict = {}

    def do(group, name, steps):
        for what, arg in steps:
            if what == "train":
                metrics.setdefault(name, []).append(group.call("train", arg)[0])
            else:
                group.call(what, str(root / arg))

    for name, host in (("tp2_dev", False), ("tp2_host", True)):
        group = _group(tiny, tp=2, host=host)
        try:
            do(group, name, [("train", b[0]), ("save", f"{name}@1")])
        finally:
            group.kill()
    # one sample per micro-batch and fp32 gradients: each sample's bf16 forward and backward is the same at DP 1 and
    # DP 2, and only the fp32 sums over samples and ranks change order with the DP size
    chain = dict(grad_dtype="float32", micro_batch_size=1, global_batch_size=16)
    host = _group(tiny, dp=2, distributed=True, host=True, **chain)
    dev = None
    try:
        do(host, "host_dp2", [("train", small[0]), ("train", small[1]), ("save", "host_dp2@2"), ("train", small[2]),
                              ("save", "host_dp2@3")])
        dev = _group(tiny, **chain)
        do(dev, "dev_dp1", [("load", "host_dp2@2"), ("save", "dev_dp1@2b"), ("train", small[2]), ("save", "dev_dp1@3"),
                            ("train", small[3]), ("save", "dev_dp1@4")])
        do(host, "host_dp2", [("load", "dev_dp1@3"), ("save", "host_dp2@3b"), ("train", small[3]),
                              ("save", "host_dp2@4")])
    finally:
        for g in (host, dev):
            if g is not None:
                g.kill()
    return metrics


def _update_diff(tiny, a: str, b: str) -> float:
    return _max_diff(fp32_masters(tiny["root"] / a, tiny["root"]), fp32_masters(tiny["root"] / b, tiny["root"]))


def test_host_step_matches_megatron_at_tp2(tiny, ranked):
    """One update at TP 2 with bf16 gradients: the grad norm summed over the TP split (duplicates counted once)
    as megatron sums it, the masters within the contract."""
    gh, gd = ranked["tp2_host"][0]["grad_norm"], ranked["tp2_dev"][0]["grad_norm"]
    assert gh == pytest.approx(gd, rel=1e-6) and gd > TRAIN["clip_grad"], (gh, gd)
    diff = _update_diff(tiny, "tp2_host@1", "tp2_dev@1")
    print(f"TP 2, host vs megatron, one update: max |d master| = {diff:.3g}")
    assert diff <= PER_UPDATE, diff


def test_checkpoints_move_between_host_and_device_optimizers_and_dp_sizes(tiny, ranked):
    """The host optimizer's DP-2 (distributed) checkpoint loads into megatron's optimizer at DP 1, and that one's
    back into the host optimizer at DP 2: each load restores bitwise what was saved (saved again at once, it is
    the same checkpoint), and the update after it stays within the contract of the unbroken run's."""
    root = tiny["root"]
    for src, resaved, resumed_next, unbroken_next in (("host_dp2@2", "dev_dp1@2b", "dev_dp1@3", "host_dp2@3"),
                                                      ("dev_dp1@3", "host_dp2@3b", "host_dp2@4", "dev_dp1@4")):
        saved, again = checkpoint_tensors(root / src, root), checkpoint_tensors(root / resaved, root)
        assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in saved)
        assert any(k.startswith("optimizer.state.fp32_param.") for k in saved)
        assert saved.keys() == again.keys()
        assert all(torch.equal(saved[k], again[k]) for k in saved), resaved
        diff = _update_diff(tiny, resumed_next, unbroken_next)
        print(f"{src} resumed as {resaved}: its next update vs the unbroken run's: max |d master| = {diff:.3g}")
        assert diff <= PER_UPDATE, (resaved, diff)
        assert moved_away(fp32_masters(root / resumed_next, root), fp32_masters(root / src, root))


def test_megatrons_hybrid_optimizer_keeps_the_fp32_master_beside_the_weights_without_te(tiny, monkeypatch):
    """Why runtime/trainer/host_optimizer.py exists (megatron-core 0.16.1, no Transformer Engine): the
    HybridDeviceOptimizer path that keeps the master on the host (the precision-aware optimizer) cannot be
    configured, and the one that can leaves megatron's fp32 master where the weights are and steps it there."""
    import contextlib

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from runtime.mcore import env as menv
    from runtime.models import load_hf_config
    kw = dict(optimizer="adam", bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
              optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    with pytest.raises(TypeError):  # is_te_min_version() without TE, before optimizer_cpu_offload is looked at
        OptimizerConfig(use_precision_aware_optimizer=True, **kw)
    config = OptimizerConfig(**kw)
    assert not config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    menv.ensure_parallel("cpu")
    model = menv.build_gpt_model(load_hf_config(tiny["hf"]), dtype=torch.bfloat16, device="cpu")

    class _Stream:  # HybridDeviceOptimizer asks CUDA for streams even for CPU parameters
        def wait_stream(self, *_):
            pass

        def record_event(self):
            return type("Event", (), {"synchronize": lambda self: None})()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    with menv.cuda_to_cpu():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      model)
        opt = get_megatron_optimizer(config, [ddp]).chained_optimizers[0]
    assert type(opt.optimizer).__name__ == "HybridDeviceOptimizer"
    masters = [m for group in opt.shard_fp32_from_float16_groups for m in group]
    weight_device = next(model.parameters()).device
    # the distributed optimizer made an fp32 master of every weight, on the weights' device ...
    assert masters and all(m.dtype == torch.float32 and m.device == weight_device for m in masters)
    # ... and the hybrid optimizer steps those very tensors (on a GPU: a pinned host copy of each, copied back
    # into it after every step)
    stepped = [p for group in opt.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in stepped} == {id(m) for m in masters}
