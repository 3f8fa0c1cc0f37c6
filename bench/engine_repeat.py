"""The built-in engine's output, run to run (issue 37): same tokens, same log-prob bits?

Why (bench/README.md, `ray_faults.py`): two unbroken runs under Ray first parted at step 0's local gradients, the
rollout's log-probs moved and the trainer's did not. This isolates the engine: each `gen-*` section is a fresh process (the trainer and the built-in engine of the
one-GPU layout, `cluster.backend: local`) with a fresh inductor and Triton cache, as a new machine's first run has,
that generates ray_faults' rollout (8 prompts x 8 samples, keyed lengths to 2048 tokens) twice and has the trainer
score the first. The summary compares every section's tokens, engine log-probs and trainer log-probs bit for bit
with the first section of its variant and across variants, and gives the engine's warm tokens/s.

Variants: `plain` (as the product runs: `rollout.deterministic` on), `timed` (`rollout.deterministic=false`:
inductor times several configurations of each reduction at its first call and keeps the fastest, as before the
setting), `det` (torch's deterministic mode, warn-only, for the whole process from its start: inductor then keeps
one configuration per reduction, and torch's own kernels take their deterministic variants), `ind` (inductor's
deterministic mode for the whole process: what `rollout.deterministic` gives the engine's compiled pieces).
The engine's history, as the split layout's engine has one: `hist` generates another rollout first (the same prompts,
the next rollout's keys, so other lengths) and an evaluation (2 samples a prompt, its own token cap) in the same turn, its page pool, captured CUDA graphs and compiled code
kept, as a split engine keeps them from rollout 0 to rollout 1 (a colocated engine frees its pool and graphs after
each turn); `histrel` the same with the pool and graphs freed between the two (compiled code kept). Here the engine shares its process with the trainer, which fixes cuBLAS's workspace for the process
(train.deterministic); a Ray engine actor is a process of its own. `solo` and `solohist` are `plain` and `hist` with
the engine alone in its process (no trainer made: the engine's own weights load, no trainer log-probs), compared with
each other. `wide` and
`widehist` are those with the prompts the recipe's over-sampling draws (96 requests over 64 rows: prompts admitted as
rows free, rows compacted, as ray_faults' rollouts are). `sync` and `synchist`
are the wide pair with new weights copied in place (each tensor x 1.01, `update_weights`) before the compared rollout:
the rebuilt engine gets them before its first call, the unbroken one after its history, as the split layout's engine
does between rollout 0 and rollout 1, and `syncrel` is synchist with the pool and graphs freed after the update.
The `next` family has the prompts as the run has them: the compared rollout is rollout 1's (the dataset's next rows,
its keys), the history rollout 0's rows and the eval set's prompts; `next`/`nexthist` on the same weights,
`nextsync`/`nextsynchist` with the update as above (the split engine's whole story but the NCCL receive).

The trainer, the same way: each `step-*` section is a fresh process with fresh caches that runs two rollouts of the
one-GPU layout from the converted checkpoint, each with its update, and fingerprints every optimizer step's parameters
and gradients (bench/grad_trace.py); the summary's `compare_steps` says where two sections first part. Variants:
`plain` (as the product runs: `train.deterministic` on, the trainer's norm compiled in pieces that keep the tokens
apart, its weight gradient summed by torch: `fusions.deterministic_norm`), `tnorm` (the whole norm as one compiled
graph, torch's deterministic mode alone, as before 2026-11-27: how ray_faults' colocated runs from empty caches ended
1.5e-9 apart on Adam's state of 4 norm weights). Step and train times per rollout (the second warm).
What each pair gave on GPUs, and the results files: bench/README.md (`engine_repeat.py`, `ray_faults.py`).

    python3 bench/engine_repeat.py --out $OUT        # one GPU: setup, plain and timed twice each, 317 s
    python3 bench/engine_repeat.py --sections setup,gen-ind-a,gen-ind-b,gen-det-a --out $OUT
    python3 bench/engine_repeat.py --sections setup,step-plain-a,step-tnorm-a,step-plain-b,step-tnorm-b --out $OUT
    python3 bench/engine_repeat.py --sections setup,gen-solo-a,gen-solohist-a --out $OUT   # the engine's history alone
    python3 bench/engine_repeat.py --sections setup,gen-sync-a,gen-synchist-a --out $OUT   # and new weights after it
    python3 bench/engine_repeat.py --sections setup,gen-next-a,gen-nexthist-a,gen-nextsync-a,gen-nextsynchist-a --out $OUT
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import grad_trace  # fingerprints of every step's parameters and gradients
import harness as H
import norm_history  # the trainer's norm as it was compiled before
import ray_faults  # its shapes and configs
import ray_pipeline as rp  # the keyed-length hook, the converted inputs

VARIANTS = ("plain", "timed", "det", "ind", "hist", "histrel", "solo", "solohist", "wide", "widehist", "sync",
            "synchist", "syncrel", "next", "nexthist", "nextsync", "nextsynchist")
HISTORY = ("hist", "histrel", "solohist", "widehist", "synchist", "syncrel", "nexthist", "nextsynchist")
RELEASED = ("histrel", "syncrel")  # the pool and graphs freed after the history (compiled code kept)
NEXT = ("next", "nexthist", "nextsync", "nextsynchist")  # rollout 1's prompts; the history rollout 0's and the eval's
SYNC = ("sync", "synchist", "syncrel", "nextsync", "nextsynchist")  # new weights (copied in place, as a weight sync
# does) before the rollout
WIDE = ("wide", "widehist", "sync", "synchist", "syncrel", *NEXT)  # the prompts over-sampling draws: more than the rows
SOLO = ("solo", "solohist", *WIDE)  # the engine alone, as an actor is
# each variant is compared with its family's first variant (`pairs`): the same requests and weights, another history
FAMILY = {"solohist": "solo", "widehist": "wide", "synchist": "sync", "syncrel": "sync", "nexthist": "next",
          "nextsynchist": "nextsync", **{v: "plain" for v in ("timed", "det", "ind", "hist", "histrel")}}
STEP_VARIANTS = ("plain", "tnorm")
SECTIONS = ("setup", *(f"gen-{v}-{r}" for v in VARIANTS for r in "ab"),
            *(f"step-{v}-{r}" for v in STEP_VARIANTS for r in "ab"))
DEFAULT = ("setup", "gen-plain-a", "gen-timed-a", "gen-plain-b", "gen-timed-b")  # one call: 317 s on an H100
SECTION_MAX_S = {"setup": 240, **{s: 200 for s in SECTIONS[1:]}}


def digest_ints(rows: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def digest_floats(rows: list[list[float]]) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(struct.pack(f"<{len(r)}d", *r))
        h.update(b"|")
    return h.hexdigest()[:16]


def sec_setup(S, W: Path) -> dict:
    r = ray_faults.sec_setup(S, W)
    rp.standalone_inputs(S, W)  # converted once: every gen section starts from the same checkpoint
    return r


def session(S, W: Path, name: str, sets: list[str]):
    import yaml

    from runtime.config import config_with_overrides
    from runtime.grpo.session import TrainSession
    from runtime.run.frozen_config import with_plan_choices
    tree = yaml.safe_load((W / "faults-one-gpu.yaml").read_text())
    tree = with_plan_choices(config_with_overrides(tree, [], "bench")).model_dump(mode="json")
    tree["storage"] = {"root": str(W / f"root-{name}")}
    tree["tracking"] = {"enabled": False}
    cfg = config_with_overrides(tree, sets, "local")
    rd = H.run_dir_over(Path(cfg.storage.root), "local", rp.standalone_inputs(S, W))
    return TrainSession(cfg, rd)


def recompiles() -> list[str]:
    """From now on, each of dynamo's recompiles in this process as it logs it (the function, the guard that failed),
    and its warnings (e.g. a function past its recompile limit, run eagerly from then on): the list fills as they
    happen."""
    import logging

    import torch
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(" ".join(line.strip() for line in record.getMessage().splitlines()[:3])[:400])
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(Keep())
    return seen


def fresh_caches(W: Path, name: str) -> None:
    """A first run's caches: nothing compiled or tuned before (set before torch compiles anything)."""
    os.environ.update(ray_faults.compile_caches(W / "caches" / name))


def sec_step(S, W: Path, kept: Path, name: str) -> dict:
    """Two rollouts of the one-GPU layout from the converted checkpoint, each with its update, in a fresh process with
    fresh caches; every optimizer step's parameters and gradients fingerprinted (bench/grad_trace.py). `tnorm`: the
    trainer's norm compiled as one graph without inductor's deterministic mode, as before 2026-11-27."""
    variant = name.split("-")[1]
    fresh_caches(W, name)
    traces = kept / "traces" / name
    shutil.rmtree(traces, ignore_errors=True)
    os.environ[grad_trace.ENV] = str(traces)
    if variant == "tnorm":
        norm_history.norm_as_one_graph(inductor_deterministic=False)
    import runtime.trainer.megatron_trainer as megatron_trainer
    grad_trace.patch(megatron_trainer)
    sess = session(S, W, name, [])
    sess.ensure_at(None)
    steps = [sess.rollout(i) for i in range(2)]  # the first compiles, the second is warm
    sess.close()
    keys = ("step_time_s", "train_time_s", "generate_time_s", "train_tokens")
    return {"name": name, "variant": variant, **{k: [round(m[k], 3) for m in steps] for k in keys}}


def sec_gen(S, W: Path, kept: Path, name: str) -> dict:
    variant = name.split("-")[1]
    fresh_caches(W, name)
    import torch
    if variant == "det":
        torch.use_deterministic_algorithms(True, warn_only=True)
    elif variant == "ind":
        import torch._inductor.config as inductor_config
        inductor_config.deterministic = True
    from runtime.rollout.base import SamplingParams, keyed_requests
    sess = session(S, W, name, ["rollout.deterministic=false"] if variant == "timed" else [])
    if variant in SOLO:  # the converted model's weights as the engine loads them; no trainer made in this process
        engine = sess.cluster.engine(sess.rd.local(sess.rd.hf_model))
    else:
        sess.ensure_at(None)
        engine = sess.engine
    n_prompts = sess.cfg.rollout.rollout_batch_size
    if variant in WIDE:  # as dynamic sampling draws them (runtime/grpo/collect.py)
        n_prompts = max(n_prompts, int(n_prompts * sess.cfg.rollout.over_sampling_factor))
    seed, n = sess.cfg.train.seed, sess.cfg.rollout.n_samples_per_prompt

    def ids(rows: list[dict]) -> list[list[int]]:
        return [sess.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]

    def requests(prompts: list[list[int]], slot: int, n: int) -> list:  # keyed as the run keys them, flat
        return [r for group in keyed_requests(prompts, seed=seed, slot=slot, n=n) for r in group]

    rows, cursor = sess.dataset.batch(sess.dataset.initial_cursor(seed), n_prompts)
    prompts = ids(rows)
    params = SamplingParams(temperature=sess.cfg.rollout.temperature, max_new_tokens=sess.cfg.rollout.max_new_tokens)
    # a split engine's history before rollout 1: rollout 0, then the evaluation (2 samples of each prompt, its own
    # token cap). next: as the run has them (rollout 1 the next rows; the eval set's prompts); the others: the same
    # prompts throughout, rollout 0 with the next rollout's keys (other lengths)
    if variant in NEXT:
        reqs = requests(ids(sess.dataset.batch(cursor, n_prompts)[0]), 1, n)
        earlier = requests(prompts, 0, n)
        eval_rows = [json.loads(line) for line in (W / "data" / "eval.jsonl").read_text().splitlines() if line]
        evaluation = requests(ids(eval_rows), -1, 2)
    else:
        reqs, earlier, evaluation = requests(prompts, 0, n), requests(prompts, 1, n), requests(prompts, -1, 2)
    eval_params = SamplingParams(**sess.cfg.eval_sampling())
    if variant in SYNC:
        updated = updated_weights(sess.rd.local(sess.rd.hf_model))
        if variant not in HISTORY:  # a rebuilt engine: the new weights before its first call
            engine.update_weights(updated, 1)
    gens, times = [], []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    recompiled = recompiles()
    for i in range(2):  # the first compiles and tunes, the second is warm
        sync()
        t0 = time.time()
        with (sess.engine_turn() if variant not in SOLO else contextlib.nullcontext()):
            if i == 0 and variant in HISTORY:  # another rollout and an evaluation before, in this turn
                engine.generate(earlier, params)
                engine.generate(evaluation, eval_params)
                if variant in SYNC:  # the unbroken engine: rollout 0 and the evaluation on the old weights
                    engine.update_weights(updated, 1)
                if variant in RELEASED:
                    engine.release_memory()
                    engine.resume_memory()
                sync()
                t0 = time.time()
            gens.append(engine.generate(reqs, params))
        sync()
        times.append(time.time() - t0)
    samples = gens[0]
    batch = H.samples_batch(samples)
    trainer = sess.trainer.compute_logprobs(batch) if variant not in SOLO else []  # no trainer
    if variant in SOLO:
        engine.kill()
    sess.close()
    dump = {"tokens": [s.response_ids for s in samples], "engine": [s.response_logprobs for s in samples],
            "engine_again": [s.response_logprobs for s in gens[1]], "trainer": trainer}
    (kept / "dumps").mkdir(exist_ok=True)
    (kept / "dumps" / f"{name}.json").write_text(json.dumps(dump))
    n_tok = sum(len(s.response_ids) for s in samples)
    return {"name": name, "variant": variant, "tokens": n_tok, "gen_s": [round(t, 2) for t in times],
            "warm_tok_s": round(n_tok / times[1], 1),
            "digests": {"tokens": digest_ints(dump["tokens"]), "engine": digest_floats(dump["engine"]),
                        "engine_again": digest_floats(dump["engine_again"]), "trainer": digest_floats(trainer)},
            "same_process_repeat": {"tokens": [s.response_ids for s in gens[1]] == dump["tokens"],
                                    "engine_logprobs": dump["engine_again"] == dump["engine"]},
            "recompiles": recompiled}


def updated_weights(model_dir: str) -> dict:
    """The model's weights each scaled by 1.01 (in their own dtype): every tensor new, the same in every process."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update({k: (v.float() * 1.01).to(v.dtype) for k, v in load_file(str(f)).items()})
    return out


def _max_abs(a: list[list[float]], b: list[list[float]]) -> float | None:
    if [len(r) for r in a] != [len(r) for r in b]:
        return None
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


def pairs(names: list[str]) -> list[tuple[str, str]]:
    """Each section (`kind-variant-repeat`) with the first section of its variant, and each variant's first with
    its family's first (`FAMILY`)."""
    firsts: dict = {}
    for n in names:
        firsts.setdefault(n.split("-")[1], n)
    out = [(n, firsts[n.split("-")[1]]) for n in names if n != firsts[n.split("-")[1]]]
    return out + [(f, firsts[FAMILY[v]]) for v, f in firsts.items() if FAMILY.get(v) in firsts]


def compare(kept: Path, names: list[str]) -> dict:
    """Each generation section against its pair's (`pairs`): tokens and log-probs bit for bit."""
    dumps = {n: json.loads((kept / "dumps" / f"{n}.json").read_text()) for n in names
             if (kept / "dumps" / f"{n}.json").exists()}
    out = {}
    for a, b in pairs(list(dumps)):
        da, db = dumps[a], dumps[b]
        scored = ("engine", "trainer") if da["trainer"] and db["trainer"] else ("engine",)  # solo: no trainer
        out[f"{a} vs {b}"] = {
            "same_tokens": da["tokens"] == db["tokens"],
            "tokens_differ_rows": sum(x != y for x, y in zip(da["tokens"], db["tokens"])),
            **{f"{k}_bitwise": da[k] == db[k] for k in scored},
            **{f"{k}_max_abs": _max_abs(da[k], db[k]) for k in scored}}
    return out


def compare_steps(kept: Path, names: list[str]) -> dict:
    """Each step section's fingerprints against its pair's (`pairs`): where the two first part
    (grad_trace.first_difference)."""
    return {f"{a} vs {b}": grad_trace.first_difference(grad_trace.read(kept / "traces" / a),
                                                        grad_trace.read(kept / "traces" / b))
            for a, b in pairs(names)}


def summarize(res: dict, kept: Path, env: dict) -> dict:
    ok = [n for n in res if res[n].get("status") == "ok"]
    return {**H.summary_head("engine_repeat", env), "sections": res,
            "compare": compare(kept, [n for n in ok if n.startswith("gen-")]),
            "compare_steps": compare_steps(kept, [n for n in ok if n.startswith("step-")])}


def print_table(summary: dict) -> None:
    print(f"engine_repeat on {summary['device']}")
    for n, r in summary["sections"].items():
        if n.startswith("gen-"):
            print(f"  {n:12s} {r.get('status')}  warm {r.get('warm_tok_s')} tok/s  gen_s {r.get('gen_s')}  "
                  f"digests {r.get('digests')}  same-process repeat {r.get('same_process_repeat')}  {r.get('error', '')}")
            for line in r.get("recompiles") or []:
                print(f"  {'':12s} recompiled: {line}")
        elif n.startswith("step-"):
            print(f"  {n:14s} {r.get('status')}  step_time_s {r.get('step_time_s')}  train_time_s "
                  f"{r.get('train_time_s')}  {r.get('error', '')}")
        else:
            print(f"  {n:12s} {r.get('status')} {r.get('error', '')}")
    for k, v in {**summary["compare"], **summary["compare_steps"]}.items():
        print(f"  {k}: {v}")


def main(argv=None) -> int:
    ap = H.parser(__doc__, "engine_repeat", 570.0, cpu_help="tiny shapes on CPU: the wiring", sections=SECTIONS,
                  sections_default=",".join(DEFAULT), results_dir=False)
    a = ap.parse_args(argv)
    out, W = H.start(a, "engine_repeat")
    S = ray_faults.shapes(cpu=a.cpu)
    os.environ.update(rp.hook_env(S))  # the keyed lengths of the fault runs
    if a.section:
        sec = sec_step if a.section.startswith("step-") else sec_gen
        # dumps and traces go to out: a call cut short still brings back what its finished sections made
        fn = sec_setup if a.section == "setup" else (lambda S, W: sec(S, W, out, a.section))
        return H.section_exit(H.run_section(a.section, S, W, out, fn))
    H.clear_results(out)
    sections = H.sections_of(a, DEFAULT)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}: {SECTIONS}")
    H.run_sections_in_processes(Path(__file__), sections, W, out, a.deadline, SECTION_MAX_S,
                                extra_args=("--cpu",) if a.cpu else ())
    summary = summarize(H.read_results(out), out, H.env_info(S["model"]))
    (out / "engine_repeat.json").write_text(json.dumps(summary, indent=1, default=str))
    print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
