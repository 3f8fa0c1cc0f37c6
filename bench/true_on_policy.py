"""rollout.true_on_policy on a GPU (issue 61 items 2-3): engine and trainer with the setting on, max |Δ log p|.

    python3 bench/true_on_policy.py --out $OUT                         # Qwen3-0.6B shape, 28 layers, 16,384 tokens
    python3 bench/true_on_policy.py --out $OUT --family glm4 --layers 4  # GLM-4-9B's shape, 4 layers
    python3 bench/true_on_policy.py --cpu                              # smoke: tiny model, bf16, a preempting pool

One process holds both sides on the same random model (bench/logp_gap_attribution.py's `setup`: the family's known
config, norms and biases drawn around 1 and 0 as a trained model's, converted to torch_dist): the built-in engine
(paged decoder) and the megatron trainer (the recipe's micro-batch 1), both built with ``true_on_policy=True``, as
`grpoflow run` builds them under ``rollout.true_on_policy: true``. The engine samples prompts x samples responses of
a fixed length after fixed-length prompts (GPU: 8 x 8 x 256 after 256, 16,384 tokens); then:

  alone       a few samples generated alone against the same samples in the batch (batch invariance)
  preempted   the samples again from an engine whose KV pool holds about half of them: preempted rows are recomputed
              through the prefill (skipped when `--deadline` leaves too little)
  scored      the trainer's log-prob pass (`compute_logprobs`) against the engine's log-probs: max |Δ|, bitwise
              share, for the samples and the preempted samples
  trained     one optimizer step on the samples (advantages +1/-1): the training forward's log-probs against the
              engine's (`train_rollout_logp_absdiff`, a mean of |Δ|: 0 iff every token is bitwise equal)
  default     (`--default`, if the deadline leaves time) the default engine and trainer on the same keys: their gap
              and timings beside the setting's (a rough look at the cost, item 4; not at the recipe's keyed lengths)

Passes when every max |Δ| is 0. JSON in OUT/true_on_policy.json (`--results-dir` keeps a copy named by device and
date). On the GPU the engine keeps CUDA graphs (its attention has no host sync) and compiles nothing (the setting's
pieces run eager).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import harness as H
import logp_gap_attribution as lga

SHAPES = {
    "gpu": dict(prompts=8, samples=8, prompt_len=256, new=256, dtype="bfloat16", device="cuda", kv_cache_gb=8.0,
                tiny=False, alone_rows=4),
    "cpu": dict(prompts=2, samples=4, prompt_len=12, new=40, dtype="bfloat16", device="cpu", kv_cache_gb=0.001,
                tiny=True, alone_rows=2),
}


def build_trainer(S, W: Path, rows: int, on: bool):
    from runtime.config import AlgorithmSection, TrainSection
    from runtime.trainer.megatron_trainer import MegatronTrainer
    train = TrainSection(lr=1e-6, micro_batch_size=1, num_rollout=1, num_steps_per_rollout=1, global_batch_size=rows)
    return MegatronTrainer(hf_dir=str(W / "hf"), init_checkpoint=str(W / "td"), train=train,
                           algorithm=AlgorithmSection(), temperature=1.0, device=S["device"], dtype=S["dtype"],
                           true_on_policy=on)


def build_engine(S, W: Path, rows: int, on: bool, kv_cache_gb=None):
    from runtime.rollout.builtin import BuiltinEngine
    eng = BuiltinEngine(str(W / "hf"), device=S["device"], dtype=lga.dtype_of(S), max_batch_size=rows,
                        decode_path="paged", kv_cache_gb=kv_cache_gb or S["kv_cache_gb"],
                        sync_every=4 if S["device"] == "cpu" else 16, true_on_policy=on)
    eng.eos_token_ids = set()  # fixed length: a random model would stop at random
    return eng


def timed_generate(S, eng, reqs, sp):
    t0 = time.time()
    out = eng.generate(reqs, sp)
    H.sync(S)
    s = time.time() - t0
    return out, {"generate_s": round(s, 2), "tok_s": round(sum(len(o.response_ids) for o in out) / s, 1),
                 "preemptions": eng.decoder.stats.get("preemptions"), "attention": eng.decoder.stats.get("attention"),
                 "cuda_graphs": eng.decoder.use_graphs}


def score_and_train(S, tr, samples) -> dict:
    batch = H.samples_batch(samples, advantages=[1.0 if i % 2 == 0 else -1.0 for i in range(len(samples))])
    t0 = time.time()
    scored = tr.compute_logprobs(batch)
    H.sync(S)
    score_s = time.time() - t0
    stats = lga.gap_stats([s.response_logprobs for s in samples], scored)
    m = tr.train(batch)
    return {"scored": stats, "score_s": round(score_s, 2),
            "trained": {"train_rollout_logp_absdiff": m["train_rollout_logp_absdiff"], "tokens": m["train_tokens"],
                        "train_s": round(m["train_time_s"], 2)}}


def run(S, W: Path, a, t_start: float) -> dict:
    from runtime.mcore.determinism import fix_cublas_workspace
    fix_cublas_workspace()  # before the process's first cuBLAS handle, as the trainer's process has it
    res: dict = {"setup": lga.setup(S, W, a.family, a.layers)}
    left = lambda: a.deadline - (time.time() - t_start)  # noqa: E731
    R = S["prompts"] * S["samples"]
    eng = build_engine(S, W, R, True)
    reqs, sp = lga.requests(S, eng.vocab_size), lga.sampling(S)
    out, res["engine"] = timed_generate(S, eng, reqs, sp)
    t0 = time.time()
    pick = sorted({round(i * (R - 1) / max(S["alone_rows"] - 1, 1)) for i in range(S["alone_rows"])})
    alone = [eng.generate([r], sp)[0] for r in lga.requests(S, eng.vocab_size, pick)]
    res["alone"] = {"rows": pick, **lga.agreement(alone, [out[i] for i in pick])}
    dec = eng.decoder
    page_bytes = dec.page_size * dec.kv_bytes_per_token()
    need = S["prompts"] * -(-S["prompt_len"] // dec.page_size) + R * -(-S["new"] // dec.page_size)
    small = max(int(0.55 * need), 2) * page_bytes / 2**30
    per_pass = time.time() - t0 + res["engine"]["generate_s"]
    eng.shutdown()
    del eng
    pout = None
    if left() > 2 * per_pass + 30:  # before the trainer's step: scored under the weights that sampled them
        pe = build_engine(S, W, R, True, kv_cache_gb=small)
        pout, st = timed_generate(S, pe, reqs, sp)
        pe.shutdown()
        del pe
        res["preempted"] = {**st, "kv_cache_gb": round(small, 4), **lga.agreement(pout, out)}
    else:
        res["preempted"] = {"status": "SKIPPED", "error": "deadline"}
    tr = build_trainer(S, W, R, True)
    res["trainer"] = {"core_attention": type(tr.model.decoder.layers[0].self_attention.core_attention).__name__,
                      "norm": type(tr.model.decoder.final_layernorm).__name__}
    if pout is not None:
        res["preempted"]["gap"] = lga.gap_stats([s.response_logprobs for s in pout],
                                                tr.compute_logprobs(H.samples_batch(pout)))
    res.update(score_and_train(S, tr, out))
    print("SCORED", json.dumps(res["scored"]), "TRAINED", json.dumps(res["trained"]), flush=True)
    del tr
    if a.default and left() > 3 * per_pass + 60:
        eng = build_engine(S, W, R, False)
        dout, st = timed_generate(S, eng, reqs, sp)
        eng.shutdown()
        del eng
        tr = build_trainer(S, W, R, False)
        res["default"] = {"engine": st, **score_and_train(S, tr, dout)}
        del tr
    elif a.default:
        res["default"] = {"status": "SKIPPED", "error": "deadline"}
    maxes = [res["scored"]["max"], res["trained"]["train_rollout_logp_absdiff"]]
    if "gap" in res["preempted"]:
        maxes.append(res["preempted"]["gap"]["max"])
    res["max_abs_diff"] = max(maxes)
    res["bitwise"] = res["max_abs_diff"] == 0.0 and res["alone"]["logp_bitwise_equal_frac"] == 1.0
    return res


def print_table(summary: dict) -> None:
    r = summary.get("result") or {}
    if "error" in summary:
        print("FAILED:", summary["error"])
    rows = [("what", "tokens", "max |d|", "mean |d|", "bitwise", "s")]
    if "scored" in r:
        sc = r["scored"]
        rows.append(("engine vs trainer log-prob pass", sc["tokens"], f"{sc['max']:.3g}", f"{sc['mean']:.3g}",
                     sc["bitwise_equal_frac"], r["score_s"]))
        t = r["trained"]
        rows.append(("engine vs trainer training forward", t["tokens"], "-", f"{t['train_rollout_logp_absdiff']:.3g}",
                     t["train_rollout_logp_absdiff"] == 0.0, t["train_s"]))
    if "gap" in r.get("preempted", {}):
        p = r["preempted"]
        rows.append((f"preempted ({p['preemptions']} preemptions) vs trainer", p["gap"]["tokens"],
                     f"{p['gap']['max']:.3g}", f"{p['gap']['mean']:.3g}", p["gap"]["bitwise_equal_frac"],
                     p["generate_s"]))
    d = r.get("default") or {}
    if "scored" in d:
        rows.append(("default engine vs default trainer", d["scored"]["tokens"], f"{d['scored']['max']:.3g}",
                     f"{d['scored']['mean']:.3g}", d["scored"]["bitwise_equal_frac"], d["score_s"]))
    H.print_columns(rows)
    for k in ("engine", "alone", "preempted"):
        if k in r:
            print(k, json.dumps(r[k]))
    if "engine" in d:
        print("default engine", json.dumps(d["engine"]), "default train_s", d["trained"]["train_s"])
    if "max_abs_diff" in r:
        print(f"max |engine log p - trainer log p| = {r['max_abs_diff']:.3g}; bitwise: {r['bitwise']}")


def main(argv=None) -> int:
    ap = H.parser(__doc__, "true_on_policy", 560.0, section=False)
    ap.add_argument("--family", choices=sorted(lga.KNOWN), default="qwen3")
    ap.add_argument("--layers", type=int, default=None, help="cut the known config to this many layers")
    ap.add_argument("--default", action="store_true", help="also the default engine and trainer (gap, timings)")
    a = ap.parse_args(argv)
    S = dict(SHAPES["cpu" if a.cpu else "gpu"])
    out, W = H.start(a, "true_on_policy")
    if a.cpu:
        lga._torch().set_num_threads(1)
    t_start = time.time()
    summary = {**H.summary_head("true_on_policy", H.env_info(S)), "shapes": S, "family": a.family}
    try:
        summary["result"] = run(S, W, a, t_start)
    except Exception as e:  # noqa: BLE001 - what was measured is lost, the reason is kept
        import traceback
        traceback.print_exc()
        summary["error"] = f"{type(e).__name__}: {e}"[:2000]
    summary["total_s"] = round(time.time() - t_start, 1)
    H.save_summary(summary, out, "true_on_policy", a.results_dir, a.cpu)
    print_table(summary)
    ok = "error" not in summary and summary["result"]["bitwise"]
    return 0 if ok or not a.cpu else 1


if __name__ == "__main__":
    sys.exit(main())
