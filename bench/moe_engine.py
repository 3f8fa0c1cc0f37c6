"""The built-in engine's paged decoder on the Qwen3-30B-A3B shape (issue 60, item 3; expert parallelism and R3 are
not in it): the grouped expert GEMMs against a loop over the experts, the decoder's log-probs against HF's forward
on the same weights, and decode tok/s at the fixed 16 x 8, 256 + 512 shape (forced lengths) with CUDA graphs and
torch.compile as the engine runs them.

    python3 bench/moe_engine.py --out $OUT/moe_engine.json              # one H200, < 10 min (61 GB of bf16 weights)
    python3 bench/moe_engine.py --layers 8 --out $OUT/moe_engine.json   # a depth-truncated shape of full width
    python3 bench/moe_engine.py --weights-dtype bf16,fp8 --out $OUT/moe_engine_fp8.json  # FP8 experts against bf16
    python3 bench/moe_engine.py --cpu                                   # smoke: a 2-layer, 8-expert model on CPU
    python3 bench/moe_engine.py --shards 4 --out $OUT/moe_shards.json   # nvidia-h200-x4: a replica of 4 expert shards
    python3 bench/moe_engine.py --cpu --shards 2                        # its smoke: 2 processes over gloo (~1 min)

`--weights-dtype` (rollout.weights_dtype), a comma list run in order on one model (the FP8 decoder keeps HF's
bf16 weights beside its copy: 61 + 30 GB on the full shape): per setting the log-probs against HF's bf16 forward and the fixed shape's tok/s.

`--shards N` (rollout.expert_shards, runtime/rollout/expert_shards.py) instead: the model saved as an HF dir, then the
fixed shape through `grpoflow`'s engine handle twice, a warm-up and a timed call, on one whole engine (GPU 0) and on a
replica of N engines (GPUs 0..N-1) each holding 1/N of the experts: tok/s, each engine's weights, the samples whose
tokens agree and the largest log-prob gap between the two where they do (another order of sums: float noise).

Random init (normal 0.02, norms 1), bf16, built on the GPU directly (no checkpoint on disk), as glm4_engine.py.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
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


def save_hf(model, work: Path) -> Path:
    """The model as an HF dir with the tiny tokenizer (the engine reads one for its eos)."""
    import shutil

    from runtime.models.tiny import build_tiny_qwen3
    shutil.rmtree(work, ignore_errors=True)
    model.save_pretrained(work / "hf", max_shard_size="5GB")
    tok = build_tiny_qwen3(work / "tok")["path"]
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(tok) / f).exists():
            shutil.copyfile(Path(tok) / f, work / "hf" / f)
    return work / "hf"


def engine_dumping_stacks(dump_stacks_every: float, **kwargs):
    """A shard's engine (the replica's member process builds it) that prints the process's Python stacks every
    ``dump_stacks_every`` seconds (0: never): where each shard is when a call hangs."""
    from runtime.rollout.builtin import BuiltinEngine
    if dump_stacks_every > 0:
        faulthandler.dump_traceback_later(dump_stacks_every, repeat=True)
    return BuiltinEngine(**kwargs)


def shards_section(model_dir: Path, n: int, reqs, new_tokens: int, cuda: bool, kv_gib: float,
                   dump_stacks_every: float = 0.0) -> dict:
    """The fixed shape on one whole engine and on a replica of ``n`` expert shards (module doc)."""
    from runtime.placement.handles import EngineHandle
    from runtime.placement.ports import free_port
    from runtime.placement.subprocess_group import SubprocessGroup
    from runtime.plan.memory import GIB
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.rollout.expert_shards import ShardSpec
    dtype = torch.bfloat16 if cuda else torch.float32
    common = dict(model_dir=str(model_dir), dtype=dtype, max_batch_size=len(reqs), kv_cache_gb=kv_gib)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)

    start = time.perf_counter()

    def say(what: str) -> None:  # where a long call is, when its deadline cuts it
        print(f"[{time.perf_counter() - start:7.1f} s] {what}", flush=True)

    def timed(generate) -> tuple[list, dict]:
        generate()  # compiles, captures the graphs
        sync(cuda)
        say("warmed up")
        t0 = time.perf_counter()
        out = generate()
        sync(cuda)
        s = time.perf_counter() - t0
        tokens = sum(len(r.response_ids) for r in out)
        return out, {"s": round(s, 2), "new_tokens": tokens, "tok_s": round(tokens / s)}

    res: dict = {"shards": n}
    whole = BuiltinEngine(device="cuda:0" if cuda else "cpu", **common)
    say("the whole engine loaded")
    res["whole_weight_bytes"] = whole.health()["weight_bytes"]
    res["whole_weights_GiB"] = round(res["whole_weight_bytes"] / GIB, 3)
    ref, res["whole"] = timed(lambda: whole.generate(reqs, sampling))
    dec = whole.decoder
    res["whole"].update(compiled=dec.compiled, cuda_graphs=dec.use_graphs, fallbacks=dec.stats.get("fallbacks", []))
    say(f"the whole engine timed: {res['whole']}")
    whole.shutdown()
    whole = None
    if cuda:
        torch.cuda.empty_cache()
    port = free_port()
    group = SubprocessGroup("moe_engine:engine_dumping_stacks", [
        dict(common, device=f"cuda:{i}" if cuda else "cpu", expert_shard=ShardSpec(i, n, "127.0.0.1", port, "bench"),
             dump_stacks_every=dump_stacks_every) for i in range(n)])
    try:
        replica = EngineHandle(group, expert_shards=n)
        say(f"the replica of {n} shards loaded")
        res["shard_weight_bytes"] = [h["weight_bytes"] for h in replica.health()["engines"]]
        res["shard_weights_GiB"] = [round(b / GIB, 3) for b in res["shard_weight_bytes"]]
        got, res["replica"] = timed(lambda: replica.generate(reqs, sampling))
    finally:
        group.kill()
    same = [(a, b) for a, b in zip(ref, got) if a.response_ids == b.response_ids]
    res["same_samples"] = f"{len(same)}/{len(ref)}"
    res["max_logprob_gap_where_same"] = max((abs(x - y) for a, b in same
                                             for x, y in zip(a.response_logprobs, b.response_logprobs)), default=None)
    res["speedup"] = round(res["replica"]["tok_s"] / res["whole"]["tok_s"], 3)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the model's 48)")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--weights-dtype", default="bf16", help="comma list of rollout.weights_dtype (fp8 last)")
    ap.add_argument("--shards", type=int, default=0, help="rollout.expert_shards: a replica of N engines (N GPUs)")
    ap.add_argument("--work", default="/tmp/moe-engine", help="--shards: where the model is saved")
    ap.add_argument("--dump-stacks-every", type=float, default=0.0, metavar="S",
                    help="print this process's Python stacks, and each shard's, every S seconds (where a call cut "
                         "by its deadline was)")
    args = ap.parse_args()
    if args.dump_stacks_every > 0:
        faulthandler.dump_traceback_later(args.dump_stacks_every, repeat=True)
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
    S = dict(rb.SHAPES["gpu" if cuda else "cpu"], vocab=cfg_dict["vocab_size"])
    fx = S["fixed"]
    rows = fx["prompts"] * fx["samples"]
    reqs = rb.requests(S, fx["prompts"], fx["samples"], fx["prompt_len"], rollout=1, seed=1)
    if args.shards:  # the engines load the saved model: this process's copy goes first (61 GB at the full shape)
        model_dir = save_hf(model, Path(args.work))
        model = None
        if cuda:
            torch.cuda.empty_cache()
        res["expert_shards"] = shards_section(model_dir, args.shards, reqs, fx["new"], cuda,
                                              args.kv_gib if cuda else 0.01, args.dump_stacks_every)
        return _report(res, args.out)
    res["experts_one_layer"] = experts_section(model, cuda)
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
    return _report(res, args.out)


def _report(res: dict, out: str | None) -> int:
    print(json.dumps(res, indent=1))
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
