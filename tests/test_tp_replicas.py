"""The tensor-parallel replicas step from TP rank 0's gradient (runtime/trainer/tp_replicas.py): two gloo ranks whose
gradients differ, as a GPU's nondeterministic kernels make them differ, end with rank 0's for the replicas and their
own for the split parameters."""
from __future__ import annotations

import torch

from runtime.trainer.tp_replicas import replicated_parameters, take_rank0_gradients


def _module(rank: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.norm = torch.nn.Parameter(torch.ones(5))                          # replicated, gradient in .grad (fp32)
    m.lora_a = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.bfloat16))  # replicated, megatron's main_grad (bf16)
    m.split = torch.nn.Parameter(torch.ones(4))                         # this rank's shard of a split weight
    m.split.tensor_model_parallel = True
    m.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    m.norm.grad = torch.arange(5, dtype=torch.float32) + 0.5 * rank
    m.lora_a.main_grad = torch.full((3, 2), 1.0 + rank, dtype=torch.bfloat16)
    m.split.grad = torch.full((4,), 10.0 + rank)
    return m


def _rank(rank: int, init: str, conn) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        m = _module(rank)
        names = sorted(n for n, p in m.named_parameters() if any(p is q for q in replicated_parameters(m)))
        sent = take_rank0_gradients(replicated_parameters(m), torch.distributed.group.WORLD)
        # Plain lists, not tensors: a tensor crosses a pipe as a file descriptor this process serves, and it may have
        # exited before the test reads it.
        conn.send({"names": names, "sent": sent, "norm": m.norm.grad.tolist(), "lora_a": m.lora_a.main_grad.tolist(),
                   "split": m.split.grad.tolist()})
    finally:
        torch.distributed.destroy_process_group()


def test_tp_ranks_take_rank0s_gradients_of_the_replicas_and_keep_their_own_shards(tmp_path):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'store'}"
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, init, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = [pipes[r][0].recv() for r in range(2)]
    finally:
        for p in procs:
            p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    rank0 = _module(0)
    for r, g in enumerate(got):
        assert g["names"] == ["lora_a", "norm"]  # neither the split parameter nor a frozen one
        assert g["sent"] == 5 + 6
        assert g["norm"] == rank0.norm.grad.tolist() and g["lora_a"] == rank0.lora_a.main_grad.tolist()
        assert g["split"] == [10.0 + r] * 4  # each rank's own shard's gradient
