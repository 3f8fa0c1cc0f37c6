"""Expert parallelism (``train.expert_parallel``) on the CPU: a tiny Qwen3-MoE of 4 experts, one process per rank
over gloo, trained at EP 2 × DP 2 and at EP 1 × DP 2 on one batch of ragged samples (the ranks' micro-batches of
different lengths; packed, of different counts too); a checkpoint from EP 2 resumed; its HF export.

A rank whose micro-batches do not pair up with its expert group's (shapes, counts) leaves the MoE layers' token
gathers waiting, and its peers in theirs. The timeout turns such a hang into a failure: by ending the process
(method="thread"), because the signal method's exception lands in the trainer group's reply loop, which drains
every member and so waits on the next hung one."""
from __future__ import annotations

import pytest
import torch

from runtime.config import GrpoConfig
from runtime.trainer.batch import TrainBatch
from tests.batches import ragged_batch

pytestmark = pytest.mark.timeout(600, method="thread")  # the first test's includes the fixtures' two groups

TRAIN = {"micro_batch_size": 4, "lr": 1e-3, "global_batch_size": 16}


def _batch(vocab: int, n: int = 16, seed: int = 0, lengths=None) -> TrainBatch:
    return ragged_batch(vocab, n, seed, lengths)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models import load_hf_config
    from runtime.models.tiny import build_tiny_qwen3
    root = tmp_path_factory.mktemp("expert-parallel")
    hf = build_tiny_qwen3(root / "hf", seed=3, hidden_size=64, num_layers=2, head_dim=16, ffn_hidden_size=64,
                          num_experts=4)["path"]
    hf_to_torch_dist(hf, str(root / "td"))
    return {"hf": str(hf), "td": str(root / "td"), "root": root, "vocab": load_hf_config(hf).vocab_size}


def _group(tiny, ep: int, dp: int = 2, model: dict | None = None, **train):
    from runtime.placement.cluster import Cluster
    cfg = GrpoConfig.model_validate({
        "model": model or {},
        "cluster": {"backend": "local", "device": "cpu"},
        "data": {"max_prompt_len": 12},
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 8, "max_new_tokens": 8},
        "algorithm": {"kl_coef": 0.0, "use_tis": True},
        "train": {**TRAIN, "data_parallel": dp, "expert_parallel": ep, **train}})
    return Cluster(cfg).trainer(in_subprocesses=True, hf_dir=tiny["hf"], init_checkpoint=tiny["td"], train=cfg.train,
                                algorithm=cfg.algorithm, temperature=1.0).group


def _copies(per_rank: list[dict]) -> list[dict]:
    """Tensors from a rank, copied at once: on the CPU a weight comes through shared memory as the trainer's own
    parameter, which its next step changes in place."""
    return [{k: v.clone() for k, v in d.items()} for d in per_rank]


def _session(tiny, ep: int, name: str, distributed: bool = False) -> dict:
    """Train b0, save, train b1: every rank's metrics, gradients, weights (and what the sync sends) on the way."""
    b0, b1 = _batch(tiny["vocab"], seed=0), _batch(tiny["vocab"], seed=1)
    group = _group(tiny, ep, distributed_optimizer=distributed)
    try:
        out = {"m0": group.call("train", b0), "grads": group.call("grads"), "weights": _copies(group.call("hf_weights")),
               "meta": group.call("weights_metadata"), "shard_units": [{}, {}]}
        # what each rank hands the engine shard on its GPU (rollout.expert_shards 2), a unit at a time
        while (units := group.call("next_weight_unit", 2))[0] is not None:
            for rank, unit in enumerate(_copies(units)):
                out["shard_units"][rank].update(unit)
        group.call("release_shared_weights", True)
        group.call("save", str(tiny["root"] / name))
        out["m1"] = group.call("train", b1)
        out["w1"] = _copies(group.call("hf_weights"))[0]
        return out
    finally:
        group.kill()


@pytest.fixture(scope="module")
def ep1(tiny_moe):
    return _session(tiny_moe, 1, "ep1@1")


@pytest.fixture(scope="module")
def ep2(tiny_moe):
    return _session(tiny_moe, 2, "ep2@1")


def test_ep2_trains_as_ep1(ep1, ep2):
    # the ranks' micro-batches are of different lengths: EP 2 pads them to one shape, and the routers' losses skip
    # that padding (EP 1 has none)
    _equal(ep2, ep1)
    # the weights the engine gets: every expert, from rank 0 only; the same tensors as EP 1 sends
    assert ep2["weights"][1] == {} and ep2["meta"][1] == []
    assert ep2["meta"][0] == ep1["meta"][0]
    for k, v in ep1["weights"][0].items():
        assert torch.allclose(ep2["weights"][0][k], v, rtol=1e-5, atol=1e-6), (k, (ep2["weights"][0][k] - v).abs().max())


def _equal(ep2: dict, ep1: dict, keys=("loss", "pg_loss", "grad_norm", "router_aux_loss")) -> None:
    """EP 2's step is EP 1's: the metrics every rank reports, the gradients of every expert, within fp32 rounding."""
    for key in keys:
        assert key in ep1["m0"][0], key
        for m in ep2["m0"]:  # every rank reports the global numbers
            assert abs(m[key] - ep1["m0"][0][key]) <= 1e-5 * max(abs(ep1["m0"][0][key]), 1e-3), (key, m, ep1["m0"][0])
    assert [k for k in ep2["grads"][0] if "local_experts" in k] and ep2["grads"][0].keys() == ep1["grads"][0].keys()
    for g in ep2["grads"]:  # every rank's gathered gradients: all 4 experts, equal to EP 1's
        for k, v in ep1["grads"][0].items():  # to fp32 rounding at the tensor's scale (EP 2 sums in another order: the
            # packed step's embedding gradient 2.6e-8 apart at a largest entry of 0.068, its smallest entries near 0)
            assert torch.allclose(g[k], v, rtol=1e-5, atol=1e-5 * float(v.abs().max())), k


# rank 0's samples (the first 8) long, rank 1's short: under a 24-token budget rank 0 packs 8 micro-batches and
# rank 1 3, so rank 1 runs 5 of padding only, and every micro-batch is padded to its group's most tokens
SKEWED = [(12, 4 + i % 5) for i in range(8)] + [(3, 3 + i % 4) for i in range(8)]


def _packed_step(tiny, ep: int, **train) -> dict:
    batch = _batch(tiny["vocab"], seed=2, lengths=SKEWED)
    group = _group(tiny, ep, max_tokens_per_micro_batch=24, router_z_loss_coef=1e-3, **train)
    try:
        return {"m0": group.call("train", batch), "grads": group.call("grads")}
    finally:
        group.kill()


@pytest.mark.slow  # two trainer groups of its own
def test_packed_micro_batches_of_different_counts_and_grouped_experts_train_at_ep2_as_at_ep1(tiny_moe):
    """EP 2 with the experts as grouped GEMMs (train.moe_grouped_gemm) against EP 1 with megatron's loop over them."""
    from runtime.trainer.batch import step_slices
    lengths = [p + r for p, r in SKEWED]
    counts = [len(step_slices(16, 1, 2, r, 4, lengths=lengths, max_tokens=24)[0]) for r in range(2)]
    assert counts[0] > counts[1], counts  # what the test is about
    _equal(_packed_step(tiny_moe, 2, moe_grouped_gemm="on"), _packed_step(tiny_moe, 1, moe_grouped_gemm="off"),
           keys=("loss", "pg_loss", "grad_norm", "router_aux_loss", "router_z_loss"))


def test_ep2_checkpoint_resumes_bitwise_and_exports_every_expert(tiny_moe, ep2):
    from runtime.models import load_hf_config
    from runtime.tracking.model_registry import export_trainer_checkpoint
    from safetensors.torch import load_file
    root = tiny_moe["root"]
    group = _group(tiny_moe, 2)
    try:
        group.call("load", str(root / "ep2@1"))
        m1 = group.call("train", _batch(tiny_moe["vocab"], seed=1))
        w1 = _copies(group.call("hf_weights"))[0]
    finally:
        group.kill()
    assert m1[0]["loss"] == ep2["m1"][0]["loss"] and m1[0]["grad_norm"] == ep2["m1"][0]["grad_norm"]
    assert w1.keys() == ep2["w1"].keys() and all(torch.equal(w1[k], ep2["w1"][k]) for k in w1)
    # the HF export of the EP 2 checkpoint (read at EP 1): the weights rank 0 gathered from both expert ranks
    out = root / "ep2-export"
    export_trainer_checkpoint(root / "ep2@1", tiny_moe["hf"], out)
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    experts = load_hf_config(tiny_moe["hf"]).num_experts
    assert {f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(experts)} <= exported.keys()
    for k, v in exported.items():
        assert torch.equal(v, ep2["weights"][0][k].to(v.dtype)), k


@pytest.mark.parametrize("ep", [1, 2])
def test_each_rank_hands_the_engine_shard_on_its_gpu_only_that_shards_experts(ep, request):
    """rollout.expert_shards 2 beside trainer ranks 0 and 1: rank r's units hold shard r's experts (2r, 2r + 1 of 4)
    and everything else, as the whole weights have them; at EP 2 they are the rank's own experts, nothing gathered."""
    from runtime.rollout.expert_shards import hub_expert
    session = request.getfixturevalue(f"ep{ep}")
    whole = session["weights"][0]
    for rank, got in enumerate(session["shard_units"]):
        assert got.keys() == {k for k in whole if hub_expert(k) is None or hub_expert(k)[1] // 2 == rank}, rank
        assert all(torch.equal(got[k], whole[k]) for k in got), rank


def test_the_distributed_optimizer_resumes_an_ep2_checkpoint(tiny_moe, ep2):
    """megatron's distributed optimizer over the dense and the expert DP groups (here DP 2 and expert-DP 1) reads
    the layout-free format the replicated one wrote, and writes it back (runtime/trainer/optimizer_checkpoint.py)."""
    root = tiny_moe["root"]
    group = _group(tiny_moe, 2, distributed_optimizer=True)
    try:
        group.call("load", str(root / "ep2@1"))
        group.call("save", str(root / "ep2-dist@1"))
        group.call("load", str(root / "ep2-dist@1"))
        m1 = group.call("train", _batch(tiny_moe["vocab"], seed=1))
        w1 = _copies(group.call("hf_weights"))[0]
    finally:
        group.kill()
    assert m1[0]["loss"] == ep2["m1"][0]["loss"]  # the same weights before the step
    assert abs(m1[0]["grad_norm"] - ep2["m1"][0]["grad_norm"]) <= 1e-6 * ep2["m1"][0]["grad_norm"]
    for k, v in ep2["w1"].items():  # Adam's state came back: the step is the replicated one's within rounding
        assert torch.allclose(w1[k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.slow  # two trainer groups of its own
def test_the_host_optimizer_steps_at_ep2_as_megatrons_distributed_one(tiny_moe):
    """train.optimizer_on_host under expert parallelism: megatron chains the dense parameters' optimizer (DP 2) and the
    experts' own (expert-DP 1); the host step plans both into chunks and clips by the chained norm. One update of bf16
    weights from the same state, against megatron's distributed optimizer on the device: the grad norm as megatron
    sums it (the clip applies: clip_grad below it), every fp32 master, experts' included, within rounding; each
    checkpoint's HF export is the trainer's weights; the host one resumed steps as the unbroken run, bit for bit."""
    from tests.checkpoints import fp32_masters
    root, lr, b0, b1 = tiny_moe["root"], TRAIN["lr"], _batch(tiny_moe["vocab"], seed=0), _batch(tiny_moe["vocab"], seed=1)
    out = {}
    for name, host in (("dev", False), ("host", True)):
        group = _group(tiny_moe, 2, distributed_optimizer=True, optimizer_on_host=host, clip_grad=0.05,
                       model={"dtype": "bfloat16"})
        try:
            before = _copies(group.call("hf_weights"))[0]
            out[name] = {"m0": group.call("train", b0), "after": _copies(group.call("hf_weights"))[0],
                         "before": before}
            group.call("save", str(root / f"ep2-{name}-bf16@1"))
            if host:  # the step after the checkpoint, which a resumed run must repeat bit for bit
                out[name].update(m1=group.call("train", b1), w1=_copies(group.call("hf_weights"))[0])
        finally:
            group.kill()
    group = _group(tiny_moe, 2, distributed_optimizer=True, optimizer_on_host=True, clip_grad=0.05,
                   model={"dtype": "bfloat16"})
    try:  # the resume: the host optimizer's chained state and the masters of both optimizers back from the checkpoint
        group.call("load", str(root / "ep2-host-bf16@1"))
        m1, w1 = group.call("train", b1), _copies(group.call("hf_weights"))[0]
    finally:
        group.kill()
    assert m1[0]["loss"] == out["host"]["m1"][0]["loss"] and m1[0]["grad_norm"] == out["host"]["m1"][0]["grad_norm"]
    assert all(torch.equal(w1[k], v) for k, v in out["host"]["w1"].items())
    gd, gh = out["dev"]["m0"][0]["grad_norm"], out["host"]["m0"][0]["grad_norm"]
    assert gh == pytest.approx(gd, rel=1e-6) and gd > 0.05, (gh, gd)
    dev, host = (fp32_masters(root / f"ep2-{n}-bf16@1", root) for n in ("dev", "host"))
    assert dev.keys() == host.keys() and any("experts" in k for k in dev)
    diff = max(float((dev[k] - host[k]).abs().max()) for k in dev)
    assert diff <= 1e-2 * lr, diff  # the per-update contract (docs/resume.md), as tests/test_host_optimizer.py
    moved = [k for k, v in out["host"]["after"].items() if not torch.equal(v, out["host"]["before"][k])]
    assert any("experts" in k for k in moved) and any("experts" not in k for k in moved), moved
    # the registry's export of such a checkpoint: bf16 weights are left to their masters, which the chained optimizers
    # store under their own prefixes; the export gives back the trainer's weights bitwise
    from safetensors.torch import load_file

    from runtime.tracking.model_registry import export_trainer_checkpoint
    for name in ("dev", "host"):
        export_trainer_checkpoint(root / f"ep2-{name}-bf16@1", tiny_moe["hf"], root / f"ep2-{name}-bf16-export")
        exported = {k: v for f in (root / f"ep2-{name}-bf16-export").glob("*.safetensors")
                    for k, v in load_file(str(f)).items()}
        assert exported.keys() <= out[name]["after"].keys() and any("experts" in k for k in exported)  # a tied head: once
        assert all(torch.equal(v, out[name]["after"][k].to(v.dtype)) for k, v in exported.items()), name


def test_a_resume_that_changes_expert_parallel_is_refused_in_one_line(tiny_moe, ep2):
    from runtime.errors import ConfigError
    from runtime.trainer import expert_parallel
    path = str(tiny_moe["root"] / "ep2@1")
    expert_parallel.check_resume(path, 2)  # what MegatronTrainer.load runs first
    with pytest.raises(ConfigError, match="written at train.expert_parallel=2, not 1") as e:
        expert_parallel.check_resume(path, 1)
    assert "\n" not in str(e.value)


def test_expert_parallel_settings_are_checked_in_one_line(tiny_moe):
    from runtime.config import config_from_dict
    from runtime.errors import ConfigError
    from runtime.models import load_hf_config
    from runtime.trainer import expert_parallel
    with pytest.raises(ConfigError, match="train.expert_parallel=3 must divide train.data_parallel=2") as e:
        config_from_dict({"train": {"data_parallel": 2, "expert_parallel": 3}}, "cfg.yaml")
    assert "\n" not in str(e.value)
    cfg = GrpoConfig.model_validate({"train": {"data_parallel": 8, "expert_parallel": 8, "global_batch_size": 64,
                                               "micro_batch_size": 1},
                                     "rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 8}})
    with pytest.raises(ConfigError, match="must divide the model's num_experts=4"):
        expert_parallel.check(cfg.train, load_hf_config(tiny_moe["hf"]), 8)
