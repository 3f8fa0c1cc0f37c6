"""FP8 weights in the built-in engine (rollout.weights_dtype: fp8, issue 59 item 2) against bf16, one GPU.

    python3 bench/fp8_rollout.py --out $OUT/fp8_rollout.json       # one H200 (or H100), <= 500 s (--deadline)
    python3 bench/fp8_rollout.py --cpu                             # smoke: tiny GLM4 and Qwen3 on CPU, fp32
    python3 bench/fp8_rollout.py --settings bf16,fp8,fp8-scaled-mm # + fp8 on the old _scaled_mm path, same call
    python3 bench/fp8_rollout.py --steps-only --profile            # the step points and their kernels alone (~1 min a shape)

Needs torch, transformers and this repo only (no carry). For each shape, bf16 then fp8, on one paged decoder each
(`runtime.rollout.paged_decode.PagedDecoder`, CUDA graphs, compiled, as the engine runs it) over the same random
HF model (random init; built on the GPU directly, no checkpoint on disk):
  glm9b   GLM-Z1-9B's config (runtime/models/known_configs/GLM-4-9B-0414.json), all 40 layers, at the seed's
          16 prompts x 8 samples of 1024-token prompts, each response's length from rollout_bench's keyed schedule
          (forced stops: both settings make exactly the same tokens)
  qwen06  Qwen3-0.6B's shape (rollout_bench's), the recipe's keyed lengths; by default 16 x 8 of them (the recipe's
          32 x 8 x 1.5 = 384 requests: --qwen-prompts 48 --qwen-over-sampling 1.0) to fit the deadline
Per setting: tokens/s of the keyed rollout, ms per decode step (overall and by active rows: the full batch and
the tail), the step at 128 rows / 2k context, 32 rows / 3k and 8 rows / 5k (graph replay; --profile: each one's
kernels over 8 eager steps too), one layer's four projections
alone (bf16, fp8 with its input's quantisation, _scaled_mm alone; at 8 and 128 rows), the quantisation at a
weight sync (every linear weight re-quantised from the bf16 source in place, median of 3), weight bytes, and the
engine-vs-trainer log-prob gap (mean, p99, max over the sampled tokens of 16 samples of 256 tokens, 2 prompts x 8,
against the HF forward of the bf16 weights: the trainer's numbers). The ratio fp8 / bf16 tok/s per shape is
the headline (issue 59's target: >= 1.3 at the GLM shape). A random-init model's next-token distributions are
nearly flat, so its gap checks the numerics; a trained model's gap is another number.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import glm4_engine as ge  # the GLM-4 9B config and its random build on the GPU
from glm4_engine import sync  # noqa: E402
from moe_engine import timed  # noqa: E402  (a call's mean seconds after a warm-up)
import rollout_bench as rb  # the keyed length schedule, requests and the step-latency probe

SETTINGS = ("bf16", "fp8")
# a setting of this bench only: fp8 weights with the product on torch._scaled_mm(x8, W8ᵀ), the path before
# runtime/kernels/fp8_matmul.py (the engine's fp8_linear swapped for it while that decoder runs)
SCALED_MM = "fp8-scaled-mm"
# and fp8 with runtime/kernels/fp8_matmul.py's tiles and splits taken from a fp8_matmul.py sweep (--tiles-from)
SWEPT = "fp8-swept"
GAP_PROMPTS, GAP_SAMPLES, GAP_NEW = 2, 8, 256


def qwen_model(S, device: str, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=S["vocab"], hidden_size=S["hidden"], intermediate_size=S["ffn"],
                      num_hidden_layers=S["layers"], num_attention_heads=S["heads"], num_key_value_heads=S["kv_heads"],
                      head_dim=S["head_dim"], hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      bos_token_id=None, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype).eval()


def quantise_at_sync(dec, model, cuda: bool) -> dict:
    """What a weight sync adds with fp8: every linear weight quantised from its bf16 source into the engine's
    buffers in place (`FusedModel.load_linear`); median of 3."""
    named = {n: p for n, p in model.named_parameters() if n in dec.fp8_targets}
    times = []
    for _ in range(3):
        sync(cuda)
        t0 = time.perf_counter()
        for n, p in named.items():
            dec.load_linear(n, p)
        sync(cuda)
        times.append(time.perf_counter() - t0)
    gb = sum(p.numel() * p.element_size() for p in named.values()) / 1e9
    return {"s": round(statistics.median(times), 4), "tensors": len(named), "bf16_GB": round(gb, 2),
            "GB_per_s": round(gb / statistics.median(times), 1)}


def linear_microbench(model, cuda: bool) -> dict:
    """ms of one layer's four projections at a decode step's rows: bf16 F.linear, fp8_linear (with its input's
    quantisation, eager) and _scaled_mm alone (the input already quantised, exact or fast accumulation): what the
    matmuls save and what the quantisation costs, apart from the rest of the step."""
    from runtime.rollout.fp8_weights import FP8, fp8_linear, quantize_rows
    layer = model.model.layers[0]
    a, m = layer.self_attn, layer.mlp
    gu = [m.gate_up_proj.weight] if hasattr(m, "gate_up_proj") else [m.gate_proj.weight, m.up_proj.weight]
    weights = [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight, torch.cat(gu),
               m.down_proj.weight]
    quantized = [quantize_rows(w) for w in weights]

    def ms(fn, reps: int = 20) -> float:
        return round(1e3 * timed(fn, cuda, reps), 4)

    out = {}
    with torch.inference_mode():
        for rows in (8, 32, 128):
            xs = [torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
            xq = [(x.float() / 0.01).clamp(-448, 448).to(FP8) for x in xs]
            sa = [torch.full((rows, 1), 0.01, device=w.device) for w in weights]
            out[f"rows{rows}"] = {
                "bf16_ms": ms(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, weights)]),
                "fp8_with_quant_ms": ms(lambda: [fp8_linear(x, w8, s) for x, (w8, s) in zip(xs, quantized)]),
                "scaled_mm_only_ms": ms(lambda: [torch._scaled_mm(q, w8.t(), scale_a=a_, scale_b=s,
                                                                  out_dtype=xs[0].dtype)
                                                 for q, a_, (w8, s) in zip(xq, sa, quantized)]),
                "scaled_mm_fast_accum_ms": ms(lambda: [torch._scaled_mm(q, w8.t(), scale_a=a_, scale_b=s,
                                                                        out_dtype=xs[0].dtype, use_fast_accum=True)
                                                       for q, a_, (w8, s) in zip(xq, sa, quantized)])}
    return out


def keyed_rollout(dec, S, prompts: int, over_sampling: float, cuda: bool) -> dict:
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.keyed_sampling import sample_key_hash
    Sr = dict(S, prompts=prompts, over_sampling=over_sampling)
    lengths = rb.schedule(Sr)
    n_prompts = round(prompts * over_sampling)
    reqs = rb.requests(Sr, n_prompts, S["samples"], S["prompt_len"], rollout=3, seed=3)
    kh = sample_key_hash(torch.tensor([r.key for r in reqs], dtype=torch.long, device=dec.device))
    dec.trace = []
    sync(cuda)
    t0 = time.perf_counter()
    ids, _, _ = dec.generate([r.prompt_ids for r in reqs], kh, SamplingParams(temperature=1.0, max_new_tokens=S["max_new"]),
                             set(), stop_at=lengths)
    sync(cuda)
    t = time.perf_counter() - t0
    assert [len(x) for x in ids] == lengths, "every request stops at its forced length"
    st, tr = dict(dec.stats), dec.trace
    dec.trace = None
    bins: dict = {}
    for _, act, _, n, ms, *_ in tr:
        k = "active<=8" if act <= 8 else "active<=64" if act <= 64 else "active>64"
        d = bins.setdefault(k, [0, 0.0])
        d[0] += n
        d[1] += n * ms
    return {"requests": len(reqs), "new_tokens": sum(lengths), "max_len": max(lengths), "s": round(t, 2),
            "tok_s": round(sum(lengths) / t), "decode_steps": st["decode_steps"],
            "ms_per_step": round(1e3 * st["decode_s"] / max(st["decode_steps"], 1), 3),
            "ms_per_step_by_active_rows": {k: round(v[1] / max(v[0], 1), 3) for k, v in sorted(bins.items())},
            "prefill_s": round(st["prefill_s"], 2), "preemptions": st["preemptions"], "fallbacks": st.get("fallbacks")}


@torch.inference_mode()
def logprob_gap(dec, model, S, cuda: bool) -> dict:
    """The engine's log-probs of its sampled tokens against the HF forward of the bf16 weights (teacher-forced)."""
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.keyed_sampling import sample_key_hash
    reqs = rb.requests(S, GAP_PROMPTS, GAP_SAMPLES, S["prompt_len"], rollout=5, seed=5)
    kh = sample_key_hash(torch.tensor([r.key for r in reqs], dtype=torch.long, device=dec.device))
    new = min(GAP_NEW, S["max_new"])
    ids, lps, _ = dec.generate([r.prompt_ids for r in reqs], kh, SamplingParams(temperature=1.0, max_new_tokens=new),
                               set(), stop_at=[new] * len(reqs))
    gaps = []
    for r, out, lp in zip(reqs, ids, lps):
        seq = torch.tensor(r.prompt_ids + out, dtype=torch.long, device=dec.device)
        logits = model(input_ids=seq[None], use_cache=False, logits_to_keep=len(out) + 1).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out, device=dec.device)[:, None])[:, 0]
        gaps += (ref - torch.tensor(lp, device=dec.device)).abs().tolist()
    gaps.sort()
    return {"tokens": len(gaps), "mean": round(statistics.mean(gaps), 5),
            "p99": round(gaps[min(len(gaps) - 1, math.ceil(0.99 * len(gaps)) - 1)], 5), "max": round(gaps[-1], 5)}


def step_probe(dec, S, profile: bool = False) -> dict:
    """ms per decode step (graph replay) with the full batch mid-rollout, 32 rows (the rollout's middle) and a tail
    of 8 rows; with `profile`, each point's kernels over 8 eager steps too (GPU time by kernel, with counts: the
    graph's step time less that is the time between kernels)."""
    eng = SimpleNamespace(decoder=dec)
    out = {}
    for rows, own in ((min(128, dec.max_rows), 1024), (min(32, dec.max_rows), 2048), (8, 4096)):
        own = min(own, S["max_new"] - 32)
        r = rb.step_latency(S, eng, rows=rows, own_len=own, group=S["samples"], profile=profile, profile_top=40)
        out[f"rows{rows}_ctx{r['context']}"] = r["ms_per_step"]
        if profile:
            out[f"rows{rows}_ctx{r['context']}_profile"] = r.get("profile_eager_8_steps")
    return out


@contextlib.contextmanager
def engine_linear(setting: str, tiles_from: str | None = None):
    """The engine's FP8 product for `setting`: as shipped, `_scaled_mm(x8, W8ᵀ)` for SCALED_MM, the swept tiles
    (`tiles_from`: fp8_matmul.py --best-out, the best per row count; a call takes the smallest count >= its rows)
    for SWEPT."""
    from fp8_matmul import scaled_mm_path, split_of
    from runtime.kernels import fp8_matmul as fm
    from runtime.rollout import decode_model
    shipped, shipped_tiles, shipped_split = decode_model.fp8_linear, fm.tiles_for, fm.split_for
    shipped_swiglu = decode_model.fp8_swiglu_linear
    best = {int(k): v for k, v in json.loads(Path(tiles_from).read_text()).items()} if tiles_from else {}

    def pick(rows):
        return next((best[k] for k in sorted(best) if rows <= k), None)

    def swept_tiles(rows):
        b = pick(rows)
        return tuple(b["tiles"]) if b else shipped_tiles(rows)

    def swept_split(rows, n, k, bn, bm, bk, sms):
        b = pick(rows)
        return (split_of(b["split"], rows, n, k, (bn, bm, bk), sms, rule=shipped_split) if b
                else shipped_split(rows, n, k, bn, bm, bk, sms))

    if setting == SCALED_MM:
        decode_model.fp8_linear = scaled_mm_path
        decode_model.fp8_swiglu_linear = lambda gu, ffn, w8, s: scaled_mm_path(
            torch.nn.functional.silu(gu[..., :ffn]) * gu[..., ffn:], w8, s)
    if setting == SWEPT:
        if not best:
            raise ValueError(f"{SWEPT} needs --tiles-from (fp8_matmul.py --best-out)")
        fm.tiles_for, fm.split_for = swept_tiles, swept_split
    try:
        yield
    finally:
        decode_model.fp8_linear, fm.tiles_for, fm.split_for = shipped, shipped_tiles, shipped_split
        decode_model.fp8_swiglu_linear = shipped_swiglu


def run_shape(name: str, build, S, *, prompts: int, over_sampling: float, kv_gib: float, cuda: bool,
              left, settings=SETTINGS, tiles_from: str | None = None, steps_only: bool = False,
              profile: bool = False) -> dict:
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.keyed_sampling import sample_key_hash
    from runtime.rollout.paged_decode import PagedDecoder
    res: dict = {"shape": name}
    t0 = time.time()
    model = build()
    sync(cuda)
    res["build_s"] = round(time.time() - t0, 1)
    res["params"] = sum(p.numel() for p in model.parameters())
    try:
        res["one_layer_projections"] = linear_microbench(model, cuda)
    except Exception as e:  # noqa: BLE001 - reported; the engines still run
        res["one_layer_projections"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    rows = max(prompts * S["samples"], 16)
    need = 120.0  # seconds a setting is let start with: then what the last one took
    for setting in settings:
        if left() < need:
            res[setting] = {"skipped": f"deadline ({left():.0f} s left, a setting takes ~{need:.0f} s)"}
            continue
        r: dict = {}
        t0 = time.time()
        dec = None
        try:  # a failed setting is reported, the other still runs
            with engine_linear(setting, tiles_from):
                dec = PagedDecoder(model, max_rows=round(rows * over_sampling) if over_sampling > 1 else rows,
                                   kv_cache_gb=kv_gib, page_size=S["page_size"],
                                   weights_dtype="bf16" if setting == "bf16" else "fp8", drop_bf16=False)
                dec.ensure_pool()
                r["linear_weight_GiB"] = round(sum(t.numel() * t.element_size() for w in dec.layers
                                                   for t in (w.qkv_w, w.o_w, w.gu_w, w.down_w)) / 2**30, 2)
                if setting != "bf16":
                    r["quantise_at_sync"] = quantise_at_sync(dec, model, cuda)
                # compile, and every batch bucket's graph: the rows stop one a step, so the batch passes through all
                warm = rb.requests(S, max(rows // S["samples"], 1), S["samples"], S["prompt_len"], rollout=1, seed=1)
                kh = sample_key_hash(torch.tensor([q.key for q in warm], dtype=torch.long, device=dec.device))
                dec.generate([q.prompt_ids for q in warm], kh, SamplingParams(temperature=1.0, max_new_tokens=len(warm) + 2),
                             set(), stop_at=[2 + i for i in range(len(warm))])
                sync(cuda)
                r["warmup_s"] = round(time.time() - t0, 1)
                if not steps_only:
                    r["rollout"] = keyed_rollout(dec, S, prompts, over_sampling, cuda)
                r["steps"] = step_probe(dec, S, profile)
                if not steps_only:
                    r["logprob_gap_vs_hf_bf16"] = logprob_gap(dec, model, S, cuda)
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        res[setting] = r
        print(json.dumps({name: {setting: r}}), flush=True)
        need = time.time() - t0
        if dec is not None:
            dec.release()
        del dec
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    base = res.get("bf16", {}).get("rollout", {}).get("tok_s")
    for s in settings[1:] if base else ():
        if res.get(s, {}).get("rollout", {}).get("tok_s"):
            res[f"{s}_over_bf16_tok_s".replace("-", "_")] = round(res[s]["rollout"]["tok_s"] / base, 3)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (smoke)")
    ap.add_argument("--out", default=None, help="the JSON written (default: $OUT/fp8_rollout.json or /tmp)")
    ap.add_argument("--deadline", type=float, default=500.0, help="seconds for the whole call")
    ap.add_argument("--shapes", default="glm9b,qwen06")
    ap.add_argument("--glm-layers", type=int, default=None, help="fewer GLM layers (default: all 40)")
    ap.add_argument("--glm-prompts", type=int, default=16)
    ap.add_argument("--qwen-prompts", type=int, default=16)
    ap.add_argument("--qwen-over-sampling", type=float, default=1.0)
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma list, bf16 first: bf16, fp8, {SCALED_MM} (fp8 on _scaled_mm(x8, W8ᵀ), the old path), "
                         f"{SWEPT} (fp8 with --tiles-from's tiles)")
    ap.add_argument("--tiles-from", default=None, help=f"{SWEPT}: fp8_matmul.py --best-out's JSON")
    ap.add_argument("--steps-only", action="store_true", help="per setting the decode steps alone (no rollout, no gap)")
    ap.add_argument("--profile", action="store_true", help="each step point's kernels too (8 eager steps)")
    a = ap.parse_args()
    settings = tuple(a.settings.split(","))
    t_start = time.time()

    def left() -> float:
        return a.deadline - (time.time() - t_start)

    import os
    out = Path(a.out or Path(os.environ.get("OUT", "/tmp")) / "fp8_rollout.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    cuda = not a.cpu
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if not cuda:
        torch.set_num_threads(1)
    res: dict = {"benchmark": "fp8_rollout", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                 "scales": "rowwise e4m3: a fp32 scale per weight output row and per activation token row; bf16 out",
                 "shapes": {}}
    base = rb.SHAPES["gpu" if cuda else "cpu"]
    for name in a.shapes.split(","):
        if left() < 120:
            res["shapes"][name] = {"skipped": f"deadline ({left():.0f} s left)"}
            continue
        if name == "glm9b":
            cfg = dict(ge.GLM4_9B if cuda else ge.TINY)
            if a.glm_layers:
                cfg["num_hidden_layers"] = a.glm_layers
            S = dict(base, vocab=cfg["vocab_size"])
            res["shapes"][name] = run_shape(name, lambda: ge.build(cfg, device, dtype), S, prompts=a.glm_prompts,
                                            over_sampling=1.0, kv_gib=a.kv_gib if cuda else 0.01, cuda=cuda, left=left,
                                            settings=settings, tiles_from=a.tiles_from,
                                            steps_only=a.steps_only, profile=a.profile)
            res["shapes"][name]["layers"] = cfg["num_hidden_layers"]
        elif name == "qwen06":
            S = dict(base)
            res["shapes"][name] = run_shape(name, lambda: qwen_model(S, device, dtype), S, prompts=a.qwen_prompts,
                                            over_sampling=a.qwen_over_sampling, kv_gib=a.kv_gib if cuda else 0.01,
                                            cuda=cuda, left=left, settings=settings, tiles_from=a.tiles_from,
                                            steps_only=a.steps_only, profile=a.profile)
        else:
            raise SystemExit(f"--shapes: no shape {name!r} (glm9b, qwen06)")
        out.write_text(json.dumps(res, indent=1))
    res["total_s"] = round(time.time() - t_start, 1)
    out.write_text(json.dumps(res, indent=1))
    print(f"\n{'shape':<8}{'setting':<14}{'tok/s':>9}{'ms/step':>9}{'quant s':>9}{'gap mean':>10}{'p99':>9}{'max':>9}")
    for name, r in res["shapes"].items():
        for s in settings:
            x = r.get(s, {})
            ro, g = x.get("rollout", {}), x.get("logprob_gap_vs_hf_bf16", {})
            print(f"{name:<8}{s:<14}{ro.get('tok_s', '-'):>9}{ro.get('ms_per_step', '-'):>9}"
                  f"{x.get('quantise_at_sync', {}).get('s', '-'):>9}{g.get('mean', '-'):>10}{g.get('p99', '-'):>9}"
                  f"{g.get('max', '-'):>9}  {x.get('error') or x.get('skipped') or ''}")
        for k, v in r.items():
            if k.endswith("_over_bf16_tok_s"):
                print(f"{name:<8}{k}: {v}")
    print(f"written {out} ({res['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
