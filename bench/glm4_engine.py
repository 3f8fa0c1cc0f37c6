"""The built-in engine's paged fast path on the GLM-4-9B shape (issue 23, the single-GPU part): decode tok/s
at batch 128 at the fixed shape (16 prompts x 8 samples, 256 + 512, forced lengths) against HF `generate` in
the same run, and at realistic lengths (rollout_bench's keyed log-normal schedule, forced stops, on 16 x 8
requests of 1024-token prompts up to 8192 new tokens); and the memory plan's engine terms against what the
engine holds.

    python3 bench/glm4_engine.py --out $OUT/glm4_engine.json          # one H200 (or H100), < 8 min
    python3 bench/glm4_engine.py --cpu                                # smoke: a 2-layer GLM4 on CPU
    python3 bench/glm4_engine.py --skip-hf --cascade-ab --out ...      # also the fixed and realistic rows with
                                                                      # rollout.cascade_attention on (same engine)

Random init (normal 0.02, norms 1, biases 0), bf16, built on the GPU directly (no 18 GB checkpoint on disk):
the paged decoder (`runtime.rollout.paged_decode.PagedDecoder`) wraps the HF model as the engine does.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import rollout_bench as rb  # the keyed length schedule and request builder
from harness import ROOT

GLM4_9B = json.loads((ROOT / "runtime" / "models" / "known_configs" / "GLM-4-9B-0414.json").read_text())
TINY = dict(GLM4_9B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, pad_token_id=0, eos_token_id=[1])


def build(cfg_dict: dict, device: str, dtype) -> torch.nn.Module:
    from transformers import Glm4Config, Glm4ForCausalLM
    cfg = Glm4Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = Glm4ForCausalLM(cfg)
    # cast while on the meta device, then allocate: straight into `dtype` (allocating first would make the
    # 9B model in fp32, 37.6 GB, before the cast)
    model = model.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
        # non-persistent buffers come out of to_empty uninitialised: HF's default RoPE frequencies again
        rope = model.model.rotary_emb
        inv_freq, _ = rope.compute_default_rope_parameters(cfg, device)
        rope.inv_freq = inv_freq
        rope.original_inv_freq = inv_freq.clone()
    return model.eval()


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed_generate(dec, reqs, sp, lengths, cuda: bool) -> dict:
    from runtime.rollout.keyed_sampling import sample_key_hash
    kh = sample_key_hash(torch.tensor([r.key for r in reqs], dtype=torch.long, device=dec.device))
    sync(cuda)
    t0 = time.perf_counter()
    ids, _, _ = dec.generate([r.prompt_ids for r in reqs], kh, sp, set(), stop_at=lengths)
    sync(cuda)
    t = time.perf_counter() - t0
    assert [len(x) for x in ids] == lengths, "every request stops at its forced length"
    st = dec.stats
    return {"requests": len(reqs), "new_tokens": sum(lengths), "s": round(t, 2), "tok_s": round(sum(lengths) / t),
            "decode_steps": st["decode_steps"], "ms_per_step": round(1e3 * st["decode_s"] / max(st["decode_steps"], 1), 2),
            "prefill_s": round(st["prefill_s"], 2), "preemptions": st["preemptions"],
            "peak_pages_used": st["peak_pages_used"], "attention": st["attention"],
            # what ran: a speed feature that failed is switched off for the rest of the run (the log says so once)
            "compiled": dec.compiled, "cuda_graphs": dec.use_graphs, "fallbacks": st.get("fallbacks", [])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--realistic-prompts", type=int, default=16)
    ap.add_argument("--kv-gib", type=float, default=60.0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cascade-ab", action="store_true",
                    help="the fixed and realistic rows again with cascade attention on (docs/cascade-attention.md)")
    args = ap.parse_args()
    from runtime.plan.memory import GIB, estimate_memory
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.paged_decode import PagedDecoder
    from transformers import Glm4Config

    cuda = not args.cpu
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg_dict = GLM4_9B if cuda else TINY
    res: dict = {"benchmark": "glm4_engine", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
    t0 = time.time()
    model = build(cfg_dict, device, dtype)
    sync(cuda)
    weights = torch.cuda.memory_allocated() if cuda else sum(p.numel() * p.element_size() for p in model.parameters())
    res["build_s"] = round(time.time() - t0, 1)
    res["params"] = sum(p.numel() for p in model.parameters())
    S = dict(rb.SHAPES["gpu" if cuda else "cpu"], vocab=cfg_dict["vocab_size"])
    fx = S["fixed"]
    rows = fx["prompts"] * fx["samples"]
    kv_gib = args.kv_gib if cuda else 0.01
    dec = PagedDecoder(model, max_rows=max(rows, args.realistic_prompts * S["samples"]), kv_cache_gb=kv_gib,
                       page_size=S["page_size"])
    dec.ensure_pool()
    res["kv_pool_GiB"] = round(dec.kv_cache_bytes() / GIB, 2)
    # ---- fixed shape: 16 x 8, 256-token prompts, 512 new, forced lengths ----
    reqs = rb.requests(S, fx["prompts"], fx["samples"], fx["prompt_len"], rollout=1, seed=1)
    sp = SamplingParams(temperature=1.0, max_new_tokens=fx["new"])
    warm = reqs[:16]
    timed_generate(dec, warm, SamplingParams(temperature=1.0, max_new_tokens=32), [32] * len(warm), cuda)  # compile
    res["fixed"] = timed_generate(dec, reqs, sp, [fx["new"]] * rows, cuda)
    # ---- HF generate at the fixed shape (eager, dynamic cache), same prompts ----
    if not args.skip_hf:
        ids = torch.tensor([r.prompt_ids for r in reqs], device=device)
        sync(cuda)
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=fx["new"],
                                 min_new_tokens=fx["new"], pad_token_id=0)
        sync(cuda)
        t = time.perf_counter() - t1
        res["hf_generate_fixed"] = {"tok_s": round(rows * (out.shape[1] - ids.shape[1]) / t), "s": round(t, 2)}
        del out
    # ---- realistic lengths: the keyed schedule on n prompts x 8 ----
    Sr = dict(S, prompts=args.realistic_prompts, over_sampling=1.0)
    lengths = rb.schedule(Sr)
    rreqs = rb.requests(Sr, args.realistic_prompts, S["samples"], S["prompt_len"], rollout=3, seed=3)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    res["realistic"] = {"schedule": {"n": len(lengths), "total": sum(lengths), "max": max(lengths),
                                     "mean": round(sum(lengths) / len(lengths), 1)},
                        **timed_generate(dec, rreqs, SamplingParams(temperature=1.0, max_new_tokens=S["max_new"]),
                                         lengths, cuda)}
    if cuda:
        res["realistic"]["rollout_extra_GiB"] = round((torch.cuda.max_memory_allocated() - before) / GIB, 2)
    if args.cascade_ab:  # the same engine with a group's prompt read once per step (group_rows rows to a tile)
        dec.cascade = True
        dec.graphs.clear()
        timed_generate(dec, warm, SamplingParams(temperature=1.0, max_new_tokens=32), [32] * len(warm), cuda)
        on = {"group_rows": dec.group_rows, "fixed": timed_generate(dec, reqs, sp, [fx["new"]] * rows, cuda),
              "realistic": timed_generate(dec, rreqs, SamplingParams(temperature=1.0, max_new_tokens=S["max_new"]),
                                          lengths, cuda)}
        on["on_vs_off_tok_s"] = {k: round(on[k]["tok_s"] / res[k]["tok_s"], 3) for k in ("fixed", "realistic")}
        res["cascade_on"] = on
        dec.cascade = False
        dec.graphs.clear()
    # ---- the plan's engine terms ----
    hf_cfg = Glm4Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")})
    est = estimate_memory(hf_cfg, micro_batch_size=1, seq_len=S["prompt_len"] + S["max_new"],
                          rollout_batch=len(rreqs), samples_per_prompt=S["samples"], max_new_tokens=S["max_new"],
                          dtype="bfloat16" if cuda else "float32",
                          device="cuda" if cuda else "cpu", kv_cache_gb=kv_gib, gpu_mem_gb=141.0, tp=2)
    res["plan_vs_measured_GiB"] = {
        "engine_weights": {"plan": round(est["engine_weights"], 2), "measured": round(weights / GIB, 2)},
        "kv_pool": {"plan": round(est["kv_cache"], 2), "measured": res["kv_pool_GiB"]},
        "rollout_extra_realistic": {"plan": round(est["rollout_activations"], 2),
                                    "measured": res["realistic"].get("rollout_extra_GiB")},
        "decode_path": est["decode_path"]}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
