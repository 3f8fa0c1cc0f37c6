"""The plan's mixture-of-experts terms (runtime/plan/moe_terms.py) on Qwen3-30B-A3B's shape: each moves with the
setting it is a function of, and each is a share of the row it belongs to (nothing counted twice or left out)."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.plan import moe_terms
from runtime.plan.activations import layer_bytes_per_token
from runtime.plan.memory import estimate_memory
from runtime.plan.summary import known_config

ROOT = Path(__file__).resolve().parents[1]
SEQ, NEW = 9216, 8192


def _moe(**overrides):
    cfg = known_config("Qwen/Qwen3-30B-A3B")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _est(hf=None, **kw):
    args = dict(tp=1, dp=4, micro_batch_size=1, seq_len=SEQ, rollout_batch=128, max_new_tokens=NEW,
                gpu_mem_gb=1e4, kv_cache_gb=8.0, distributed_optimizer=True, grad_dtype="bfloat16", recompute="full")
    return estimate_memory(hf if hf is not None else _moe(), **{**args, **kw})


def test_expert_parallelism_splits_the_experts_terms_and_not_the_rest():
    e1, e2, e4 = (_est(ep=ep)["moe"]["bytes"] for ep in (1, 2, 4))
    for term in ("experts_weights", "experts_grads"):
        assert e1[term] == 2 * e2[term] == 4 * e4[term] > 0
    # the router is on every rank, and the built-in engine keeps every expert of its replica whatever the trainer's EP
    assert e1["router_weights"] == e4["router_weights"] > 0
    assert e1["engine_experts"] == e4["engine_experts"] == e1["experts_weights"]
    # the weights row drops by exactly the experts' share
    w1, w4 = _est(ep=1)["bytes"]["weights"], _est(ep=4)["bytes"]["weights"]
    assert w1 - w4 == e1["experts_weights"] - e4["experts_weights"]


def test_the_experts_optimizer_is_sharded_over_the_expert_data_parallel_ranks():
    state = 12  # fp32 master of bf16 weights + Adam m, v
    ep1, ep2, ep4 = (_est(ep=ep)["moe"] for ep in (1, 2, 4))
    # DP 4: over 4 ranks at EP 1, over 2 at EP 2, over none at EP 4 (the experts' group holds each expert once)
    assert ep1["bytes"]["experts_optimizer"] == ep1["bytes"]["experts_grads"] // 2 * state // 4
    assert ep2["bytes"]["experts_optimizer"] == ep2["bytes"]["experts_grads"] // 2 * state // 2
    assert ep4["bytes"]["experts_optimizer"] == ep4["bytes"]["experts_grads"] // 2 * state
    whole = _est(ep=2, distributed_optimizer=False)["moe"]["bytes"]
    assert whole["experts_optimizer"] == 2 * ep2["bytes"]["experts_optimizer"]
    assert _est(ep=4)["optimizer"] > ep4["experts_optimizer"] > 0.9 * _est(ep=4)["optimizer"]


def test_the_host_optimizer_holds_the_experts_state_instead_of_the_gpu():
    est = _est(dp=2, optimizer_on_host=True, host_memory_gb=512, trainer_ranks=2, processes=6)
    moe = est["moe"]["bytes"]
    assert moe["experts_optimizer"] == 0 and est["bytes"]["optimizer"] == 0
    # 12 B a parameter on the host, each of the 2 ranks half of the experts (distributed optimizer)
    assert moe["host_optimizer"] == 2 * 12 * (moe["experts_weights"] // 2 // 2)
    assert moe["host_optimizer"] < est["host"]["bytes"]["optimizer"] < 1.1 * moe["host_optimizer"]


def test_top_k_doubles_the_dispatcher_and_the_experts_activations():
    k4, k8 = (_est(hf=_moe(num_experts_per_tok=k), ep=1)["moe"]["bytes"] for k in (4, 8))
    assert k8["experts_activations"] == 2 * k4["experts_activations"] > 0
    # the k routed bf16 copies of each token double; the local routing maps (2 bytes an expert) do not
    assert 1.98 < k8["dispatcher"] / k4["dispatcher"] < 2.0
    assert k8["router_activations"] > k4["router_activations"]


def test_the_dispatcher_gathers_the_expert_groups_tokens_into_one_buffer():
    buffers = [_est(ep=ep)["moe"]["bytes"]["dispatcher_buffer"] for ep in (1, 2, 4)]
    assert buffers[0] == 0  # nothing is gathered at TP = EP = 1
    assert buffers[2] == 2 * buffers[1] == 4 * SEQ * 2048 * 2  # [tokens x EP, hidden] in bf16
    # the routed copies a rank keeps do not grow with EP (balanced routes: k per token of the rank)
    kept = [_est(ep=ep)["moe"]["bytes"]["dispatcher"] - b for ep, b in zip((1, 2, 4), buffers)]
    assert kept[0] == kept[1] == kept[2] > 0


def test_the_routers_fp32_scores_grow_with_the_experts_and_need_the_load_balancing_loss():
    e128, e256 = (_est(hf=_moe(num_experts=n))["moe"]["bytes"]["router_activations"] for n in (128, 256))
    assert 1.8 < e256 / e128 < 2.0  # the softmax over every expert doubles, the top-k's tensors do not
    no_aux = _est(hf=_moe(router_aux_loss_coef=0.0))["moe"]["bytes"]["router_activations"]
    assert 0 < no_aux < e128 / 5


def test_each_activation_share_grows_with_the_tokens_and_stays_inside_the_row():
    short, long = _est(recompute="none", seq_len=2 * NEW, max_new_tokens=NEW), \
        _est(recompute="none", seq_len=4 * NEW, max_new_tokens=NEW)
    for term in ("router_activations", "dispatcher", "experts_activations"):
        assert long["moe"]["bytes"][term] == 2 * short["moe"]["bytes"][term] > 0
    shares = sum(long["moe"]["bytes"][t] for t in ("router_activations", "dispatcher", "experts_activations"))
    assert shares < long["bytes"]["act_layers"]


def test_selective_mlp_recomputation_keeps_a_moe_layers_tensors():
    moe, dense = _moe(), known_config("Qwen/Qwen3-0.6B")
    assert layer_bytes_per_token(moe, recompute_modules=("mlp",)) == layer_bytes_per_token(moe)
    assert layer_bytes_per_token(dense, recompute_modules=("mlp",)) < layer_bytes_per_token(dense)
    full = _est(recompute="full")["activations"]
    assert _est(recompute="selective", recompute_modules=("layernorm", "mlp"))["activations"] > 5 * full


def test_the_engines_prefill_counts_the_routed_copies():
    from runtime.plan.engine_terms import paged_extra
    from runtime.plan.shape import model_shape
    shape = model_shape(_moe())
    kw = dict(live=64, per_row=False, seq_len=SEQ, prompt=1024, samples_per_prompt=8)
    extra = paged_extra(shape, 2, **kw) - paged_extra({**shape, "E": 0}, 2, **kw)
    # one pack holds the prompts of the 9 groups among 64 rows; each token's k routed copies in and out, the router's
    assert extra == 9 * 1024 * moe_terms.engine_prefill_bytes_per_token(shape, 2) > 9 * 1024 * 2 * 8 * 2048 * 2


def test_a_dense_model_has_no_moe_terms():
    est = _est(hf=known_config("Qwen/Qwen3-0.6B"), dp=1)
    assert est["moe"] is None
    assert est["act_layers"] > 0


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallelism_is_refused_for_a_mixture_of_experts(tp):
    from runtime.config import load_config
    from runtime.errors import ConfigError
    from runtime.placement.layout import check_layout
    cfg = load_config(ROOT / "configs/qwen3-30b-a3b-dapo-4xh200.yaml")
    cfg.train.tensor_parallel, cfg.train.data_parallel = tp, 2 // tp or 1
    with pytest.raises(ConfigError, match="sequence parallelism"):
        check_layout(cfg, hf_config=_moe())
    assert _est(tp=1)["max_tp"] == 1  # what the plan's advice reads


def test_a_broadcast_sync_gathers_one_layer_with_its_experts_not_the_model():
    """cluster.weight_sync broadcast and the colocated CUDA IPC path stream the weights a unit at a time
    (runtime/trainer/tp_gather.py gathered_units): the sync's gather is the largest unit, one layer with every
    expert; a direct sync through host memory hands a whole copy over."""
    from runtime.plan.shape import model_shape, shape_param_counts
    m = model_shape(_moe())
    n_params, _ = shape_param_counts(m)
    direct, host, streamed, ipc = (_est(ep=2, weight_sync=mode)["bytes"]["sync_gather"]
                                   for mode in ("direct", "host", "broadcast", "cuda_ipc"))
    assert direct == host == 2 * n_params and ipc == streamed
    assert streamed == 2 * (n_params - 2 * m["V"] * m["h"] - m["h"]) // m["L"]  # Qwen3-30B-A3B: a layer > the embedding
    assert direct > 40 * streamed
    assert _est(ep=1, weight_sync="broadcast")["bytes"]["sync_gather"] == 0  # TP = EP = 1: rank 0 holds it all


def test_engines_split_by_their_experts_hold_and_take_their_shard_of_the_experts():
    """rollout.expert_shards: each engine of a replica holds 1/n of the experts (the rest whole), and under the
    colocated CUDA IPC sync each trainer rank's unit holds only its GPU's engine shard's experts (a broadcast still
    sends every expert)."""
    from runtime.plan.shape import expert_params, model_shape
    m = model_shape(_moe())
    whole, quarter = (_est(ep=4, expert_shards=n, weight_sync="cuda_ipc") for n in (1, 4))
    experts = whole["moe"]["bytes"]["engine_experts"]
    assert experts == 2 * expert_params(m) and quarter["moe"]["bytes"]["engine_experts"] == experts // 4
    assert whole["bytes"]["engine_weights"] - quarter["bytes"]["engine_weights"] == experts - experts // 4
    assert whole["bytes"]["sync_gather"] - quarter["bytes"]["sync_gather"] == 2 * (expert_params(m) // m["L"] * 3 // 4)
    assert _est(ep=4, expert_shards=4, weight_sync="broadcast")["bytes"]["sync_gather"] == whole["bytes"]["sync_gather"]
