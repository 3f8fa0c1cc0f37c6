"""How weights reach the engines: the transport each layout gets, CUDA IPC between processes on one GPU, and
the GPU handed to the engine for every generate (an evaluation's too), as a rollout hands it."""
from __future__ import annotations

import pytest
import torch

from runtime.config import load_config
from runtime.placement import cuda_ipc
from runtime.placement.layout import direct_transport

TINY = "configs/tiny.yaml"


@pytest.mark.parametrize("sets, device, want", [
    # Ray actors colocated on GPUs: engine i reads trainer rank i's copy by CUDA IPC
    (["cluster.backend=ray", "cluster.trainer_gpus=2", "cluster.rollout_gpus=2"], "cuda", "cuda_ipc"),
    (["cluster.backend=ray", "cluster.trainer_gpus=1", "cluster.rollout_gpus=1"], "cuda", "cuda_ipc"),
    # Ray without GPUs (CPU actors), or an engine with a GPU of its own told to use direct: the object store
    (["cluster.backend=ray"], "cpu", "host"),
    (["cluster.backend=ray", "cluster.trainer_gpus=1", "cluster.rollout_gpus=1", "cluster.colocate=false",
      "cluster.weight_sync=direct"], "cuda", "host"),
    # local: spawned DP ranks beside engine processes on their GPUs (an IPC-received tensor cannot be sent on)
    (["cluster.trainer_gpus=2", "cluster.rollout_gpus=2"], "cuda", "cuda_ipc"),
    # local: one process holds both, or the CPU
    (["cluster.trainer_gpus=1", "cluster.rollout_gpus=1"], "cuda", "as_is"),
    ([], "cpu", "as_is"),
    (["cluster.trainer_gpus=2", "cluster.rollout_gpus=2"], "cpu", "as_is"),
])
def test_each_layout_gets_its_transport(sets, device, want):
    cfg = load_config(TINY, ["train.micro_batch_size=16", *sets])  # divides the batch at DP 2
    assert direct_transport(cfg, device) == want


def test_cuda_ipc_refuses_host_tensors():
    with pytest.raises(ValueError, match="one GPU"):
        cuda_ipc.share({"w": torch.zeros(2)})


def _share_and_wait(conn) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3), "b": torch.ones(4, device="cuda")}
    conn.send(cuda_ipc.share(tensors))
    conn.recv()  # keep the tensors alive until the reader is done


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_tensors_are_read_in_place_in_another_process():
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_share_and_wait, args=(there,))
    proc.start()
    try:
        shared = here.recv()
        got = cuda_ipc.open_shared(shared)
        assert torch.equal(got["a"].cpu(), torch.arange(6, dtype=torch.float32).reshape(2, 3))
        assert torch.equal(got["b"].cpu(), torch.ones(4))
        del got
        here.send("done")
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0


@pytest.mark.slow
def test_an_evaluation_hands_the_gpu_to_the_engine_as_a_rollout_does(tmp_path):
    """Under Ray the trainer is another process: unless it gives its memory back first, the engine's KV pool does not
    fit beside it (what an H100 run of the recipe met at its first evaluation). The engine's build, and every
    generate, a rollout's or an evaluation's, runs with the trainer's state offloaded and the pool resumed, and ends
    with both back."""
    from tests.sessions import prepared_session
    from runtime.run.directory import RunDir
    cfg = load_config(TINY, ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "train.global_batch_size=4",
                             "train.micro_batch_size=4", "rollout.max_new_tokens=4", "eval.max_prompts=2",
                             "eval.n_samples_per_prompt=1", "eval.pass_k=[1]", "cluster.offload_trainer_state=on", "tracking.enabled=false",
                             f"storage.root={tmp_path}"])
    rd = RunDir(str(tmp_path), "handoff")
    session = prepared_session(cfg, rd)
    calls: list[str] = []

    def spy(obj, name):
        real = getattr(obj, name)

        def record(*a, **k):
            calls.append(name)
            return real(*a, **k)
        setattr(obj, name, record)

    build_trainer, build_engine = session.cluster.trainer, session.cluster.engine

    def trainer(**kw):
        handle = build_trainer(**kw)
        spy(handle, "offload_state")
        spy(handle, "reload_state")
        return handle

    def engine(*a, **kw):
        calls.append("engine built")
        handle = build_engine(*a, **kw)
        spy(handle, "release_memory")
        return handle

    session.cluster.trainer, session.cluster.engine = trainer, engine
    try:
        session.ensure_at(None)
        # the engine's pool is built beside the trainer's weights only (GLM-Z1-9B's ran out of memory beside its
        # whole state on an H200), and the build ends as an engine turn does: the pool released, the state back
        assert calls == ["offload_state", "engine built", "release_memory", "reload_state"]
        calls.clear()
        spy(session.trainer, "train")
        for name in ("resume_memory", "generate"):
            spy(session.engine, name)
        session.evaluate(0)
        evaluation = calls[:]
        calls.clear()
        session.rollout(0)
    finally:
        session.close()
    assert evaluation[:2] == ["offload_state", "resume_memory"] and evaluation[-2:] == ["release_memory", "reload_state"]
    assert "generate" in evaluation[2:-2]
    assert calls[:2] == ["offload_state", "resume_memory"]
    assert calls.index("reload_state") < calls.index("train")
