"""The built-in engine's paged decoder on the Qwen3-30B-A3B shape (issue 60, item 3; expert parallelism and R3 are
not in it): the grouped expert GEMMs against a loop over the experts, the decoder's log-probs against HF's forward
on the same weights, and decode tok/s at the fixed 16 x 8, 256 + 512 shape (forced lengths) with CUDA graphs and
torch.compile as the engine runs them.

    python3 bench/moe_engine.py --out $OUT/moe_engine.json              # one H200, < 10 min (61 GB of bf16 weights)
    python3 bench/moe_engine.py --layers 8 --out $OUT/moe_engine.json   # a depth-truncated shape of full width
    python3 bench/moe_engine.py --weights-dtype bf16,fp8 --out $OUT/moe_engine_fp8.json  # FP8 experts against bf16
    python3 bench/moe_engine.py --cpu                                   # smoke: a 2-layer, 8-expert model on CPU

`--weights-dtype` (rollout.weights_dtype), a comma list run in order on one model (the FP8 decoder keeps HF's
bf16 weights beside its copy: 61 + 30 GB on the full shape): per setting the log-probs against HF's bf16 forward and the fixed shape's tok/s.

Random init (normal 0.02, norms 1), bf16, built on the GPU directly (no checkpoint on disk), as glm4_engine.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import rollout_bench as rb  # the request builder
from glm4_engine import sync, timed_generate
from harness import ROOT

QWEN3_30B_A3B = json.loads((ROOT / "runtime" / "models" / "known_configs" / "Qwen3-30B-A3B.json").read_text())
TINY = dict(QWEN3_30B_A3B, bos_token_id=None, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, pad_token_id=0, eos_token_id=[1])


def build(cfg_dict: dict, device: str, dtype) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)  # cast on the meta device: no fp32 copy of 30 B parameters
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        rope = model.model.rotary_emb  # non-persistent buffers come out of to_empty uninitialised
        inv_freq = rope.compute_default_rope_parameters(cfg)[0].to(device)
        rope.inv_freq = inv_freq
        rope.original_inv_freq = inv_freq.clone()
    return model.eval()


def timed(fn, cuda: bool, reps: int) -> float:
    """Seconds a call takes (the mean of `reps` after one warm-up)."""
    fn()
    sync(cuda)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(cuda)
    return (time.perf_counter() - t0) / reps


def experts_section(model, cuda: bool) -> dict:
    """One layer's routed experts at decode (128 rows) and prefill (4096 rows) sizes: grouped GEMMs against a Python
    loop over the experts (the same routing), and how far apart they are."""
    from runtime.rollout import decode_model as dm
    cfg, layer = model.config, model.model.layers[0].mlp
    gu, down, router = layer.experts.gate_up_proj, layer.experts.down_proj, layer.gate.weight
    ffn, topk = cfg.moe_intermediate_size, cfg.num_experts_per_tok

    def loop_mm(x, w, offs):
        ends = offs.tolist()
        return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))])

    out = {}
    for rows in ((128, 4096) if cuda else (8, 64)):
        x = torch.randn(rows, cfg.hidden_size, device=gu.device, dtype=gu.dtype)
        with torch.inference_mode():
            grouped = dm._routed_experts(x, router, gu, down, ffn, topk, cfg.norm_topk_prob)
            original = dm._grouped_mm
            dm._grouped_mm = loop_mm
            try:
                looped = dm._routed_experts(x, router, gu, down, ffn, topk, cfg.norm_topk_prob)
                t_loop = timed(lambda: dm._routed_experts(x, router, gu, down, ffn, topk, cfg.norm_topk_prob), cuda, 5)
            finally:
                dm._grouped_mm = original
            t_grouped = timed(lambda: dm._routed_experts(x, router, gu, down, ffn, topk, cfg.norm_topk_prob), cuda, 5)
        out[f"rows_{rows}"] = {"grouped_ms": round(1e3 * t_grouped, 3), "loop_ms": round(1e3 * t_loop, 3),
                               "speedup": round(t_loop / t_grouped, 2),
                               "max_abs_diff": (grouped.float() - looped.float()).abs().max().item()}
    return out


def logprob_section(model, dec, reqs, cuda: bool) -> dict:
    """The decoder's sampled log-probs against HF's forward (eager experts loop, sdpa) on the same tokens."""
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.keyed_sampling import sample_key_hash
    kh = sample_key_hash(torch.tensor([r.key for r in reqs], dtype=torch.long, device=dec.device))
    ids, lps, _ = dec.generate([r.prompt_ids for r in reqs], kh, SamplingParams(temperature=1.0, max_new_tokens=64),
                               set(), stop_at=[64] * len(reqs))
    diffs = []
    with torch.inference_mode():
        for r, toks, lp in zip(reqs, ids, lps):
            seq = torch.tensor([list(r.prompt_ids) + toks], device=dec.device)
            logits = model(input_ids=seq, use_cache=False).logits[0].float()
            ref = torch.log_softmax(logits[len(r.prompt_ids) - 1:-1], -1).gather(
                -1, torch.tensor(toks, device=dec.device)[:, None]).squeeze(-1)
            diffs.append((ref - torch.tensor(lp, device=dec.device)).abs())
    d = torch.cat(diffs)
    return {"tokens": d.numel(), "max_abs": round(d.max().item(), 5), "mean_abs": round(d.mean().item(), 6)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the model's 48)")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--weights-dtype", default="bf16", help="comma list of rollout.weights_dtype (fp8 last)")
    args = ap.parse_args()
    from runtime.plan.memory import GIB
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.paged_decode import PagedDecoder

    cuda = not args.cpu
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg_dict = dict(QWEN3_30B_A3B if cuda else TINY)
    if args.layers:
        cfg_dict["num_hidden_layers"] = args.layers
    res: dict = {"benchmark": "moe_engine", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                 "layers": cfg_dict["num_hidden_layers"], "experts": cfg_dict["num_experts"],
                 "top_k": cfg_dict["num_experts_per_tok"]}
    t0 = time.time()
    model = build(cfg_dict, device, dtype)
    sync(cuda)
    res["build_s"] = round(time.time() - t0, 1)
    res["params"] = sum(p.numel() for p in model.parameters())
    res["experts_one_layer"] = experts_section(model, cuda)

    S = dict(rb.SHAPES["gpu" if cuda else "cpu"], vocab=cfg_dict["vocab_size"])
    fx = S["fixed"]
    rows = fx["prompts"] * fx["samples"]
    reqs = rb.requests(S, fx["prompts"], fx["samples"], fx["prompt_len"], rollout=1, seed=1)
    for wd in args.weights_dtype.split(","):
        dec = PagedDecoder(model, max_rows=rows, kv_cache_gb=args.kv_gib if cuda else 0.01, page_size=S["page_size"],
                           weights_dtype=wd, drop_bf16=False)  # HF's forward stays the reference
        dec.ensure_pool()
        r = res if wd == "bf16" else res.setdefault(wd, {})
        r["kv_pool_GiB"] = round(dec.kv_cache_bytes() / GIB, 2)
        r["weights_GiB"] = round(dec.weight_bytes / GIB, 2)
        r["compiled"], r["compile_error"] = dec.compiled, dec.compile_error
        r["logprobs_vs_hf"] = logprob_section(model, dec, reqs[:16], cuda)  # also compiles and captures
        r["fixed"] = timed_generate(dec, reqs, SamplingParams(temperature=1.0, max_new_tokens=fx["new"]),
                                    [fx["new"]] * rows, cuda)
        dec.release()
        del dec
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        res["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
