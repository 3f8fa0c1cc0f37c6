"""The trainer's experts (issue 60, item 2): megatron's ``SequentialMLP`` (a Python loop over the local experts)
against :class:`runtime.mcore.grouped_experts.GroupedMLP` (two ``F.grouped_mm``, ``train.moe_grouped_gemm``) at
Qwen3-30B-A3B's expert shape (128 experts of 768, hidden 2048, top-8), bf16, forward + backward of one layer's
experts on the tokens the dispatcher hands them (sorted by expert, a uniform random top-8 routing).

    python3 bench/gpu_carry.py install && export PYTHONPATH=/tmp/site:$PYTHONPATH   # megatron-core on the GPU machine
    python3 bench/moe_grouped_gemm.py --out $OUT/moe_grouped_gemm.json              # one H200, < 2 min
    python3 bench/moe_grouped_gemm.py --cpu                                         # smoke: 8 experts of 32, fp32

Rows: local experts (128 = EP 1, 32 = EP 4: the rank's experts, on the tokens its group routes to them) × tokens of
a micro-batch (each routed top-k times). Per row: ms forward + backward for each, the speed-up, TFLOP/s of the
grouped one (6 · routed tokens · 3 · H · F), and the largest difference of the outputs and of the experts' weight
gradients (bf16 rounding: the two sum in different orders). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(experts=128, ffn=768, hidden=2048, topk=8)
TINY = dict(experts=8, ffn=32, hidden=64, topk=2)


def _config(shape: dict, dtype, device: str):
    """megatron's TransformerConfig of a Qwen3-MoE layer of this expert shape (our adapter's MoE settings)."""
    from transformers import Qwen3MoeConfig

    from runtime.mcore.env import build_transformer_config
    hf = Qwen3MoeConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["ffn"], num_experts=shape["experts"],
                        num_experts_per_tok=shape["topk"], num_hidden_layers=1, num_attention_heads=16,
                        num_key_value_heads=4, head_dim=128, intermediate_size=6144, vocab_size=1024,
                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return hf, build_transformer_config(hf, dtype=dtype, device=device, init_weights=True)


def _experts(cls, hf, config, local: int, device: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from runtime.models import get_adapter
    spec = get_adapter(hf).layer_spec(hf).submodules.mlp.submodules.experts
    spec = type(spec)(module=cls, submodules=spec.submodules)
    return build_module(spec, local, config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)


def _sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def _timed(fn, cuda: bool, reps: int) -> float:
    fn()
    _sync(cuda)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(cuda)
    return (time.perf_counter() - t0) / reps


def row(shape: dict, local: int, tokens: int, dtype, device: str, reps: int) -> dict:
    from megatron.core.transformer.moe.experts import SequentialMLP

    from runtime.mcore.grouped_experts import GroupedMLP
    cuda = device == "cuda"
    hf, config = _config(shape, dtype, device)
    loop = _experts(SequentialMLP, hf, config, local, device)
    grouped = _experts(GroupedMLP, hf, config, local, device)
    grouped.load_state_dict(loop.state_dict())
    g = torch.Generator(device=device).manual_seed(0)
    # a uniform top-k routing of `tokens` over all experts; this rank's share goes to its `local` experts
    routed = tokens * shape["topk"] * local // shape["experts"]
    expert = torch.randint(0, local, (routed,), generator=g, device=device).sort().values
    tokens_per_expert = torch.bincount(expert, minlength=local).cpu()
    x = torch.randn(routed, shape["hidden"], generator=g, device=device, dtype=dtype, requires_grad=True)
    probs = torch.rand(routed, generator=g, device=device, dtype=torch.float32)
    grad = torch.randn(routed, shape["hidden"], generator=g, device=device, dtype=dtype)

    def step(module):
        def run():
            module.zero_grad(set_to_none=True)
            x.grad = None
            y, _ = module(x, tokens_per_expert, probs)
            y.backward(grad)
            return y
        return run

    out = {"local_experts": local, "tokens": tokens, "routed_rows": routed}
    ys = {}
    for name, module in (("sequential", loop), ("grouped", grouped)):
        ys[name] = step(module)().detach().float()
        out[f"{name}_ms"] = round(1e3 * _timed(step(module), cuda, reps), 3)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            step(module)()
            out[f"{name}_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["speedup"] = round(out["sequential_ms"] / out["grouped_ms"], 2)
    flops = 6 * routed * 3 * shape["hidden"] * shape["ffn"]
    out["grouped_tflops"] = round(flops / (out["grouped_ms"] / 1e3) / 1e12, 1)
    out["max_abs_diff_out"] = float((ys["grouped"] - ys["sequential"]).abs().max())
    step(loop)()
    step(grouped)()
    out["max_abs_diff_wgrad"] = max(float((a.grad.float() - b.grad.float()).abs().max())
                                    for a, b in zip(grouped.parameters(), loop.parameters()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="smoke: tiny shapes, fp32, on the CPU")
    ap.add_argument("--local-experts", default="128,32", help="comma list (128 = EP 1, 32 = EP 4)")
    ap.add_argument("--tokens", default="4096,16384", help="comma list: a micro-batch's tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    from runtime.mcore.env import ensure_parallel
    device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    shape = TINY if args.cpu else SHAPE
    locals_ = [8, 4] if args.cpu else [int(v) for v in args.local_experts.split(",")]
    tokens = [64] if args.cpu else [int(v) for v in args.tokens.split(",")]
    ensure_parallel(device)
    rows = [row(shape, local, t, dtype, device, 1 if args.cpu else args.reps) for local in locals_ for t in tokens]
    cols = ["local_experts", "tokens", "sequential_ms", "grouped_ms", "speedup", "grouped_tflops",
            "max_abs_diff_out", "max_abs_diff_wgrad"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    result = {"bench": "moe_grouped_gemm", "shape": shape, "dtype": str(dtype), "device":
              torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
