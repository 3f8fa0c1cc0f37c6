"""The parallel layout: data parallelism derived from the GPUs, and one-line errors for layouts that
cannot run (model shapes vs TP, rollout GPUs vs engines, GPUs on offer)."""
from __future__ import annotations

import pytest
from transformers import Qwen3Config

from runtime.placement import layout
from runtime.config import config_from_dict
from runtime.errors import ConfigError


def cfg(**sections):
    tree = {"rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 8},
            "train": {"global_batch_size": 64, "micro_batch_size": 8}}
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return config_from_dict(tree, "c.yaml")


QWEN3_06B = Qwen3Config(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=128, intermediate_size=3072, vocab_size=151936)


def test_data_parallel_is_derived_from_trainer_gpus():
    assert cfg(cluster={"trainer_gpus": 4}, train={"tensor_parallel": 2}).train.data_parallel == 2
    assert cfg(cluster={"trainer_gpus": 2}).train.data_parallel == 2
    assert cfg().train.data_parallel == 1
    with pytest.raises(ConfigError, match=r"c.yaml: cluster.trainer_gpus=2 but train.data_parallel × "
                                          r"train.tensor_parallel = 1 × 1 = 1"):
        cfg(cluster={"trainer_gpus": 2}, train={"data_parallel": 1})
    with pytest.raises(ConfigError, match=r"global_batch_size=64 must be divisible by train.data_parallel × "
                                          r"train.micro_batch_size = 16 × 8"):
        cfg(cluster={"trainer_gpus": 16})


@pytest.mark.parametrize("tp, match", [(3, "does not divide the model's 16 attention heads"),
                                       (16, "does not divide the model's 8 key/value heads")])
def test_tensor_parallel_must_divide_heads(tp, match):
    with pytest.raises(ConfigError, match=match) as e:
        layout.check_layout(cfg(train={"tensor_parallel": tp}), hf_config=QWEN3_06B)
    assert "\n" not in str(e.value)
    layout.check_layout(cfg(train={"tensor_parallel": 8}), hf_config=QWEN3_06B)


def test_gpus_on_offer_and_rollout_gpus():
    split = cfg(cluster={"trainer_gpus": 2, "rollout_gpus": 1, "colocate": False})
    layout.check_layout(split, gpus_available=3)
    with pytest.raises(ConfigError, match=r"needs 3 GPU\(s\) \(cluster.trainer_gpus=2 \+ rollout_gpus=1\) but "
                                          r"this machine has 2"):
        layout.check_layout(split, gpus_available=2)
    layout.check_layout(cfg(cluster={"trainer_gpus": 2, "rollout_gpus": 1}), gpus_available=2)  # colocated
    with pytest.raises(ConfigError, match=r"rollout.sglang.num_engines × sglang.tp_size = 2 × 1"):
        layout.check_layout(cfg(cluster={"trainer_gpus": 4, "rollout_gpus": 4},
                                rollout={"engine": "sglang", "sglang": {"num_engines": 2}}))


def test_placement_and_weight_sync_path():
    split = cfg(cluster={"trainer_gpus": 1, "rollout_gpus": 1, "colocate": False})
    assert layout.engine_gpus(split)[0] == 1 and layout.weight_sync_mode(split) == "broadcast"
    dp2 = cfg(cluster={"trainer_gpus": 2, "rollout_gpus": 1})
    assert layout.engine_gpus(dp2)[0] == 0 and layout.weight_sync_mode(dp2) == "direct"
    assert layout.weight_sync_mode(cfg(cluster={"weight_sync": "broadcast"})) == "broadcast"


def test_data_parallel_rollout_with_the_builtin_engine():
    """cluster.rollout_gpus > 1 with rollout.engine=builtin: one engine per rollout GPU, beside the trainer
    ranks (colocated) or on GPUs of their own; layouts that do not fit are one-line errors."""
    from runtime.plan.summary import layout_lines
    colocated = cfg(cluster={"trainer_gpus": 2, "rollout_gpus": 2})
    layout.check_layout(colocated, gpus_available=2)
    assert layout.rollout_engines(colocated) == 2 and layout.engine_gpus(colocated) == [0, 1]
    assert layout.weight_sync_mode(colocated) == "direct"
    split = cfg(cluster={"trainer_gpus": 2, "rollout_gpus": 2, "colocate": False})
    layout.check_layout(split, gpus_available=4)
    assert layout.engine_gpus(split) == [2, 3] and layout.weight_sync_mode(split) == "broadcast"
    assert layout.rollout_engines(cfg(cluster={"trainer_gpus": 4, "rollout_gpus": 4},
                                      rollout={"engine": "sglang", "sglang": {"num_engines": 4}})) == 1
    ray = {"backend": "ray"}  # GPUs are checked when the cluster starts
    assert layout_lines(cfg(cluster={**ray, "trainer_gpus": 2, "rollout_gpus": 2})) == [
        "layout        trainer DP 2 × TP 1 on GPUs 0-1; 2 built-in engines (one per GPU, the requests split "
        "between them) on GPUs 0-1 (shared with trainer ranks 0-1); weight sync direct (CUDA IPC: each engine reads "
        "its GPU's trainer rank in place) (GPUs checked when the cluster starts)"]
    assert "2 built-in engines (one per GPU, the requests split between them) on GPUs 2-3 of their own; " \
           "weight sync broadcast (NCCL from trainer rank 0)" in layout_lines(cfg(cluster={**ray, "trainer_gpus": 2, "rollout_gpus": 2,
                                                                "colocate": False}))[0]
    assert "engine on GPU 0 (shared with trainer rank 0)" in layout_lines(cfg(cluster={**ray, "trainer_gpus": 2,
                                                                                       "rollout_gpus": 1}))[0]
    for bad, match in [
        (cfg(cluster={"trainer_gpus": 2, "rollout_gpus": 4}),
         r"cluster.colocate=true shares the trainer's 2 GPU\(s\), but cluster.rollout_gpus=4; lower rollout_gpus "
         r"to <= 2 or set colocate=false"),
        (cfg(cluster={"rollout_gpus": 2}),
         r"cluster.rollout_gpus=2 with cluster.colocate=true puts one built-in engine on each trainer GPU, but "
         r"cluster.trainer_gpus=0 \(one device\); set cluster.trainer_gpus >= 2, or colocate=false"),
    ]:
        with pytest.raises(ConfigError, match=match) as e:
            layout.check_layout(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"needs 4 GPU\(s\) \(cluster.trainer_gpus=2 \+ rollout_gpus=2\) but "
                                          r"this machine has 3"):
        layout.check_layout(split, gpus_available=3)
    layout.check_layout(cfg(cluster={"rollout_gpus": 2, "device": "cpu"}))  # CPU engines (the tests' Ray actors)
