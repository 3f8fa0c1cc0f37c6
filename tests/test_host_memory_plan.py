"""The plan's host side (issue 36, runtime/plan/host_memory.py): GPU and host memory per node, the optimizer on the
host, the pinned buffers of the state offload, and `grpoflow validate`'s host row and one-line refusals."""
from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from runtime.config import load_config
from runtime.plan import host_memory
from runtime.plan.memory import estimate_for_config, estimate_memory

ROOT = Path(__file__).resolve().parents[1]
GLM = "configs/glm-z1-9b-dapo.yaml"
TWO_H100 = "configs/glm-z1-9b-dapo-2xh100.yaml"
# the ask: the 8 x H200 config on 2 x 80 GiB at TP 2
TP2_ON_2X80 = ["--gpu-mem-gb", "80", "--set", "cluster.trainer_gpus=2", "--set", "cluster.rollout_gpus=2", "--set",
               "train.data_parallel=1", "--set", "train.tensor_parallel=2", "--set", "train.recompute=full"]
ONE_CARD = ["--gpu-mem-gb", "80", "--host-mem-gb", "128", "--set", "cluster.trainer_gpus=1", "--set",
            "cluster.rollout_gpus=1", "--set", "train.data_parallel=1", "--set", "train.tensor_parallel=1", "--set",
            "train.recompute=full"]


def _glm():
    from runtime.plan.summary import known_config
    return known_config("zai-org/GLM-Z1-9B-0414")


def _validate(capsys, *args) -> tuple[int, str, list[str]]:
    code = main(["validate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def test_optimizer_on_host_moves_master_and_adam_off_the_gpu():
    glm = _glm()
    kw = dict(tp=2, dp=1, micro_batch_size=1, seq_len=9216, rollout_batch=128, max_new_tokens=8192, max_tokens=9216,
              recompute="full", offload=True, kv_cache_gb=40.0, host_memory_gb=256.0, trainer_ranks=2, processes=6)
    dev, host = (estimate_memory(glm, optimizer_on_host=on, **kw) for on in (False, True))
    per_rank = dev["params_per_gpu"]
    assert dev["bytes"]["optimizer"] == 12 * per_rank and host["bytes"]["optimizer"] == 0
    assert dev["bytes"]["grads"] == host["bytes"]["grads"] == 4 * per_rank  # the gradients stay on the GPU
    assert host["at_training"] < dev["at_training"] - 52 and host["fits"] and not dev["fits"]
    # on the host: 12 B per parameter of each of the node's two ranks, plus the step's chunk buffers
    h = host["host"]
    assert h["mode"] == "host" and h["bytes"]["optimizer"] == 2 * 12 * per_rank
    assert h["bytes"]["pinned"] == 2 * (host_memory.RING * host_memory.CHUNK_ELEMS * (4 + 2) + 4 * host_memory.CHUNK_ELEMS)
    # the GPU optimizer's state offload pins its gradients and every master and moment, each rounded to 2^k bytes
    d = dev["host"]
    assert d["mode"] == "offload" and d["bytes"]["optimizer"] == 0
    assert d["bytes"]["pinned"] > 2 * 16 * per_rank  # more than the bytes themselves: the power-of-two rounding
    # the distributed optimizer at DP 2 shards the host's state as it does the GPU's
    dp2 = estimate_memory(glm, **{**kw, "tp": 1, "dp": 2, "distributed_optimizer": True, "optimizer_on_host": True})
    assert dp2["host"]["bytes"]["optimizer"] == 2 * 12 * -(-dp2["params_per_gpu"] // 2)


def test_pinned_buffers_round_up_to_powers_of_two():
    assert [host_memory._pinned(n) for n in (0, 1, 2, 3, 1000, 1 << 30, (1 << 30) + 1)] == \
        [0, 1, 2, 4, 1024, 1 << 30, 1 << 31]


def test_the_tp2_refusal_on_2x80_names_the_optimizer_on_the_host(capsys):
    """The issue's ask: the 8 x H200 config at TP 2 on 2 x 80 GiB refused at 115 GiB per GPU (116.5 since the plan
    counts the Ray engine's own process: a second CUDA context and allocator slack); the one line now names the
    setting that fits."""
    code, out, err = _validate(capsys, GLM, *TP2_ON_2X80)
    assert code == 2 and len(err) == 1, err
    assert "needs 116.5 GiB per GPU" in err[0] and "fits with train.optimizer_on_host=true (" in err[0]
    assert "host memory per node (2 trainer ranks" in out and "DOES NOT FIT" in out


def test_the_2xh100_config_fits_gpu_and_host(capsys):
    code, out, err = _validate(capsys, TWO_H100)
    assert code == 0 and not err, err
    assert "fp32 master + Adam m, v" in out and "on the host (train.optimizer_on_host)" in out
    # Ray actors: each GPU holds a trainer rank's process and an engine's, and the plan counts both
    assert "2.70 GiB   CUDA contexts and allocator slack of two processes (trainer, engine)" in out
    host_rows = out[out.index("host memory per node"):].splitlines()
    assert host_rows[1].split()[:2] == ["optimizer", "105.06"]  # 2 ranks x 12 B x 4.70 G parameters
    assert "of 256 GiB (cluster.host_memory_gb): fits" in out and "config is valid" in out
    cfg = load_config(ROOT / TWO_H100)
    est = estimate_for_config(cfg, _glm())
    assert est["fits"] and est["optimizer_on_host"] and est["bytes"]["optimizer"] == 0
    assert est["total"] <= 79.2 and est["host"]["total"] <= 256 and est["host"]["source"] == "cluster.host_memory_gb"
    # after each update both TP ranks gather the bf16 weights for the engines beside their gradients, one unit (the
    # embedding, a layer, the head) at a time: the CUDA IPC path streams them (the largest, GLM's untied embedding)
    from runtime.plan.shape import model_shape
    m = model_shape(_glm())
    assert est["bytes"]["sync_gather"] == m["V"] * m["h"] * 2 < est["bytes"]["engine_weights"] / 10
    assert est["at_sync"] < est["at_training"] < est["at_rollout"] == est["total"]
    # the seed's run, laid out for 2 GPUs: only the layout differs from the 8 x H200 config
    seed = load_config(ROOT / GLM)
    assert (cfg.rollout, cfg.data, cfg.algorithm, cfg.eval) == (seed.rollout, seed.data, seed.algorithm, seed.eval)


def test_one_card_with_128_gib_of_host_memory_is_refused_with_what_fits(capsys):
    """A layout that fits neither the GPU (211 GiB) nor the host (the state offload's pinned buffers): one line
    naming both, and the settings that fit both."""
    code, _, err = _validate(capsys, GLM, *ONE_CARD)
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert "GiB per GPU but the GPU has 80 GiB" in line and "GiB of host memory per node but the node has 128 GiB" in line
    assert "fits with train.optimizer_on_host=true, train.grad_dtype=bfloat16, checkpoint.background=false (" in line
    code, out, err = _validate(capsys, GLM, *ONE_CARD, "--set", "train.optimizer_on_host=true", "--set",
                               "train.grad_dtype=bfloat16", "--set", "checkpoint.background=false")
    assert code == 0, err
    assert "of 128 GiB (--host-mem-gb): fits" in out


def test_host_that_is_too_small_is_a_one_line_error(capsys):
    code, out, err = _validate(capsys, TWO_H100, "--host-mem-gb", "100")
    assert code == 2 and len(err) == 1, err
    assert "needs 124.1 GiB of host memory per node but the node has 100 GiB" in err[0]
    assert "fp32 master + Adam state of 2 trainer rank(s) on the host take 105.1 GiB" in err[0]
    assert "per GPU" not in err[0]  # the GPUs fit


def test_host_memory_default_scales_with_the_node_gpus():
    cfg = load_config(ROOT / GLM, ["cluster.gpu_memory_gb=null"])
    gb, source = host_memory.target_host_memory_gb(cfg, None, 80.0)
    assert gb == pytest.approx(host_memory.HOST_GIB_PER_GPU_GIB * 8 * 80) and "unset" in source
    cfg = load_config(ROOT / TWO_H100)
    assert host_memory.target_host_memory_gb(cfg, None, 80.0) == (256.0, "cluster.host_memory_gb")
    assert host_memory.target_host_memory_gb(cfg, 64.0, 80.0) == (64.0, "--host-mem-gb")
    assert host_memory.node_layout(cfg) == {"trainer_ranks": 2, "processes": 6, "gpus": 2}
    local = load_config(ROOT / TWO_H100, ["cluster.backend=local"])
    assert host_memory.node_layout(local)["processes"] == 5  # 2 trainer ranks + 2 engines + the driver


@pytest.mark.parametrize("flag, value", [("--gpu-mem-gb", "-5"), ("--gpu-mem-gb", "0"), ("--host-mem-gb", "0"),
                                         ("--host-mem-gb", "nan")])
def test_a_memory_size_that_is_not_positive_is_refused(capsys, flag, value):
    """A plan made for -5 GiB printed 'of -8 GiB' and refused for the wrong reason; the flag itself is the error."""
    with pytest.raises(SystemExit) as ended:
        main(["validate", "configs/qwen3-0.6b-dapo.yaml", flag, value])
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"{flag}: '{value}' is not a positive number of GiB")


def test_the_background_checkpoint_host_copy_is_the_checkpoint_rounded_as_pinned(capsys):
    """checkpoint.background keeps a host copy of what each rank writes: over the ranks, every trained tensor's fp32
    master (bf16 weights, themselves left out) or fp32 weights, and its two moments (split over the DP ranks), each
    rounded as a pinned block; the host optimizer's state is cloned (not pinned). Off, the term is gone."""
    numels = [3, 1000, 4096]
    pinned = host_memory._pinned
    bf16_dp2 = 2 * sum(2 * 3 * pinned(4 * -(-n // 2)) for n in numels)  # no bf16 weights: the masters are them
    assert host_memory.checkpoint_copy(numels, tp=2, dp=2, weight_bytes=2, optimizer_on_host=False) == bf16_dp2
    assert host_memory.checkpoint_copy(numels, tp=1, dp=1, weight_bytes=2, optimizer_on_host=True) == \
        sum(12 * n for n in numels)
    assert host_memory.checkpoint_copy(numels, tp=1, dp=1, weight_bytes=4, optimizer_on_host=False) == \
        sum(pinned(4 * n) + 2 * pinned(4 * n) for n in numels)  # fp32 weights are their own master
    code, out, _ = _validate(capsys, "configs/glm-z1-9b-dapo-4xh200.yaml")
    assert code == 0 and "checkpoint copy" in out
    code, out, _ = _validate(capsys, "configs/glm-z1-9b-dapo-4xh200.yaml", "--set", "checkpoint.background=false")
    assert code == 0 and "checkpoint copy" not in out
