"""The SGLang backend against tests/sglang_standin.py (SGLang itself cannot run here).

What these tests show: the client's payloads and parsing as read from SGLang 0.5.23's source, result
order under concurrency across engines, weight-update calls and their order relative to generation,
colocate memory release/resume, weight sync by a real gloo broadcast from a MegatronTrainer (the
stand-in joins the group and receives the tensors), restart + re-sync of a killed or hung engine,
start-up failures and timeouts, partial rollout (continued samples; aborting by rid once enough groups are
complete); a request the server refuses (0.5.23's 400, 0.5.17's 500 from a healthy server) as one error, and the
main calls against the stand-in's 0.5.17 mode. They do not show that a real SGLang server accepts any of it
(bench/sglang_real.py does, on a GPU), nor anything about NCCL.

Kills, hangs and shutdowns happen on events, never after a sleep: the stand-in creates a marker file
when it holds a request (`stall`), and the test waits for that file. Such tests are marked `race`.
Partial rollout's tests order answers and aborts with the stand-in's `--gate` and `--hold-rids` instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import SGLangSection, config_from_dict
from runtime.errors import ConfigError, ModelError, TransientError
from runtime.rollout.base import SampleRequest, SamplingParams
from runtime.rollout.sglang import INSTALL_HINT, SGLangEngine, SGLangError, SGLangSettings, Supervision
from runtime.rollout.sglang import http_protocol
from runtime.rollout.sglang.http_protocol import Aborted, StaleWeights, parse_generated, sampling_seed_for
from runtime.rollout.sglang.server_process import Server, server_command

ROOT = Path(__file__).resolve().parents[1]
STANDIN = Path(__file__).with_name("sglang_standin.py")
VOCAB, EOS = 96, 2
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": VOCAB, "eos_token_id": EOS}))
    save_file({"w": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    return d


@pytest.fixture
def start(tmp_path, model_dir):
    """start(*standin_flags, colocate=, sync_backend=, **rollout_sglang_keys) -> a running SGLangEngine on
    stand-ins; all killed by pid afterwards. Its timeouts are generous (a loaded 2-core machine can be
    tens of times slower than an idle one); tests of a timeout set their own."""
    made: list[SGLangEngine] = []
    calls_file = tmp_path / "calls.jsonl"

    def _start(*flags, model=None, colocate=False, sync_backend="nccl", routing_replay=False, **section):
        keys = dict(launch=["{python}", str(STANDIN), "--calls-file", str(calls_file), *flags],
                    scratch_dir=str(tmp_path / "scratch"), request_timeout_s=60.0, startup_timeout_s=60.0)
        keys.update(section)
        settings = SGLangSettings(section=SGLangSection(**keys), colocate=colocate, random_seed=1,
                                  sync_backend=sync_backend, routing_replay=routing_replay,
                                  supervision=Supervision(health_poll_s=0.05, kill_grace_s=2.0, health_timeout_s=0.5))
        eng = SGLangEngine(settings, str(model or model_dir))
        made.append(eng)
        return eng

    _start.calls_file = calls_file
    try:
        yield _start
    finally:
        for eng in made:
            eng.shutdown()
            for proc in eng.pool.procs:  # belt and braces: nothing we started outlives the test
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    # the client calls no route the server lacks (each release has routes the other lacks: the stand-in's ONLY_IN)
    assert not [c["path"] for c in read_calls(calls_file) if c["status"] == 404]


def read_calls(calls_file: Path) -> list[dict]:
    if not calls_file.exists():
        return []
    return [json.loads(line) for line in calls_file.read_text().splitlines() if line.strip()]


def is_probe(call: dict) -> bool:
    return call["path"] == "/generate" and str((call.get("body") or {}).get("rid", "")).startswith("gf-logprobs")


def rollout_generates(calls):
    return [c for c in calls if c["path"] == "/generate" and not is_probe(c)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait for an event (a file exists, a state is reached); the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def stall(eng, index: int, marker: Path) -> None:
    """Have server `index` hold every rollout request from now on, creating `marker` when it holds one."""
    httpx.post(eng.urls[index] + "/_stall_generate", json={"marker": str(marker)}, trust_env=False, timeout=60).raise_for_status()


def make_requests(n_prompts=3, n_samples=2, seed=7, rollout=0):
    return [SampleRequest(prompt_ids=[10 + p, 20 + p, 30 + p], key=(seed, rollout, p, s))
            for p in range(n_prompts) for s in range(n_samples)]


SAMPLING = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=6, stop_token_ids=[5])


def as_tuples(results):
    return [(r.prompt_ids, r.response_ids, r.response_logprobs, r.finish_reason) for r in results]


# ---- payloads and parsing -------------------------------------------------------------------------


def test_generate_payloads_and_parsing(start):
    eng = start()
    cmd = server_command(eng.settings, eng.model_dir, eng.pool.servers[0])
    for flag, value in [("--model-path", eng.model_dir), ("--tp-size", "1"), ("--mem-fraction-static", "0.7"),
                        ("--host", "127.0.0.1"), ("--weight-version", "0"), ("--random-seed", "1")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-deterministic-inference" in cmd and "--enable-memory-saver" not in cmd

    requests = make_requests()
    results = eng.generate(requests, SAMPLING)
    assert len(results) == len(requests)
    for req, res in zip(requests, results):
        assert res.prompt_ids == req.prompt_ids
        assert 1 <= len(res.response_ids) == len(res.response_logprobs) <= 6
        assert all(lp <= 0.0 for lp in res.response_logprobs)
        stopped = res.response_ids[-1] in (EOS, 5)
        assert res.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(res.response_ids) == 6
        assert res.text == "".join(f"<{t}>" for t in res.response_ids)

    sent = rollout_generates(read_calls(start.calls_file))
    assert len(sent) == len(requests)
    by_key = {tuple(int(x) for x in c["body"]["rid"].split("-")[1:5]): c["body"] for c in sent}
    for req in requests:
        body = by_key[req.key]
        assert body["input_ids"] == req.prompt_ids and body["return_logprob"] is True
        assert body["sampling_params"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 6,
                                           "stop_token_ids": [5], "sampling_seed": sampling_seed_for(req.key)}
    assert len({sampling_seed_for(r.key) for r in requests}) == len(requests)
    # keyed: the same keys draw the same tokens, whatever the batch around them
    again = eng.generate(list(reversed(requests)), SAMPLING)
    assert as_tuples(reversed(again)) == as_tuples(results)

    # SGLang's 400 is surfaced with its message, not retried
    with pytest.raises(ConfigError, match="vocab size"):
        eng.generate([SampleRequest(prompt_ids=[VOCAB + 5], key=(0, 0, 0, 0))], SAMPLING)


def test_response_parsing_edge_cases():
    ok = {"text": "x", "output_ids": [4, 2],
          "meta_info": {"finish_reason": {"type": "stop", "matched": 2}, "completion_tokens": 2, "weight_version": "3",
                        "output_token_logprobs": [[-0.5, 4, None], [-1.25, 2, None]]}}
    got = parse_generated(ok, expected_version="3")
    assert (got.ids, got.logprobs, got.text, got.finish) == ([4, 2], [-0.5, -1.25], "x", "stop")
    with pytest.raises(StaleWeights):
        parse_generated(ok, expected_version="4")
    abort = {**ok, "meta_info": {**ok["meta_info"], "finish_reason": {"type": "abort", "message": "paused"}}}
    with pytest.raises(Aborted):  # an abort the client did not ask for: retried
        parse_generated(abort)
    # one it asked for (partial rollout): the tokens so far are the result, none at all when cut before the first
    assert parse_generated(abort, abort_ok=True).ids == [4, 2]
    empty = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "completion_tokens": 0}}
    assert (parse_generated(empty, abort_ok=True).ids, parse_generated(empty, abort_ok=True).finish) == ([], "abort")
    with pytest.raises(SGLangError, match="disagree"):
        parse_generated({**ok, "output_ids": [4, 3]})
    with pytest.raises(SGLangError, match="return_logprob"):
        parse_generated({**ok, "meta_info": {"finish_reason": {"type": "length", "length": 2}}})


@pytest.mark.race
def test_order_under_concurrency_across_engines(start):
    eng = start("--gen-jitter", "0.04", num_engines=2, concurrency=3)
    assert len(set(eng.pids)) == 2 and len(set(eng.urls)) == 2
    requests = [SampleRequest(prompt_ids=[1 + i % 50, 3, 7 + i % 11], key=(1, 0, i, 0)) for i in range(30)]
    results = eng.generate(requests, SAMPLING)
    assert [r.prompt_ids for r in results] == [r.prompt_ids for r in requests]
    shuffled = requests[::2] + requests[1::2]
    again = dict(zip([r.key for r in shuffled], eng.generate(shuffled, SAMPLING)))
    assert as_tuples(again[r.key] for r in requests) == as_tuples(results)
    per_engine = [httpx.get(u + "/_calls", trust_env=False, timeout=60).json() for u in eng.urls]
    for info in per_engine:
        assert 0 < len(rollout_generates(info["calls"])) < 60  # both engines took a share
        assert info["max_inflight_generate"] <= 3


def test_logprobs_of_matches_generation(start):
    eng = start()
    res = eng.generate(make_requests(1, 1), SAMPLING)[0]
    again = eng.logprobs_of(res.prompt_ids, res.response_ids, temperature=SAMPLING.temperature)
    assert again == pytest.approx(res.response_logprobs, abs=1e-9)


# ---- weight sync ----------------------------------------------------------------------------------


@pytest.mark.race
def test_update_weights_from_disk_calls_and_order(start):
    eng = start()
    requests = make_requests()
    before = eng.generate(requests, SAMPLING)
    tied = torch.randn(4, 3)
    tensors = {"model.embed_tokens.weight": tied, "lm_head.weight": tied, "w": torch.randn(5)}
    done_before_update = len(read_calls(start.calls_file))
    eng.update_weights(tensors, 1)
    assert eng.weight_version == 1 and eng.health()["ok"]
    wdir = Path(eng.health()["weights_dir"])
    saved = load_file(str(wdir / "model.safetensors"))
    assert set(saved) == set(tensors) and all(torch.equal(saved[k], v) for k, v in tensors.items())
    assert json.loads((wdir / "config.json").read_text())["vocab_size"] == VOCAB
    after = eng.generate(requests, SAMPLING)
    assert [r.response_logprobs for r in after] != [r.response_logprobs for r in before]

    calls = read_calls(start.calls_file)
    updates = [c for c in calls if c["path"] == "/update_weights_from_disk"]
    assert len(updates) == 1
    up = updates[0]
    assert up["body"] == {"model_path": str(wdir), "weight_version": "1", "flush_cache": True, "abort_all_requests": False}
    gens = [c for c in calls if c["path"] == "/generate"]
    # (n0, n1: the order of start and end in the one server, by its counter, not by a clock)
    # no generation overlaps the update; rollout requests sent before it came back before it started
    assert all(g["n1"] < up["n0"] or g["n0"] > up["n1"] for g in gens)
    sent_before = rollout_generates(calls[:done_before_update])
    assert len(sent_before) == len(requests) and all(g["n1"] < up["n0"] for g in sent_before)
    # right after the update, a probe (fixed tokens, input log-probs) checks the new weights
    first_after = min((g for g in gens if g["n0"] > up["n1"]), key=lambda g: g["n0"])
    assert is_probe(first_after) and first_after["body"]["logprob_start_len"] == 0

    eng.update_weights({"w": torch.randn(5)}, 2)
    assert eng.weight_version == 2 and not wdir.exists()  # only the current copy is kept


def test_unchanged_weights_are_warned_about(start, caplog):
    eng = start("--ignore-weight-updates")
    with caplog.at_level("WARNING", logger="runtime.rollout.sglang"):  # the package's loggers are its children
        eng.update_weights({"w": torch.ones(3)}, 1)
    assert any("did not change" in r.getMessage() for r in caplog.records)
    assert eng.weight_version == 1


def test_colocate_release_and_resume_order(start):
    eng = start(colocate=True)
    assert "--enable-memory-saver" in server_command(eng.settings, eng.model_dir, eng.pool.servers[0])
    eng.release_memory()
    assert eng.health()["released"]
    eng.update_weights({"w": torch.randn(3)}, 1)
    assert not eng.health()["released"]
    eng.release_memory()
    results = eng.generate(make_requests(1, 2), SAMPLING)  # resumes by itself
    assert len(results) == 2
    seq = [(c["path"], (c.get("body") or {}).get("tags")) for c in read_calls(start.calls_file)
           if c["path"] not in ("/generate", "/health_generate", "/health")]
    every = ["weights", "kv_cache", "cuda_graph"]  # a tag left paused (the CUDA graphs') gave wrong log-probs on a GPU
    assert seq == [("/flush_cache", None), ("/release_memory_occupation", every),
                   ("/resume_memory_occupation", ["weights"]), ("/update_weights_from_disk", None),
                   ("/resume_memory_occupation", ["kv_cache", "cuda_graph"]),
                   ("/flush_cache", None), ("/release_memory_occupation", every),
                   # released weights come back as uninitialised memory: loaded again before serving
                   ("/resume_memory_occupation", ["weights"]), ("/update_weights_from_disk", None),
                   ("/resume_memory_occupation", ["kv_cache", "cuda_graph"])]


def test_resume_memory_takes_it_back_before_any_request(start):
    eng = start(colocate=True)

    def memory_calls():
        return [(c["path"], c.get("body")) for c in read_calls(start.calls_file)
                if c["path"] not in ("/generate", "/health_generate", "/health")]

    eng.resume_memory()  # nothing released: nothing sent
    eng.release_memory()
    eng.release_memory()  # already released: nothing sent
    assert eng.health()["released"]
    eng.resume_memory()
    assert not eng.health()["released"]
    every = {"tags": ["weights", "kv_cache", "cuda_graph"]}
    reload = {"model_path": eng.model_dir, "weight_version": "0", "flush_cache": True, "abort_all_requests": False}
    expected = [("/flush_cache", None), ("/release_memory_occupation", every),
                ("/resume_memory_occupation", {"tags": ["weights"]}), ("/update_weights_from_disk", reload),
                ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})]
    assert memory_calls() == expected
    # generate sends no resume of its own, and the stand-in (which answers 400 to a /generate while
    # anything is released) serves it: the memory is back
    assert len(eng.generate(make_requests(1, 2), SAMPLING)) == 2
    assert memory_calls() == expected
    # without colocate the servers have no memory saver: release is a no-op
    plain = start()
    plain.release_memory()
    assert not plain.health()["released"]


@pytest.mark.parametrize("weight_sync", ["disk", "tensor"])
def test_samples_after_release_and_resume_equal_those_before(start, weight_sync):
    """SGLang's memory saver keeps no copy of released weights: an engine turn that resumes them without a weight
    update (an evaluation's, then the next rollout's) must load them again, or it samples from whatever the
    trainer left in that memory (0.365 mean |Δ log p| on an H200; the stand-in models the loss)."""
    eng = start(colocate=True, weight_sync=weight_sync)
    eng.update_weights({"w": torch.randn(3)}, 1)
    before = eng.generate(make_requests(2, 2), SAMPLING)
    eng.release_memory()
    eng.resume_memory()
    after_resume = eng.generate(make_requests(2, 2), SAMPLING)
    eng.release_memory()
    after_generate = eng.generate(make_requests(2, 2), SAMPLING)  # resumes by itself
    for got in (after_resume, after_generate):
        assert [(r.response_ids, r.response_logprobs) for r in got] == [(r.response_ids, r.response_logprobs) for r in before]
    assert eng.weight_version == 1


def test_the_server_runs_nccl_with_the_trainers_cumem_setting(start, monkeypatch):
    """SGLang would set NCCL_CUMEM_ENABLE=0 for itself while the trainer's NCCL keeps its default, and the first
    broadcast of the weight-sync group hung on two H200s: the server gets the trainer's setting explicitly."""
    def server_environ(eng) -> dict[str, str]:
        raw = Path(f"/proc/{eng.pool.servers[0].proc.pid}/environ").read_bytes()
        return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)

    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert server_environ(start())["NCCL_CUMEM_ENABLE"] == "1"
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")  # a user's own choice reaches both sides as it is
    assert server_environ(start())["NCCL_CUMEM_ENABLE"] == "0"


@pytest.mark.race
def test_engine_killed_while_released_gives_its_memory_back(start):
    """A server restarted while the pool is released (the trainer holds the GPU) is released again once healthy and
    re-synced, and every resume goes only to the tags a server released (0.5.17 answers a resume of a tag it holds
    with a 500, as the stand-in does)."""
    eng = start("--sglang-version", "0.5.17", num_engines=2, colocate=True)
    eng.update_weights({"w": torch.randn(6)}, 1)
    every = ["weights", "kv_cache", "cuda_graph"]

    def kill(index: int) -> int:
        pid, proc = eng.pids[index], eng.pool.servers[index].proc
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)  # dead and reaped: the pool sees it exited
        return pid

    eng.release_memory()
    victim = kill(0)
    assert not eng.weight_sync_ready()  # its check restarts what exited (no group was formed: False anyway)
    row = eng.health()["engines"][0]
    assert row["restarts"] == 1 and eng.pids[0] != victim and row["state"] == "ready" and row["released"] == every
    fresh = [(c["path"], (c.get("body") or {}).get("tags")) for c in read_calls(start.calls_file)
             if c["pid"] == eng.pids[0] and c["path"] not in ("/health", "/health_generate")]
    assert fresh == [("/update_weights_from_disk", None), ("/generate", None),  # re-synced and probed, then released
                     ("/flush_cache", None), ("/release_memory_occupation", every)]
    eng.resume_memory()
    assert not eng.health()["released"]
    assert len(eng.generate(make_requests(1, 2), SAMPLING)) == 2  # the stand-in answers 400 while anything is released

    # killed while released, found by the resume itself: restarted to what stays released (nothing), not resumed
    eng.release_memory()
    victim = kill(1)
    eng.resume_memory()
    h = eng.health()
    assert h["ok"] and h["engines"][1]["restarts"] == 1 and eng.pids[1] != victim and not h["released"]
    assert len(eng.generate(make_requests(2, 2), SAMPLING)) == 4
    resumes = [c for c in read_calls(start.calls_file) if c["path"] == "/resume_memory_occupation"]
    assert all(c["status"] == 200 for c in resumes)
    # a resume is two calls (the weights, loaded again, then the rest); engine 1's fresh process came up while the
    # weights' call was under way: released to what stayed released, it is resumed for that only
    fresh = [(c["path"], (c.get("body") or {}).get("tags")) for c in read_calls(start.calls_file)
             if c["pid"] == eng.pids[1] and c["path"] in ("/release_memory_occupation", "/resume_memory_occupation")]
    assert fresh == [("/release_memory_occupation", ["kv_cache", "cuda_graph"]),
                     ("/resume_memory_occupation", ["kv_cache", "cuda_graph"])]


def test_tensor_sync_payloads(start):
    eng = start(tp_size=2, weight_sync="tensor")
    eng.update_weights({"w": torch.randn(4, 4), "b": torch.randn(4)}, 1)
    assert eng.weight_version == 1
    assert (Path(eng.health()["weights_dir"]) / "model.safetensors").is_file()  # kept for re-syncing a restart
    up = [c for c in read_calls(start.calls_file) if c["path"] == "/update_weights_from_tensor"]
    assert len(up) == 1 and len(up[0]["body"]["serialized_named_tensors"]) == 2  # one payload per TP rank
    assert up[0]["body"]["weight_version"] == "1"
    assert not [c for c in read_calls(start.calls_file) if c["path"] == "/update_weights_from_disk"]


# ---- weight sync by broadcast from a real trainer (gloo) -----------------------------------------
# Trainer rank 0 is a MegatronTrainer in a process of its own (runtime.placement.subprocess_group), the way
# cluster.backend=local runs it with cluster.weight_sync=broadcast; the stand-ins join its group
# through /init_weights_update_group and receive through /update_weights_from_distributed.


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """(trainer handle, HF dir) of a tiny Qwen3 (tied embeddings) on CPU; killed after the module."""
    from runtime.config import GrpoConfig
    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.placement.ports import free_port
    from runtime.models.tiny import build_tiny_qwen3
    from runtime.placement.handles import TrainerHandle
    from runtime.placement.subprocess_group import SubprocessGroup
    root = tmp_path_factory.mktemp("sglang-broadcast")
    hf = build_tiny_qwen3(root / "hf", seed=5)["path"]
    hf_to_torch_dist(hf, str(root / "td"))
    cfg = GrpoConfig.model_validate({"train": {"micro_batch_size": 8, "lr": 1e-2}})
    group = TrainerHandle(SubprocessGroup("runtime.trainer.megatron_trainer:MegatronTrainer", [dict(
        hf_dir=str(hf), init_checkpoint=str(root / "td"), train=cfg.train,
        algorithm=cfg.algorithm, temperature=1.0, rank=0, world_size=1, master_port=free_port(),
        num_threads=1)]))
    try:
        yield group, Path(hf)
    finally:
        group.kill()


def train_step(trainer, seed: int) -> None:
    """One optimizer step on a random batch, so the weights differ from the last sync."""
    from runtime.trainer.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, 50, (8,), generator=g).tolist() for _ in range(8)]
    trainer.train(TrainBatch(tokens, [4] * 8, torch.randn(8, generator=g).tolist(), [[1] * 4] * 8, [[-1.0] * 4] * 8))


def form_group(eng, trainer, name: str) -> list:
    """What TrainSession does for cluster.weight_sync=broadcast: rank 0 and every engine rank join."""
    host, port = trainer.weight_sync_address()
    world = 1 + eng.weight_sync_ranks()
    pending = trainer.init_weight_sync(host, port, world, name)
    eng.init_weight_sync(host, port, 1, world, name)
    pending.get()
    return trainer.weights_metadata()


def push(eng, trainer, metadata, version: int) -> None:
    pending = trainer.broadcast_weights()  # rank 0 sends while the engines receive
    try:
        eng.receive_weights(metadata, version)
    finally:
        pending.get()


def sha256(t: torch.Tensor) -> str:
    import hashlib
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def served_weights(eng) -> list[dict]:
    return [httpx.get(url + "/_weights", trust_env=False, timeout=60).json() for url in eng.urls]


def assert_serves_trainer_weights(eng, trainer, version: int) -> None:
    hf = trainer.hf_weights()
    want = {k: [str(t.dtype).removeprefix("torch."), list(t.shape), sha256(t)] for k, t in hf.items()}
    assert want.pop("lm_head.weight") == want["model.embed_tokens.weight"]  # tied: sglang skips lm_head
    for served in served_weights(eng):
        assert served["weights"] == want and served["weight_version"] == str(version)
    assert eng.weight_version == version and eng.health()["ok"]


@pytest.mark.race
@pytest.mark.timeout(150)  # includes building the module's trainer
def test_broadcast_from_a_megatron_trainer_and_a_restart(start, trainer):
    from runtime.placement.groups import LocalGroup
    from runtime.placement.handles import EngineHandle
    from runtime.placement.weight_sync import TrainerToEngine
    group, hf = trainer
    eng = start("--weight-sync-timeout-s", "30", model=hf, num_engines=2, sync_backend="gloo")
    assert eng.weight_sync_ranks() == 2 and not eng.weight_sync_ready()
    with pytest.raises(SGLangError, match="no weight-sync group"):
        eng.receive_weights([], 1)  # refused before anything is sent
    with pytest.raises(ConfigError, match="no room"):
        eng.init_weight_sync("127.0.0.1", 1, 1, 2, "too-small")
    requests = make_requests(3, 2)
    before = eng.generate(requests, SAMPLING)
    train_step(group, seed=1)

    link = TrainerToEngine(group, EngineHandle(LocalGroup([eng])), "broadcast", transport="as_is", group_name="gf_bcast_a")
    assert eng.weight_sync_ready()
    link.push(1)
    assert_serves_trainer_weights(eng, group, 1)
    expected = eng.generate(requests, SAMPLING)
    assert [r.response_logprobs for r in expected] != [r.response_logprobs for r in before]

    calls = read_calls(start.calls_file)
    joins = sorted((c["body"] for c in calls if c["path"] == "/init_weights_update_group"), key=lambda b: b["rank_offset"])
    host, port = joins[0]["master_address"], joins[0]["master_port"]
    assert joins == [{"master_address": host, "master_port": port, "rank_offset": r, "world_size": 3,
                      "group_name": "gf_bcast_a", "backend": "gloo"} for r in (1, 2)]
    sent = [c["body"] for c in calls if c["path"] == "/update_weights_from_distributed"]
    assert len(sent) == 2 and sent[0] == sent[1]
    assert sent[0]["names"] == [n for n, _, _ in link.metadata] and "lm_head.weight" in sent[0]["names"]
    assert (sent[0]["group_name"], sent[0]["weight_version"], sent[0]["flush_cache"]) == ("gf_bcast_a", "1", True)
    assert set(sent[0]["dtypes"]) == {"float32"} and sent[0]["shapes"][0] == list(link.metadata[0][2])

    # a restart: version 1 exists only in the engines, so the restarted one comes back stale and gets
    # no requests; the other serves on (same weights, same seeds: the same samples). Engine 0 is dead
    # before the generate starts, and that generate's first request goes to it (least busy, lowest index).
    victim = eng.pids[0]
    os.kill(victim, signal.SIGKILL)
    assert as_tuples(eng.generate(requests, SAMPLING)) == as_tuples(expected)
    assert not eng.weight_sync_ready()  # (waits for the restart under way)
    h = eng.health()
    assert [e["state"] for e in h["engines"]] == ["stale", "ready"] and h["engines"][0]["restarts"] == 1
    assert "broadcast" in h["engines"][0]["last_fault"] and not alive(victim)
    with pytest.raises(SGLangError, match="engine 0 restarted since it joined"):
        eng.receive_weights(link.metadata, 2)  # refused at once: no collective is started
    # forming the group again takes the restarted engine in; the next broadcast re-syncs it
    metadata = form_group(eng, group, "gf_bcast_b")
    train_step(group, seed=2)
    push(eng, group, metadata, 2)
    assert_serves_trainer_weights(eng, group, 2)
    left = [c for c in read_calls(start.calls_file) if c["path"] == "/destroy_weights_update_group"]
    assert [(c["pid"], c["body"]["group_name"]) for c in left] == [(eng.pids[1], "gf_bcast_a")]  # the survivor left


@pytest.mark.race
@pytest.mark.timeout(150)  # includes building the module's trainer
def test_failed_broadcast_is_an_error_not_a_hang(start, trainer):
    group, hf = trainer
    eng = start("--weight-sync-timeout-s", "30", model=hf, sync_backend="gloo")
    metadata = form_group(eng, group, "gf_bcast_bad")
    bad = [("model.layers.0.mlp.not_there.weight" if i == 3 else n, d, s) for i, (n, d, s) in enumerate(metadata)]
    # not a hang: every tensor is received (the trainer finishes), then the name fails - well before the
    # group's 30 s timeout, which would fail with another message
    with pytest.raises(SGLangError, match=r"not_there.*not in the model.*discard the whole weights"):
        push(eng, group, bad, 1)
    assert eng.weight_version == 0 and not eng.weight_sync_ready()
    assert [e["state"] for e in eng.health()["engines"]] == ["stale"]  # maybe partly updated: serves nothing
    with pytest.raises(TransientError, match="no SGLang engine serves"):
        eng.generate(make_requests(1, 1), SAMPLING)
    with pytest.raises(SGLangError, match="broken"):
        eng.receive_weights(metadata, 1)  # refused at once: no collective is started
    # update_weights (disk) brings every engine, stale ones too, to the trainer's weights
    train_step(group, seed=3)
    eng.update_weights(group.hf_weights(), 1)
    assert_serves_trainer_weights(eng, group, 1)
    assert eng.generate(make_requests(1, 1), SAMPLING)
    # and a new group carries broadcasts again
    metadata = form_group(eng, group, "gf_bcast_good")
    train_step(group, seed=4)
    push(eng, group, metadata, 2)
    assert_serves_trainer_weights(eng, group, 2)
    left = [c["body"] for c in read_calls(start.calls_file) if c["path"] == "/destroy_weights_update_group"]
    assert left == [{"group_name": "gf_bcast_bad"}]


# ---- faults ---------------------------------------------------------------------------------------


@pytest.mark.race
def test_killed_engine_is_restarted_and_resynced(start, tmp_path):
    eng = start(num_engines=2, concurrency=2)  # (the held requests fail by the kill, long before their timeout)
    eng.update_weights({"w": torch.randn(6)}, 1)
    requests = make_requests(6, 3)
    expected = eng.generate(requests, SAMPLING)
    victim = eng.pids[0]
    received = tmp_path / "engine-0-holds-a-request"
    stall(eng, 0, received)
    out: dict = {}
    worker = threading.Thread(target=lambda: out.setdefault("results", eng.generate(requests, SAMPLING)))
    worker.start()
    wait_for(received.exists, "engine 0 to hold a rollout request")
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)  # with requests in flight on it
    worker.join(timeout=30)
    assert as_tuples(out["results"]) == as_tuples(expected)  # nothing lost, same samples (same seeds)
    # the retried requests may all have gone to engine 1: wait for engine 0's restart to end
    wait_for(lambda: eng.health()["engines"][0]["state"] in ("ready", "stale", "dead"), "engine 0's restart to end")
    h = eng.health()
    assert h["ok"] and h["engines"][0]["restarts"] == 1 and eng.pids[0] != victim
    assert not alive(victim)
    new = [c for c in read_calls(start.calls_file) if c["pid"] == eng.pids[0]]
    work = [c for c in new if c["path"] not in ("/health", "/health_generate")]
    assert work[0]["path"] == "/update_weights_from_disk" and work[0]["body"]["weight_version"] == "1"
    assert is_probe(work[1]) and all(c["t0"] > t_kill for c in new)
    assert eng.generate(requests[:2], SAMPLING)  # and it keeps serving


@pytest.mark.race
def test_hung_engine_times_out_and_is_restarted(start):
    eng = start(request_timeout_s=3.0)
    requests = make_requests(2, 2)
    expected = eng.generate(requests, SAMPLING)
    old = eng.pids[0]
    httpx.post(eng.urls[0] + "/_hang", trust_env=False, timeout=60)
    results = eng.generate(requests, SAMPLING)
    assert as_tuples(results) == as_tuples(expected)
    h = eng.health()["engines"][0]
    assert h["restarts"] == 1 and not alive(old)
    assert "timed out after 3s" in h["last_fault"]  # found by the request timeout, not by waiting longer


@pytest.mark.race
def test_engine_gives_up_after_max_restarts(start):
    eng = start(max_restarts=0)
    os.kill(eng.pids[0], signal.SIGKILL)
    with pytest.raises(TransientError, match="every SGLang engine is down"):
        eng.generate(make_requests(1, 1), SAMPLING)
    assert not eng.health()["ok"]


# ---- a request the server refuses; SGLang 0.5.17 ----------------------------------------------------


def send_unknown_sampling_key(monkeypatch, key: str = "seed") -> None:
    """Make every /generate carry a sampling key SGLang does not know (as a client newer than its server would)."""
    made = http_protocol.sglang_sampling_params
    monkeypatch.setattr(http_protocol, "sglang_sampling_params", lambda sampling, seed: {**made(sampling, seed), key: 3})


@pytest.mark.parametrize("version,status,says", [("0.5.23", 400, "unknown field `seed`"),
                                                 ("0.5.17", 500, "unexpected keyword argument 'seed'")])
def test_rejected_request_is_one_error_not_a_restart(start, monkeypatch, version, status, says):
    """0.5.23's contract check answers an unknown sampling key with a 400; 0.5.17 has none: a TypeError, answered
    500 "Internal Server Error" by a server that stays up (its log has the exception). Either way the request is at
    fault: one line naming the endpoint, the server's words and the fix; sent once, the server not restarted."""
    eng = start("--sglang-version", version)
    pid = eng.pids[0]
    send_unknown_sampling_key(monkeypatch)
    with pytest.raises(ConfigError) as err:
        eng.generate(make_requests(1, 1), SAMPLING)
    line = str(err.value)
    assert "\n" not in line and f"rejected /generate ({status}" in line and says in line
    assert "rollout.sglang.launch runs SGLang >=0.5.17,<0.6" in line
    assert [c["status"] for c in rollout_generates(read_calls(start.calls_file))] == [status]
    h = eng.health()
    assert h["ok"] and h["engines"][0]["restarts"] == 0 and eng.pids == [pid]
    monkeypatch.undo()
    assert eng.generate(make_requests(1, 1), SAMPLING)  # and it serves on


@pytest.mark.race
def test_a_500_from_an_unhealthy_server_restarts_it(start, monkeypatch):
    """A 500 is the request's fault only when the server is healthy: one failing its check is restarted (and the
    request resent there); the restarted server, healthy, answers 500 again: then it is the one error."""
    eng = start("--sglang-version", "0.5.17")
    old = eng.pids[0]
    httpx.post(eng.urls[0] + "/_health_503", json={"n": 1000}, trust_env=False, timeout=60).raise_for_status()
    send_unknown_sampling_key(monkeypatch)
    with pytest.raises(ConfigError, match=r"rejected /generate \(500, and it stays healthy\)"):
        eng.generate(make_requests(1, 1), SAMPLING)
    h = eng.health()["engines"][0]
    assert h["restarts"] == 1 and eng.pids[0] != old and not alive(old)
    assert [c["pid"] for c in rollout_generates(read_calls(start.calls_file))] == [old, eng.pids[0]]


def test_the_client_against_sglang_0_5_17(start):
    """0.5.17's routes (no /ready, /begin_weight_update, /end_weight_update: the fixture fails on any 404): two
    servers, keyed samples, colocate release and an update from disk, log-probs."""
    eng = start("--sglang-version", "0.5.17", num_engines=2, colocate=True)
    requests = make_requests()
    first = eng.generate(requests, SAMPLING)
    assert as_tuples(eng.generate(list(reversed(requests)), SAMPLING)[::-1]) == as_tuples(first)
    eng.release_memory()
    eng.update_weights({"w": torch.randn(6)}, 1)
    after = eng.generate(requests, SAMPLING)
    assert as_tuples(after) != as_tuples(first) and eng.health()["ok"]
    r = after[0]
    assert eng.logprobs_of(r.prompt_ids, r.response_ids, SAMPLING.temperature) == pytest.approx(r.response_logprobs)
    assert {c["body"]["weight_version"] for c in read_calls(start.calls_file)
            if c["path"] == "/update_weights_from_disk"} == {"1"}


# ---- routing replay (R3): routed experts -------------------------------------------------------------

MOE = {"model_type": "qwen3_moe", "vocab_size": VOCAB, "eos_token_id": EOS, "num_hidden_layers": 3, "num_experts": 8,
       "num_experts_per_tok": 2}


@pytest.fixture
def moe_dir(tmp_path):
    d = tmp_path / "moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MOE))
    save_file({"w": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    return d


def standin_routes(eng, tokens: list[int]) -> torch.Tensor:
    """The stand-in's routes of every position of `tokens` but the last, under the weights engine 0 serves."""
    sys.path.insert(0, str(STANDIN.parent))
    try:
        from sglang_standin import FakeModel
    finally:
        sys.path.pop(0)
    model = FakeModel(eng.model_dir)
    model.digest = httpx.get(eng.urls[0] + "/_weights", trust_env=False, timeout=60).json()["digest"]
    return torch.tensor([model.route(tokens[:pos + 1]) for pos in range(len(tokens) - 1)], dtype=torch.uint8)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.17"])
def test_routing_replay_returns_the_routes_in_the_builtin_layout(start, moe_dir, version):
    """rollout.routing_replay: the servers start with --enable-return-routed-experts, each request asks for the routes
    of every input position, and they come back as SampleResult.routed_experts [prompt + response - 1, layers, k] in
    the built-in engine's dtype - the stand-in's pseudo-random routes (no router runs: layout and plumbing only). A
    continued sample keeps the routes it has and asks SGLang only from its last token on, under the new weights."""
    from runtime.trainer.batch import TrainBatch, pack
    eng = start("--sglang-version", version, model=moe_dir, routing_replay=True)
    assert "--enable-return-routed-experts" in server_command(eng.settings, eng.model_dir, eng.pool.servers[0])
    assert eng.health()["records_routes"]
    requests = make_requests(2, 2)
    results = eng.generate(requests, SAMPLING)
    for req, r in zip(requests, results):
        tokens = req.prompt_ids + r.response_ids
        assert r.routed_experts.dtype == torch.uint8 and r.routed_experts.shape == (len(tokens) - 1, 3, 2)
        assert torch.equal(r.routed_experts, standin_routes(eng, tokens))
    sent = rollout_generates(read_calls(start.calls_file))
    assert all(c["body"]["return_routed_experts"] is True and c["body"]["routed_experts_start_len"] == 0 for c in sent)
    # the trainer takes them as the built-in engine's: one route per token but the last, in the router's order
    tb = TrainBatch(tokens=[q.prompt_ids + r.response_ids for q, r in zip(requests, results)],
                    prompt_lens=[len(q.prompt_ids) for q in requests], advantages=[1.0] * 4,
                    loss_masks=[[1] * len(r.response_ids) for r in results],
                    rollout_logprobs=[r.response_logprobs for r in results], routes=[r.routed_experts for r in results])
    width = max(len(t) for t in tb.tokens)
    assert pack(tb, [0, 1, 2, 3]).routes.shape == (3, width * 4, 2)

    # continued under new weights: the prefix's routes stand, the rest are the new weights'
    eng.update_weights({"w": torch.randn(6)}, 1)
    first = results[0]
    kept = len(requests[0].prompt_ids) + 2 - 1
    carried = SampleRequest(prompt_ids=requests[0].prompt_ids, key=requests[0].key, prefix_ids=first.response_ids[:2],
                            prefix_logprobs=first.response_logprobs[:2], prefix_routes=first.routed_experts)
    before = len(rollout_generates(read_calls(start.calls_file)))
    (out,) = eng.generate([carried], replace(SAMPLING, stop_token_ids=[]))
    (body,) = [c["body"] for c in rollout_generates(read_calls(start.calls_file))[before:]]
    assert body["routed_experts_start_len"] == kept
    tokens = carried.prompt_ids + out.response_ids
    assert out.routed_experts.shape == (len(tokens) - 1, 3, 2) and len(out.response_ids) > 2
    assert torch.equal(out.routed_experts[:kept], first.routed_experts[:kept])
    now = standin_routes(eng, tokens)
    assert torch.equal(out.routed_experts[kept:], now[kept:]) and not torch.equal(out.routed_experts[:kept], now[:kept])


def test_routing_replay_refusals_and_a_dense_model(start, model_dir, moe_dir):
    from runtime.rollout.sglang.http_protocol import Generated
    from runtime.rollout.sglang.partial import Continuation, ModelTokens
    from runtime.rollout.sglang.routes import RouteLayout
    cfg = config_from_dict({"rollout": {"engine": "sglang", "routing_replay": True}})  # no longer refused
    assert SGLangSettings.from_config(cfg).routing_replay
    settings = SGLangSettings(routing_replay=True)
    dense_cmd = server_command(settings, str(model_dir), Server(index=0, port=1, log_path=Path("x")))
    assert "--enable-return-routed-experts" not in dense_cmd and RouteLayout.read(str(model_dir)) is None
    # transformers 5 saves a Qwen3-MoE's expert count as num_local_experts
    (moe_dir / "config.json").write_text(json.dumps({**{k: v for k, v in MOE.items() if k != "num_experts"},
                                                    "num_local_experts": 8}))
    # an answer without routes (a server without the flag, a release that drops them) is one clear error
    layout = RouteLayout.read(str(moe_dir))
    assert (layout.layers, layout.topk, layout.experts, layout.dtype) == (3, 2, 8, torch.uint8)
    plan = Continuation.of(SampleRequest(prompt_ids=[10, 20], key=(1, 0, 0, 0)), SAMPLING, ModelTokens.read(str(moe_dir)),
                           layout)
    with pytest.raises(SGLangError, match="--enable-return-routed-experts"):
        plan.result(Generated(ids=[7], logprobs=[-1.0], text="", finish="length"))
    with pytest.raises(SGLangError, match="expected 2 positions x 3 layers x 2"):
        plan.result(Generated(ids=[7], logprobs=[-1.0], text="", finish="length", routed_experts="AAAAAA=="))
    # the client passes the flag itself (launch may not repeat it), and never for a dense model: SGLang's capturer
    # reads num_experts_per_tok from the config, and the stand-in fails start-up there too
    with pytest.raises(ConfigError, match="--enable-return-routed-experts"):
        config_from_dict({"rollout": {"sglang": {"launch": ["{python}", "x", "--enable-return-routed-experts"]}}})
    dense = subprocess.run([sys.executable, str(STANDIN), "--model-path", str(model_dir), "--port", "0",
                            "--enable-return-routed-experts"], capture_output=True, text=True, timeout=60)
    assert dense.returncode == 1 and "num_experts_per_tok" in dense.stderr


# ---- start-up and shutdown ------------------------------------------------------------------------


def test_bad_model_path_surfaces_the_server_error(start, tmp_path):
    # the exit is seen (ModelError), not waited out (start-up timeout: a TransientError)
    with pytest.raises(ModelError, match=r"exited with code 1 during start-up.*can't load the configuration") as err:
        start(model=tmp_path / "no-such-model")
    assert "\n" not in str(err.value)


@pytest.mark.race
def test_startup_timeout_kills_the_server(start, tmp_path):
    with pytest.raises(TransientError, match="not healthy within 1s"):
        start("--startup-delay", "30", startup_timeout_s=1.0)
    logs = list((tmp_path / "scratch").glob("*/logs/engine-0.log"))
    # the client logs the pid it launched (the server may not have printed anything within 1 s)
    pid = int(re.search(r"engine 0 is pid (\d+)", logs[0].read_text()).group(1))
    assert not alive(pid)


@pytest.mark.race
def test_health_wait_rides_out_503_and_shutdown_kills_every_pid(start):
    eng = start("--health-503-count", "3", num_engines=2)
    pids = eng.pids
    assert all(alive(p) for p in pids) and eng.health()["ok"]
    health = [(c["pid"], c["status"]) for c in read_calls(start.calls_file) if c["path"] == "/health_generate"]
    for pid in pids:  # three 503s, then the 200 the client waited for
        assert [st for p, st in health if p == pid][:4] == [503, 503, 503, 200]
    eng.shutdown()
    eng.shutdown()  # twice is fine
    assert not any(alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(make_requests(1, 1), SAMPLING)


LAUNCHER = """
import json, sys
from runtime.config import SGLangSection
from runtime.rollout.sglang import SGLangEngine, SGLangSettings
standin, model, scratch = sys.argv[1:4]
settings = SGLangSettings(section=SGLangSection(launch=["{python}", standin], num_engines=2, scratch_dir=scratch,
                                                startup_timeout_s=120.0))
engine = SGLangEngine(settings, model)  # its servers launched from its client thread, as in a run
print(json.dumps(engine.pids), flush=True)
sys.stdin.read()  # until the test kills this process: no shutdown, no cleanup of ours
"""


def test_servers_die_with_the_process_whose_engine_launched_them(tmp_path, model_dir):
    """A SIGKILLed driver runs no cleanup; the SGLang servers its engine launched (each a session of its own)
    must not live on holding the GPU the resumed run needs."""
    import select
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(STANDIN), str(model_dir), str(tmp_path / "s")],
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    pids = json.loads(launcher.stdout.readline())
    servers = [os.pidfd_open(pid) for pid in pids]  # readable once ended
    try:
        assert len(servers) == 2 and select.select(servers, [], [], 0)[0] == []
        launcher.kill()
        launcher.wait()
        waiting = list(servers)
        while waiting and (ready := select.select(waiting, [], [], 60)[0]):
            waiting = [fd for fd in waiting if fd not in ready]
        assert not waiting  # each ended by the kernel's signal, not by a cleanup of ours
    finally:
        launcher.kill()
        for pid, fd in zip(pids, servers):
            if not select.select([fd], [], [], 0)[0]:  # still running (the test failed): nothing outlives it
                os.killpg(pid, signal.SIGKILL)
            os.close(fd)


def test_missing_sglang_names_the_install_command(tmp_path, model_dir):
    if __import__("importlib").util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    from runtime.rollout.factory import make_engine
    scratch = tmp_path / "scratch"
    cfg = config_from_dict({"rollout": {"engine": "sglang", "sglang": {"scratch_dir": str(scratch)}}})
    with pytest.raises(ConfigError) as err:
        make_engine(cfg=cfg, model_dir=str(model_dir), device="cpu", dtype="float32")
    assert INSTALL_HINT in str(err.value) and "\n" not in str(err.value)
    assert not scratch.exists()  # failed before launching or writing anything


def test_launch_command_may_not_repeat_managed_flags():
    # refused by the config (so by `grpoflow validate`), before any engine is built
    with pytest.raises(ConfigError, match="--port"):
        config_from_dict({"rollout": {"sglang": {"launch": [sys.executable, "-m", "x", "--port", "1"]}}})


@pytest.mark.race
def test_shutdown_during_generate_does_not_hang(start, tmp_path):
    eng = start()
    pid = eng.pids[0]
    received = tmp_path / "engine-0-holds-a-request"
    stall(eng, 0, received)  # the generate below cannot finish: shutdown must end it
    out: dict = {}

    def run():
        try:
            eng.generate(make_requests(2, 2), SAMPLING)
        except BaseException as exc:  # CancelledError or the engine's error: anything but a hang
            out["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(received.exists, "engine 0 to hold a rollout request")
    eng.shutdown()
    worker.join(timeout=10)
    assert not worker.is_alive() and "error" in out
    assert not alive(pid)


def test_settings_come_from_the_config():
    cfg = config_from_dict({"rollout": {"engine": "sglang", "sglang": {
        "num_engines": 2, "tp_size": 4, "concurrency": 16, "port": 31000, "weight_sync": "tensor",
        "deterministic": False, "launch": ["{python}", "-m", "sglang.launch_server", "--attention-backend", "fa3"]}},
        "cluster": {"colocate": False, "device": "cpu"}, "train": {"seed": 99}})
    s = SGLangSettings.from_config(cfg, Supervision(kill_grace_s=1.0))
    assert s.section is cfg.rollout.sglang  # the section itself, not a copy with defaults of its own
    sec = s.section
    assert (sec.num_engines, sec.tp_size, sec.concurrency, sec.port, sec.weight_sync, sec.deterministic) == (2, 4, 16, 31000, "tensor", False)
    assert (s.colocate, s.random_seed, s.supervision.kill_grace_s, sec.mem_fraction) == (False, 99, 1.0, 0.7)
    assert s.sync_backend == "gloo"  # the trainer's: gloo on CPU, nccl on CUDA
    assert s.launch_prefix() == [sys.executable, "-m", "sglang.launch_server", "--attention-backend", "fa3"]
    assert s.uses_real_sglang()
    with pytest.raises(ConfigError):
        config_from_dict({"rollout": {"sglang": {"weight_sync": "nccl"}}})


def test_sglang_section_rejects_unknown_keys_and_reads_moved_ones():
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.sglang.num_engine'; known keys here: .*num_engines"):
        config_from_dict({"rollout": {"sglang": {"num_engine": 2}}})
    # the flat keys of before are read into the section (old runs' frozen configs resume)
    assert config_from_dict({"rollout": {"engine": "sglang", "sglang_tp_size": 2}}).rollout.sglang.tp_size == 2
    with pytest.raises(ConfigError, match=r"sglang_tp_size and sglang.tp_size are both set"):
        config_from_dict({"rollout": {"engine": "sglang", "sglang_tp_size": 2, "sglang": {"tp_size": 2}}})
    with pytest.raises(ConfigError, match=r"rollout.sglang: port=65530: .*engine 1's port 65540"):
        config_from_dict({"rollout": {"sglang": {"port": 65530, "num_engines": 2}}})


# ---- partial rollout ------------------------------------------------------------------------------
# Against the stand-in's event-driven controls, never timing: `--gate 6` holds every answer until all 6
# requests of a rollout are in flight; `--hold-rids` makes the samples of one prompt stop after exactly
# HELD_AFTER tokens and wait for /abort_request. 3 groups of 2 generate, 2 are needed: the held one is cut.

PARTIAL_SEED, HELD_AFTER = 7, 2
HOLD_PROMPT_2 = r"^gf-\d+-0-2-"  # rollout 0's prompt 2, both samples (rid = gf-seed-rollout-prompt-sample-...)


class IdTokenizer:
    """Prompts are token ids separated by spaces; responses decode as the stand-in writes them."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids)


def partial_collector(eng):
    """The pipeline's Collector on `eng` with rollout.partial, scoring inline (the reward's worker processes
    cost seconds and say nothing here)."""
    from runtime.grpo.collect import Collector
    from runtime.inputs.datasets import PromptDataset

    class InlineScoring(Collector):
        def score(self, groups):
            for g in groups:
                g.rewards = [float(len(s.response_ids) % 2) for s in g.samples]
            return 0

    cfg = config_from_dict({"rollout": {"engine": "sglang", "partial": True, "rollout_batch_size": 2,
                                        "n_samples_per_prompt": 2, "over_sampling_factor": 1.5, "max_new_tokens": 6,
                                        "temperature": 0.8, "top_p": 0.9, "top_k": 20},
                            "algorithm": {"use_tis": True},
                            "train": {"seed": PARTIAL_SEED, "global_batch_size": 4, "micro_batch_size": 4}})
    rows = [{"prompt": f"{10 + i} {20 + i} {30 + i}", "label": "1", "metadata": {}} for i in range(8)]
    return InlineScoring(cfg, eng, PromptDataset(rows, shuffle=False), IdTokenizer(), reward_fn=None), cfg


def control(eng, path: str, body: dict) -> None:
    httpx.post(eng.urls[0] + path, json=body, trust_env=False, timeout=60).raise_for_status()


def first_partial_rollout(start):
    """Rollout 0 on a fresh stand-in: prompts 0 and 1 complete, prompt 2 held after HELD_AFTER tokens, aborted."""
    from runtime.grpo.partial import collect_partial
    from runtime.inputs.datasets import PromptDataset
    eng = start("--gate", "6", "--hold-rids", HOLD_PROMPT_2, "--hold-after", str(HELD_AFTER))
    collector, _ = partial_collector(eng)
    return eng, collector, collect_partial(collector, 0, PromptDataset.initial_cursor(PARTIAL_SEED), None)


def test_partial_rollout_stops_at_enough_groups_and_buffers_the_aborted(start):
    eng, _, p = first_partial_rollout(start)
    assert [g.prompt["prompt"] for g in p.groups] == ["10 20 30", "11 21 31"]  # the 2 complete groups are trained
    assert all(s.finish_reason in ("stop", "length") for g in p.groups for s in g.samples)
    (buffered,) = p.state["buffer"]  # the third group, cut: its samples with their tokens so far
    assert buffered["prompt"]["prompt_ids"] == [12, 22, 32]
    assert buffered["keys"] == [[PARTIAL_SEED, 0, 2, 0], [PARTIAL_SEED, 0, 2, 1]]
    for s in buffered["samples"]:
        assert s["finish"] == "abort" and len(s["ids"]) == HELD_AFTER and s["versions"] == [[0, HELD_AFTER]]
        # the log-probs SGLang returned with the cut tokens are kept, and are the model's
        assert s["logprobs"] == pytest.approx(eng.logprobs_of([12, 22, 32], s["ids"], temperature=0.8), abs=1e-9)
    assert p.metrics["partial_buffered_samples"] == 2 and p.metrics["partial_prompts_trained"] == 2

    calls = read_calls(start.calls_file)
    generates = rollout_generates(calls)
    held = [c for c in generates if re.search(HOLD_PROMPT_2, c["body"]["rid"])]
    assert len(generates) == 6 and len(held) == 2
    aborts = [c for c in calls if c["path"] == "/abort_request"]
    # exactly the two running requests were aborted, by rid, after every answer of the complete groups
    assert sorted(c["body"]["rid"] for c in aborts) == sorted(c["body"]["rid"] for c in held)
    assert all(c["body"] == {"rid": c["body"]["rid"]} and c["status"] == 200 for c in aborts)
    assert min(a["n0"] for a in aborts) > max(c["n1"] for c in generates if c not in held)
    aborted_at = {a["body"]["rid"]: a["n0"] for a in aborts}
    assert all(c["n1"] > aborted_at[c["body"]["rid"]] for c in held)  # each answered once aborted


def test_partial_rollout_continues_a_buffered_sample_under_new_weights(start):
    from runtime.grpo.partial import collect_partial
    eng, collector, first = first_partial_rollout(start)
    prefixes = [s["ids"] for s in first.state["buffer"][0]["samples"]]
    old_logprobs = [s["logprobs"] for s in first.state["buffer"][0]["samples"]]
    control(eng, "/_hold", {"rids": None})  # nothing held now; the gate again waits for the rollout's 6 requests
    control(eng, "/_gate", {"n": 6})
    eng.update_weights({"w": torch.randn(6, generator=torch.Generator().manual_seed(3))}, 1)
    sent_before = len(read_calls(start.calls_file))

    p = collect_partial(collector, 1, first.cursor, first.state)
    # the carried group goes first and is trained; the new prompts (keys of rollout 1) follow
    carried, trained = p.trained_pending[0], p.groups[0]
    assert carried.keys == [[PARTIAL_SEED, 0, 2, 0], [PARTIAL_SEED, 0, 2, 1]]
    sent = rollout_generates(read_calls(start.calls_file)[sent_before:])
    continued = {c["body"]["rid"].split("-")[4]: c["body"] for c in sent if re.search(HOLD_PROMPT_2, c["body"]["rid"])}
    for j, (sample, state, prefix, old) in enumerate(zip(trained.samples, carried.samples, prefixes, old_logprobs)):
        # the request: prompt + tokens so far as input_ids, max_new_tokens cut by the tokens it has
        body = continued[str(j)]
        assert body["input_ids"] == [12, 22, 32] + prefix
        assert body["sampling_params"]["max_new_tokens"] == 6 - HELD_AFTER
        # the trained sample: the tokens so far (and their log-probs from weight version 0), then the
        # continuation under version 1, each run of tokens with its version
        tail = sample.response_ids[HELD_AFTER:]
        assert sample.response_ids[:HELD_AFTER] == prefix and tail and sample.finish_reason in ("stop", "length")
        assert sample.response_logprobs[:HELD_AFTER] == old
        assert state.versions == [[0, HELD_AFTER], [1, len(tail)]]
        now = eng.logprobs_of([12, 22, 32], sample.response_ids, temperature=0.8)
        assert sample.response_logprobs[HELD_AFTER:] == pytest.approx(now[HELD_AFTER:], abs=1e-9)
        assert old != pytest.approx(now[:HELD_AFTER], abs=1e-6)  # the weights did change under the sample
    assert len(sent) == 6  # the carried group's 2 and the new prompts' 4: nothing re-sent
    assert p.metrics["partial_tokens_reused"] == 2 * HELD_AFTER


def test_partial_buffer_survives_a_checkpoint_and_a_new_engine(start, tmp_path):
    """The buffer is run state: written in the checkpoint's trainer_state.json as TrainSession writes it, read
    back, and continued by a new engine (new server processes) exactly from the tokens it holds. SGLang
    promises no bitwise resume (where a rollout stops depends on timing), so nothing more is compared."""
    from runtime.grpo.partial import collect_partial
    from runtime.run import checkpoint
    from runtime.run.directory import RunDir
    eng, _, first = first_partial_rollout(start)
    rd = RunDir(str(tmp_path / "root"), "sglang-partial")
    state = {"cursor": first.cursor, "metrics": [], "partial": first.state}
    checkpoint.save(rd, 1, lambda path: (Path(path).mkdir(parents=True), (Path(path) / "weights").write_text("x")),
                    state, keep_last=1)
    eng.shutdown()

    ck = checkpoint.latest(rd)
    assert ck.rollout == 1 and ck.state["partial"] == first.state and ck.state["cursor"] == first.cursor
    again = start("--gate", "6")  # a fresh server, nothing held
    collector, _ = partial_collector(again)
    sent_before = len(read_calls(start.calls_file))
    p = collect_partial(collector, 1, ck.state["cursor"], ck.state["partial"])
    buffered = ck.state["partial"]["buffer"][0]
    resumed = [c["body"] for c in rollout_generates(read_calls(start.calls_file)[sent_before:])
               if re.search(HOLD_PROMPT_2, c["body"]["rid"])]
    assert sorted(b["input_ids"] for b in resumed) == sorted([12, 22, 32] + s["ids"] for s in buffered["samples"])
    assert p.trained_pending[0].keys == buffered["keys"]
    assert [s.response_ids[:HELD_AFTER] for s in p.groups[0].samples] == [s["ids"] for s in buffered["samples"]]
    assert p.metrics["partial_prompts_drawn"] == 3 + 2  # counts carried over from the checkpoint too


def test_carried_samples_that_are_finished_are_not_sent(start, tmp_path):
    """A carried sample whose tokens so far end in the model's eos (config.json) or a stop token, or fill
    max_new_tokens, is finished: it comes back as it is, and only the others reach SGLang."""
    from runtime.rollout.base import GroupsDone
    eng = start()
    lp = [-1.0, -1.0]
    requests = [SampleRequest(prompt_ids=[10, 20], key=(1, 0, 0, 0), prefix_ids=[7, EOS], prefix_logprobs=lp),
                SampleRequest(prompt_ids=[10, 20], key=(1, 0, 0, 1), prefix_ids=[7, 5], prefix_logprobs=lp),
                SampleRequest(prompt_ids=[10, 20], key=(1, 0, 0, 2), prefix_ids=[7] * 6, prefix_logprobs=[-1.0] * 6),
                SampleRequest(prompt_ids=[10, 20], key=(1, 0, 0, 3), prefix_ids=[7, 8], prefix_logprobs=lp)]
    out = eng.generate(requests, SAMPLING)
    assert [r.finish_reason for r in out[:3]] == ["stop", "stop", "length"]
    assert [r.response_ids for r in out[:3]] == [[7, EOS], [7, 5], [7] * 6]
    assert out[3].response_ids[:2] == [7, 8] and out[3].response_logprobs[:2] == lp
    (sent,) = rollout_generates(read_calls(start.calls_file))
    assert sent["body"]["input_ids"] == [10, 20, 7, 8] and sent["body"]["sampling_params"]["max_new_tokens"] == 4
    # enough groups complete before anything is sent (0 needed): nothing is sent, everything comes back as given
    cut = eng.generate(requests[3:], SAMPLING, GroupsDone(group_size=1, count=0))
    assert (cut[0].response_ids, cut[0].finish_reason) == ([7, 8], "abort")
    assert len(rollout_generates(read_calls(start.calls_file))) == 1
    # a model that names no eos cannot tell a finished carried sample from a cut one: refused, not guessed
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": VOCAB}))
    with pytest.raises(ModelError, match="eos token ids"):
        start(model=bare).generate(requests[3:], SAMPLING)
