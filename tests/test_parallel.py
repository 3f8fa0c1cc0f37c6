"""Data and tensor parallelism of the trainer as Ray actors over gloo: one recorded rollout batch
replayed on DP=2 and on TP=2 gives the loss, gradients and update of one rank."""
from __future__ import annotations

import pytest
import torch

from runtime.placement.cluster import Cluster
from runtime.placement.groups import LocalGroup
from runtime.placement.handles import EngineHandle
from runtime.config import GrpoConfig
from runtime.trainer.batch import TrainBatch
from tests.batches import ragged_batch


def recorded_batch(vocab: int, n: int = 64, seed: int = 0) -> TrainBatch:
    return ragged_batch(vocab, n, seed)


def _run(tiny_checkpoint, dp: int, tp: int) -> dict:
    hf, td = tiny_checkpoint
    cfg = GrpoConfig.model_validate({
        "cluster": {"backend": "ray", "placement_timeout_s": 60},
        "train": {"data_parallel": dp, "tensor_parallel": tp, "micro_batch_size": 8, "lr": 1e-3},
        "algorithm": {"kl_coef": 0.0, "use_tis": True},
    })
    cluster = Cluster(cfg).start()
    try:
        trainer = cluster.trainer(hf_dir=hf, init_checkpoint=td, train=cfg.train,
                                  algorithm=cfg.algorithm, temperature=1.0)
        group = trainer.group  # per-rank results: every rank's metrics and gradients are compared
        from runtime.models import load_hf_config
        batch = recorded_batch(load_hf_config(hf).vocab_size)
        metrics = group.call("train", batch)
        grads = group.call("grads")
        weights = group.call("hf_weights")
        group.kill()
        return {"metrics": metrics, "grads": grads[0], "weights": weights[0], "all_grads": grads}
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def one_rank(ray_session, tiny_checkpoint):
    return _run(tiny_checkpoint, 1, 1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("dp, tp", [(2, 1), (1, 2)])
def test_parallel_matches_one_rank(ray_session, tiny_checkpoint, one_rank, dp, tp):
    run = _run(tiny_checkpoint, dp, tp)
    ref = one_rank["metrics"][0]
    for m in run["metrics"]:  # every rank reports the same, global numbers
        for key in ("loss", "pg_loss", "grad_norm", "clip_frac", "entropy"):
            assert abs(m[key] - ref[key]) <= 1e-5 * max(abs(ref[key]), 1e-3), (key, m[key], ref[key])
        assert m["train_tokens"] == ref["train_tokens"]
    assert run["grads"].keys() == one_rank["grads"].keys()
    worst = max(_rel(run["grads"][k], one_rank["grads"][k]) for k in run["grads"])
    assert worst <= 1e-5, worst
    # weights are not compared element-wise: Adam's first step is lr·g/(|g|+eps), so where |g| ~ eps a
    # 1e-7 gradient difference flips the update; the gradients themselves are the contract.
    assert run["weights"].keys() == one_rank["weights"].keys()
    # the two ranks agree with each other (replicas under DP, gathered shards under TP)
    for k in run["all_grads"][0]:
        assert torch.allclose(run["all_grads"][0][k], run["all_grads"][1][k], rtol=1e-6, atol=1e-9)


def test_unplaceable_layout_is_a_one_line_error(ray_session):
    from runtime.errors import ConfigError
    cfg = GrpoConfig.model_validate({"cluster": {"backend": "ray", "trainer_gpus": 2, "placement_timeout_s": 2},
                                     "train": {"micro_batch_size": 8}})
    with pytest.raises(ConfigError, match=r"needs 2 GPU\(s\) .* but the Ray cluster has 0") as e:
        Cluster(cfg).start()
    assert "\n" not in str(e.value)
    # 8 ranks + the engine want 9 CPU bundles from a 4-CPU cluster
    cfg = GrpoConfig.model_validate({"cluster": {"backend": "ray", "placement_timeout_s": 2},
                                     "train": {"data_parallel": 8, "micro_batch_size": 8}})
    with pytest.raises(ConfigError, match="cannot place 9 bundles"):
        Cluster(cfg).start()


def test_local_backend_tp2_processes_and_broadcast_weight_sync(tiny_checkpoint, one_rank, tmp_path):
    """cluster.backend=local: one spawned process per rank (the multi-GPU path, gloo here) trains like
    one Ray rank, and the weight broadcast puts exactly the trainer's weights into the engine."""
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.placement.subprocess_group import SubprocessGroup
    from runtime.placement.weight_sync import TrainerToEngine

    hf, td = tiny_checkpoint
    cfg = GrpoConfig.model_validate({
        "cluster": {"backend": "local", "weight_sync": "broadcast", "colocate": False},
        "train": {"tensor_parallel": 2, "micro_batch_size": 8, "lr": 1e-3},
        "algorithm": {"kl_coef": 0.0, "use_tis": True}})
    cluster = Cluster(cfg)
    assert cluster.trainer_in_subprocesses and cluster.weight_sync == "broadcast"
    trainer = cluster.trainer(hf_dir=hf, init_checkpoint=td, train=cfg.train,
                              algorithm=cfg.algorithm, temperature=1.0)
    group = trainer.group
    try:
        assert isinstance(group, SubprocessGroup) and len(set(group.call("pid"))) == 2
        from runtime.models import load_hf_config
        batch = recorded_batch(load_hf_config(hf).vocab_size)
        ref = one_rank["metrics"][0]
        for m in group.call("train", batch):
            for key in ("loss", "pg_loss", "grad_norm", "entropy"):
                assert abs(m[key] - ref[key]) <= 1e-5 * max(abs(ref[key]), 1e-3), (key, m[key], ref[key])

        engine = BuiltinEngine(hf)
        sync = TrainerToEngine(trainer, EngineHandle(LocalGroup([engine])), "broadcast", transport="host",
                               group_name="t_bcast")
        assert [n for n, _, _ in sync.metadata] == list(one_rank["weights"])
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        sent = sync.push(version=7)
        expected = trainer.hf_weights()
        state = engine.model.state_dict()
        assert engine.weight_version == 7
        assert all(torch.equal(state[k], v) for k, v in expected.items())
        assert any(not torch.equal(before[k], v) for k, v in expected.items())  # the update arrived
        # sent a unit at a time (the embedding, each layer, the head), each gathered whole only while it went: the
        # most rank 0 held at once is the largest unit, never the whole model
        per_unit: dict[str, int] = {}
        for k, v in expected.items():
            unit = ".".join(k.split(".")[:3]) if k.startswith("model.layers.") else (
                "embedding" if k == "model.embed_tokens.weight" else "head")
            per_unit[unit] = per_unit.get(unit, 0) + v.numel() * v.element_size()
        assert sent["bytes"] == sum(per_unit.values()) and sent["largest_unit_bytes"] == max(per_unit.values())
        assert sent["largest_unit_bytes"] < sent["bytes"]
        # the colocated path (CUDA IPC on GPUs) takes the same units, whole on every rank, in step: a stream stopped
        # part-way starts again from the first unit
        first = group.call("next_weight_unit")
        group.call("release_shared_weights", True)
        units = []
        while (got := group.call("next_weight_unit"))[0] is not None:
            assert all(set(u) == set(got[0]) and all(torch.equal(u[k], got[0][k]) for k in u) for u in got[1:])
            units.append(got[0])
            group.call("release_shared_weights")
        assert all(torch.equal(first[0][k], units[0][k]) for k in units[0]) and set(first[0]) == set(units[0])
        assert sorted(k for u in units for k in u) == sorted(expected)
        assert all(torch.equal(u[k], expected[k]) for u in units for k in u)
        assert max(sum(v.numel() * v.element_size() for v in u.values()) for u in units) == sent["largest_unit_bytes"]
        # engine and trainer agree on the log-probs of a sample after the sync
        sample = batch.tokens[0]
        p = batch.prompt_lens[0]
        engine_lp = engine.logprobs_of(sample[:p], sample[p:])
        one = TrainBatch([sample], [p], [0.0], [[1] * (len(sample) - p)], [[0.0] * (len(sample) - p)])
        trainer_lp = trainer.compute_logprobs(one)[0]
        assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp)) <= 1e-4
        # ending an in-process engine shuts it down: its memory and its side of the group go with it
        sync.engine.kill()
        assert not engine.health()["ok"] and not engine.weight_sync_ready()
    finally:
        group.kill()


def test_subprocess_group_errors():
    """A member's own exception comes back as itself; a member that dies is a transient error (the
    chunk's Prefect retry rebuilds the actors)."""
    import json
    import os
    import signal

    from runtime.errors import TransientError
    from runtime.placement.subprocess_group import ProcessDiedError, SubprocessGroup

    with pytest.raises(json.JSONDecodeError):
        SubprocessGroup("json:loads", [{"s": "{"}])
    group = SubprocessGroup("collections:Counter", [{"a": 1}, {"b": 2}])
    try:
        assert group.call("total") == [1, 2]
        with pytest.raises(TypeError):
            group.call("update", 5)
        assert group.call("most_common") == [[("a", 1)], [("b", 2)]]  # the pipes stay in step after an error
        os.kill(group.pids[1], signal.SIGKILL)
        with pytest.raises(ProcessDiedError) as e:
            group.call("total")
        assert isinstance(e.value, TransientError)
    finally:
        group.kill()


def test_a_member_that_fails_is_raised_while_another_never_answers():
    """One member raises while another stays in the call (a rank waiting in a collective for the failed one): the
    failure comes back after the group's grace, not when the other answers; the group is then out of step, so its
    next call is a transient error, and killing it does not wait for the stuck member."""
    import queue

    from runtime.errors import TransientError
    from runtime.placement.subprocess_group import ProcessDiedError, SubprocessGroup

    group = SubprocessGroup("queue:Queue", [{}, {}], error_grace_s=0.2)
    try:
        with pytest.raises(queue.Empty) as e:  # member 0 blocks in get() forever; member 1 finds its queue empty
            group.submit_each("get", [(), (False,)]).get()
        assert "member(s) [0] had not answered" in "".join(e.value.__notes__)
        with pytest.raises(ProcessDiedError) as died:
            group.call("qsize")
        assert isinstance(died.value, TransientError)
    finally:
        stuck = group.members[0].proc
        group.kill()
    assert not stuck.is_alive()


# ---- the distributed optimizer (train.distributed_optimizer): same updates, one checkpoint format -----------
# Local backend, one process per rank over gloo. clip_grad is small so that every step clips: the distributed
# optimizer sums the grad norm over its shards (another order), which is where its updates can differ.
DISTOPT_TRAIN = {"micro_batch_size": 8, "lr": 1e-3, "clip_grad": 0.1}
# Weights may differ by float summation order only: the gradients' reduction over DP ranks and the grad norm.
# Adam's step is lr·m/(sqrt(v)+eps) per element, so where |g| ~ eps a last-bit difference in g moves that
# element by up to ~lr; the bound is a small fraction of one step, per update. Measured (tiny Qwen3, fp32):
# distributed vs replicated at DP 2, 2 updates: 4.6e-7 = 2.3e-4·lr per update; resumed at DP 1 from a DP-2
# distributed checkpoint vs continuing at DP 2: 7.5e-9 after one update.
UPDATE_TOL = 1e-2 * DISTOPT_TRAIN["lr"]


def _distopt_trainer(tiny_checkpoint, dp: int, distributed: bool):
    hf, td = tiny_checkpoint
    cfg = GrpoConfig.model_validate({"cluster": {"backend": "local"}, "algorithm": {"kl_coef": 0.0, "use_tis": True},
                                     "train": {**DISTOPT_TRAIN, "data_parallel": dp, "distributed_optimizer": distributed}})
    return Cluster(cfg).trainer(in_subprocesses=True, hf_dir=hf, init_checkpoint=td, train=cfg.train,
                                algorithm=cfg.algorithm, temperature=1.0).group


def _checkpoint_tensors(path, scratch) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint (weights and optimizer state), read without megatron."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = scratch / f"{abs(hash(str(path)))}.pt"
    dcp_to_torch_save(str(path), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def _weights(group) -> dict[str, torch.Tensor]:
    """Rank 0's weights, copied: a CPU tensor from a subprocess arrives in shared memory, still the live weight."""
    return {k: v.clone() for k, v in group.call("hf_weights")[0].items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def distopt_runs(tiny_checkpoint, tmp_path_factory):
    """DP 2 with and without the distributed optimizer (2 updates, a checkpoint, a 3rd update); then the
    distributed checkpoint resumed at DP 1 (replicated), and that one resumed at DP 2 (distributed)."""
    from runtime.models import load_hf_config
    root = tmp_path_factory.mktemp("distopt")
    vocab = load_hf_config(tiny_checkpoint[0]).vocab_size
    batches = [recorded_batch(vocab, seed=s) for s in range(3)]
    out: dict = {"root": root}
    for name, distributed in (("dist2", True), ("repl2", False)):
        group = _distopt_trainer(tiny_checkpoint, 2, distributed)
        try:
            for b in batches[:2]:
                group.call("train", b)
            out[name] = {"weights2": _weights(group)}
            if distributed:
                group.call("save", str(root / name))
                group.call("train", batches[2])
                out[name]["weights3"] = _weights(group)
        finally:
            group.kill()
    # resumed at another layout: load, save again at once (the reshard), one more update
    for name, src, dp, distributed in (("repl1", "dist2", 1, False), ("dist2b", "repl1", 2, True)):
        group = _distopt_trainer(tiny_checkpoint, dp, distributed)
        try:
            group.call("load", str(root / src))
            group.call("save", str(root / name))
            group.call("train", batches[2])
            out[name] = {"weights3": _weights(group)}
        finally:
            group.kill()
    return out


def test_distributed_optimizer_updates_equal_the_replicated_ones(distopt_runs):
    dist, repl = distopt_runs["dist2"]["weights2"], distopt_runs["repl2"]["weights2"]
    diff = _max_diff(dist, repl)
    print(f"distributed vs replicated optimizer, DP 2, 2 updates: max |dw| = {diff:.3g}")
    assert diff <= 2 * UPDATE_TOL, diff
    # both moved the weights (a comparison of two untrained models would pass too)
    assert any(not torch.equal(dist[k], distopt_runs["dist2"]["weights3"][k]) for k in dist)


def test_checkpoints_reshard_between_dp_sizes_and_optimizers(distopt_runs):
    """DP 2 distributed -> DP 1 replicated -> DP 2 distributed: each load puts back bitwise the state that
    was saved (a checkpoint written right after a load equals the loaded one), and the update after the
    resume stays within float tolerance of the uninterrupted run."""
    root = distopt_runs["root"]
    saved = _checkpoint_tensors(root / "dist2", root)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in saved)  # the Adam state is in it
    assert not any(".param." in k or "dp_group" in k for k in saved)        # in the replicated layout
    for resaved in ("repl1", "dist2b"):
        again = _checkpoint_tensors(root / resaved, root)
        assert again.keys() == saved.keys()
        assert all(torch.equal(saved[k], again[k]) for k in saved), resaved
    uninterrupted = distopt_runs["dist2"]["weights3"]
    for resumed in ("repl1", "dist2b"):
        diff = _max_diff(distopt_runs[resumed]["weights3"], uninterrupted)
        print(f"resumed as {resumed} vs uninterrupted DP 2 distributed, 1 update: max |dw| = {diff:.3g}")
        assert diff <= UPDATE_TOL, (resumed, diff)
