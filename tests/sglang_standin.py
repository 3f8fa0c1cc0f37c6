"""A stand-in for SGLang's HTTP server, for testing `runtime/rollout/sglang/` where SGLang cannot run.

It is NOT SGLang and runs no model. It speaks the subset of SGLang's native HTTP API that the
client uses, with the request and response shapes read from SGLang 0.5.23 (the PyPI wheel):

  python/sglang/srt/entrypoints/http_server.py   the routes, status codes and error bodies
  python/sglang/srt/managers/io_struct.py        GenerateReqInput, UpdateWeightFromDiskReqInput,
                                                 UpdateWeightsFromTensorReqInput,
                                                 UpdateWeightsFromDistributedReqInput,
                                                 InitWeightsUpdateGroupReqInput,
                                                 Release/ResumeMemoryOccupationReqInput
  python/sglang/api/v1/api_types.py              GenerateRequest / SamplingParams (unknown
                                                 sampling keys are a 400), GenerateMetaInfo,
                                                 LogprobEntry = [logprob, token_id, text]
  python/sglang/srt/managers/schedule_batch.py   finish_reason dicts: {"type": "stop", "matched"},
                                                 {"type": "length", "length"}, {"type": "abort", ...}
  python/sglang/srt/managers/tokenizer_manager.py  POST /abort_request (AbortReq: rid, abort_all) answers
                                                 200 with an empty body, a no-op for an unknown or
                                                 finished rid; the aborted /generate answers 200 with
                                                 finish_reason type "abort" and the tokens made so far
  python/sglang/srt/layers/sampler.py            sampling_seed is honoured only with
                                                 --enable-deterministic-inference; log-probs are
                                                 of softmax(logits / temperature)

`--sglang-version 0.5.17` speaks as SGLang 0.5.17 instead (read from its source, python/sglang/srt/entrypoints/
http_server.py and srt/managers/tokenizer_manager.py, and run on an H200 by bench/sglang_real.py): no `/generate`
contract check - the tokenizer manager builds `SamplingParams(**sampling_params)`, so an unknown key is a
TypeError nothing catches: FastAPI answers 500 "Internal Server Error" (text) and the traceback goes to the log,
the server staying up, but not that connection: uvicorn closes it after the exception, and a request the client
sent on it meanwhile is never answered (here: always; seen on an H200, where it restarted the server for every
check sent that way). `/get_weight_version` is there, 0.5.23's `/ready` is not. `sampling_seed` is honoured
only with --enable-deterministic-inference in both.

Its "model" is a hash: the logits at a position are a pseudo-random function of a digest of the
loaded weights and the last few tokens, so outputs are deterministic given the weights, the prompt
and `sampling_seed`, and they change when new weights are loaded. The weights it holds are a table
name -> (dtype, shape, sha256 of the tensor's bytes), filled from the model dir's *.safetensors
(read with the stdlib) and updated by name as SGLang's `load_weights` does: from disk, or from a
real torch.distributed broadcast (/init_weights_update_group + /update_weights_from_distributed,
gloo on CPU; torch is imported only then). The same tensors give the same digest whichever way they
came, so a restarted engine re-synced from disk serves what its peers got by broadcast.
Test-only extras:
  GET  /_calls   every call so far: path, body, status, wall-clock start/end (t0, t1), their order
                 in this process (n0, n1: a counter, so order needs no clock), pid; max in-flight
  GET  /_weights the weight table, its digest and the weight version
  POST /_hang    from now on answer nothing (a server that stops answering)
  POST /_health_503 {"n": N}   answer the next N health checks with 503 (a server up but not healthy)
  --sglang-version 0.5.23|0.5.17   the release it speaks as (above)
  POST /_stall_generate {"marker": PATH}   from now on hold every rollout /generate (not the
                 client's log-prob probes) without answering, after creating PATH: a test waits for
                 PATH to know a request is in flight here, then kills or shuts down (no sleeps)
  --calls-file   also append each call as a JSON line there (survives the process being killed)
  --startup-delay S   sleep S seconds before binding the port (like SGLang loading a model)
  --health-503-count N   answer the first N health checks with 503 (like SGLang still warming up)
  --gen-jitter S                   each /generate sleeps up to S pseudo-random seconds (answers out of order)
  --ignore-weight-updates          update calls succeed but the weights do not change
  --gate N       hold every rollout /generate's answer until N rollout /generate requests, counted since
                 the gate was armed, have their answer computed or are held (--hold-rids): all of a call's
                 requests are in flight, and all but the held ones finished, before any answer goes out,
                 whatever the order they were sent in. POST /_gate {"n": N} re-arms it (0: open)
  --hold-rids REGEX --hold-after K   a rollout /generate whose rid matches REGEX stops after exactly K new
                 tokens (unless it finished before) and waits until /abort_request names it, then answers
                 with those K tokens and finish_reason abort. POST /_hold {"rids": REGEX|null, "after": K}
                 changes the rule. (Other requests honour an abort between tokens, as SGLang does; they
                 are computed at once, so in tests an abort finds them finished: a no-op.)
  --weight-sync-timeout-s S        the weight-sync group's timeout (joining, each broadcast)
  --enable-return-routed-experts   as SGLang's flag: a /generate with `return_routed_experts` gets
                 meta_info.routed_experts (base64 of int32 [positions, layers, k] for the input positions from
                 `routed_experts_start_len` on) for a mixture-of-experts config (num_experts, num_experts_per_tok;
                 without them the flag fails start-up). No router runs: a route is a pseudo-random function of the
                 weights' digest and the last few tokens, so only the layout and the plumbing are tested. Read from
                 0.5.17's source (runtime/rollout/sglang/routes.py); the 0.5.23 mode answers the same, an assumption
Stdlib only until a weight-sync group is joined, so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
import json
import math
import os
import random
import re
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# sglang/api/v1/api_types.py SamplingParams: the keys /generate accepts (unknown ones are a 400).
SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
CONTEXT_TOKENS = 3  # the fake model looks at this many previous tokens
# routes one of the two SGLang releases has and the other lacks (404 in the other's mode)
ONLY_IN = {"0.5.17": ("/get_weight_version",), "0.5.23": ("/ready", "/begin_weight_update", "/end_weight_update")}


# safetensors dtype codes -> torch dtype names (what /update_weights_from_distributed's `dtypes` use)
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_safetensors(path: str) -> dict[str, tuple[str, list[int], str]]:
    """name -> (dtype, shape, sha256 of the raw little-endian bytes) for one .safetensors file."""
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            f.seek(base + start)
            dtype = SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"].lower())
            out[name] = (dtype, [int(x) for x in info["shape"]], hashlib.sha256(f.read(end - start)).hexdigest())
    return out


def read_weight_files(model_path: str) -> dict[str, tuple[str, list[int], str]]:
    """The weight table of every *.safetensors in a model directory (FileNotFoundError: none there)."""
    names = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    table = {}
    for name in names:
        table.update(read_safetensors(os.path.join(model_path, name)))
    return table


def _u64(*parts) -> int:
    data = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class FakeModel:
    def __init__(self, model_path: str):
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
        self.vocab_size = int(config.get("vocab_size", 64))
        # a mixture of experts (routed experts are returned for it): its layers, experts and experts per token
        self.layers = int(config.get("num_hidden_layers", 1))
        self.num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        self.topk = int(config.get("num_experts_per_tok") or 0)
        eos = config.get("eos_token_id", 0)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        # sglang's Qwen/Llama load_weights skip lm_head.weight when the embeddings are tied
        self.tied = bool(config.get("tie_word_embeddings", False))
        try:
            self.weights = read_weight_files(model_path)
        except FileNotFoundError:  # a config-only model dir: its "weights" are the config
            with open(os.path.join(model_path, "config.json"), "rb") as f:
                self.weights = {"config.json": ("bytes", [], hashlib.sha256(f.read()).hexdigest())}
        self.digest = self._digest()

    def skips(self, name: str) -> bool:
        return self.tied and name == "lm_head.weight"

    def load(self, table: dict[str, tuple[str, list[int], str]]) -> None:
        """Update the named weights (the others stay), as a model's load_weights does."""
        self.weights.update({k: v for k, v in table.items() if not self.skips(k)})
        self.digest = self._digest()

    def lose(self) -> None:
        """Released weights resumed: the memory saver keeps no copy (no --enable-weights-cpu-backup), so the
        weights are whatever was left in that memory until loaded again."""
        self.digest = hashlib.sha256(b"uninitialised memory: " + self.digest.encode()).hexdigest()

    def _digest(self) -> str:
        return hashlib.sha256(json.dumps(sorted(self.weights.items())).encode()).hexdigest()

    def route(self, context: list[int]) -> list[list[int]]:
        """The experts [layers][k] the last token of `context` goes to: a pseudo-random function of the weights'
        digest and the last few tokens, as the logits are (no real router runs here)."""
        return [random.Random(_u64(self.digest, "route", layer, *context[-CONTEXT_TOKENS:])).sample(
            range(self.num_experts), self.topk) for layer in range(self.layers)]

    def log_softmax(self, context: list[int], temperature: float) -> list[float]:
        rng = random.Random(_u64(self.digest, *context[-CONTEXT_TOKENS:]))
        logits = [rng.gauss(0.0, 2.0) / temperature for _ in range(self.vocab_size)]
        top = max(logits)
        lse = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - lse for x in logits]


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.model = FakeModel(args.model_path)
        self.model_path = args.model_path
        self.weight_version = args.weight_version
        self.released: set[str] = set()
        self.tensor_update: tuple[str | None, str] = (None, "")  # (weight version, digest) of the last tensor update
        self.calls: list[dict] = []
        self.inflight_generate = 0
        self.max_inflight_generate = 0
        self.hung = False
        self.stall_marker: str | None = None  # /_stall_generate
        # partial rollout: rid -> its abort flag, for the /generate requests running; the gate and the hold rule
        self.cond = threading.Condition()
        self.aborts: dict[str, threading.Event] = {}
        self.gate_n, self.gate_arrived = args.gate, 0
        self.hold_rids = re.compile(args.hold_rids) if args.hold_rids else None
        self.hold_after = args.hold_after
        self.health_503_left = args.health_503_count
        self.order = itertools.count()  # n0/n1 of the calls
        self.sync_groups: dict = {}  # group_name -> torch.distributed group (weight sync)

    def arrive(self, rid: str) -> "Running":
        """A rollout /generate came in: from now on /abort_request can name it."""
        with self.cond:
            return self.aborts.setdefault(rid, Running())

    def leave(self, rid: str) -> None:
        with self.cond:
            self.aborts.pop(rid, None)

    def at_gate(self, run: "Running") -> None:
        """Count a request at the gate once: its answer is computed, or it is held waiting for its abort."""
        with self.cond:
            if not run.counted:
                run.counted = True
                self.gate_arrived += 1
                self.cond.notify_all()

    def pass_gate(self, run: "Running") -> None:
        self.at_gate(run)
        with self.cond:
            self.cond.wait_for(lambda: self.gate_arrived >= self.gate_n)

    def arm_gate(self, n: int) -> None:
        with self.cond:
            self.gate_n, self.gate_arrived = int(n), 0
            self.cond.notify_all()

    def abort(self, rid: str | None, abort_all: bool) -> None:
        with self.cond:
            for name, run in self.aborts.items():
                if abort_all or name == rid:  # an unknown or finished rid: nothing to do, as in sglang
                    run.aborted.set()

    def held(self, rid: str) -> bool:
        return self.hold_rids is not None and self.hold_rids.search(rid) is not None

    def record(self, entry: dict) -> None:
        with self.lock:
            self.calls.append(entry)
            if self.args.calls_file:
                with open(self.args.calls_file, "a") as f:
                    f.write(json.dumps(entry) + "\n")


class Running:
    """One rollout /generate in the stand-in: set by /abort_request naming its rid; counted at the gate."""

    def __init__(self):
        self.aborted = threading.Event()
        self.counted = False


def generate(state: State, body: dict, run: Running | None = None, held: bool = False) -> tuple[int, object]:
    """POST /generate for one prompt given as input_ids (what the grpoflow client sends). `run`: a rollout
    request (not a log-prob probe); `held`: the --hold-rids rule applies (stop after --hold-after tokens,
    count at the gate, wait for the abort)."""
    input_ids = body.get("input_ids")
    if not (isinstance(input_ids, list) and input_ids and all(isinstance(t, int) for t in input_ids)):
        return 400, {"error": {"message": "stand-in: /generate needs input_ids as one list of ints"}}
    sp = body.get("sampling_params") or {}
    unknown = sorted(set(sp) - set(SAMPLING_KEYS))
    if unknown and state.args.sglang_version == "0.5.17":  # no contract check: SamplingParams(**sp) raises
        print("ERROR:    Exception in ASGI application\nTraceback (most recent call last):\n"
              '  File "sglang/srt/managers/tokenizer_manager.py", in _tokenize_one_request\n'
              f"TypeError: SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'",
              file=sys.stderr, flush=True)
        return 500, "Internal Server Error"
    if unknown:  # the wording of sglang's generated contract check (serde's unknown_field)
        listed = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
        return 400, {"error": f"unknown field `{unknown[0]}`, expected one of {listed}"}
    if state.released:  # sglang would run on paused memory and answer wrong log-probs: fail loudly here
        return 400, {"error": {"message": f"stand-in: memory is released ({sorted(state.released)}); resume it first"}}
    model = state.model
    routes_from = int(body.get("routed_experts_start_len") or 0)
    if body.get("return_routed_experts") and not 0 <= routes_from <= len(input_ids):  # the scheduler aborts it: a 400
        return 400, {"error": {"message": f"recv_req.routed_experts_start_len={routes_from} is higher than the number "
                                          f"of input tokens len(req.origin_input_ids)={len(input_ids)}. Please use a "
                                          f"smaller routed_experts_start_len."}}
    if any(t < 0 or t >= model.vocab_size for t in input_ids):
        return 400, {"error": {"message": f"The input_ids {input_ids} contains values greater than the vocab size ({model.vocab_size})."}}
    max_new = sp.get("max_new_tokens", 128)
    temperature = float(sp.get("temperature", 1.0))
    top_k = int(sp.get("top_k", -1))
    top_p = float(sp.get("top_p", 1.0))
    greedy = temperature < 1e-6
    if greedy:  # sglang: temperature 0 -> temperature 1, top_k 1
        temperature, top_k = 1.0, 1
    stop_ids = set(sp.get("stop_token_ids") or []) | (set() if sp.get("ignore_eos") else model.eos_ids)
    seed = sp.get("sampling_seed")
    seeded = state.args.enable_deterministic_inference
    if seeded and seed is None:
        seed = 42  # sglang's default seed in deterministic mode (sampling_batch_info.py)
    rng = random.Random()

    def logprob_entries(start: int) -> list:
        out = []
        for pos in range(start, len(input_ids)):
            lp = None if pos == 0 else model.log_softmax(input_ids[:pos], temperature)[input_ids[pos]]
            out.append([lp, input_ids[pos], None])
        return out

    context = list(input_ids)
    output_ids, output_lps = [], []
    finish = {"type": "length", "length": max_new}
    abort_finish = {"type": "abort", "message": "stand-in: aborted by /abort_request"}
    for _ in range(max_new):
        if held and len(output_ids) == state.hold_after:
            state.at_gate(run)
            run.aborted.wait()  # it answers once aborted (the client's request timeout bounds a test's bug)
            finish = abort_finish
            break
        if run is not None and not held and run.aborted.is_set():
            finish = abort_finish
            break
        logp = model.log_softmax(context, temperature)
        order = sorted(range(len(logp)), key=lambda v: -logp[v])
        if top_k > 0:
            order = order[:top_k]
        kept, mass = [], 0.0
        for v in order:  # top-p on the sorted candidates
            kept.append(v)
            mass += math.exp(logp[v])
            if mass >= top_p:
                break
        if greedy or len(kept) == 1:
            token = kept[0]
        else:
            u = random.Random(_u64("seed", seed, len(context))).random() if seeded else rng.random()
            weights = [math.exp(logp[v]) for v in kept]
            u *= sum(weights)
            token = kept[-1]
            for v, w in zip(kept, weights):
                u -= w
                if u <= 0:
                    token = v
                    break
        output_ids.append(token)
        output_lps.append([logp[token], token, None])
        context.append(token)
        if token in stop_ids:
            finish = {"type": "stop", "matched": token}
            break
    meta = {
        "id": body.get("rid") or f"standin-{random.getrandbits(32):08x}",
        "finish_reason": finish,
        "prompt_tokens": len(input_ids),
        "weight_version": state.weight_version,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
    }
    if body.get("return_logprob"):
        start = body.get("logprob_start_len")
        start = -1 if start is None else int(start)
        meta["input_token_logprobs"] = logprob_entries(start) if start >= 0 else []
        meta["output_token_logprobs"] = output_lps
        meta["output_token_logprobs_length"] = len(output_lps)
    if body.get("return_routed_experts") and state.args.enable_return_routed_experts and output_ids:
        # every position that was an input from routed_experts_start_len on, int32 [positions, layers, k] in base64
        # (batch_result_processor._maybe_collect_routed_experts, detokenizer_manager); none for a request that
        # never ran, nor from a server without the flag
        rows = [model.route(context[:pos + 1]) for pos in range(routes_from, len(context) - 1)]
        flat = [e for row in rows for layer in row for e in layer]
        meta["routed_experts"] = base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode()
    if state.args.gen_jitter:
        time.sleep(random.Random(_u64("jitter", *input_ids, seed)).random() * state.args.gen_jitter)
    return 200, {"text": "".join(f"<{t}>" for t in output_ids), "output_ids": output_ids, "meta_info": meta}


def update_from_disk(state: State, body: dict) -> tuple[int, object]:
    path = body.get("model_path")
    if "weights" in state.released:
        return 400, {"success": False, "message": "stand-in: weights are released; resume them first", "num_paused_requests": 0}
    try:
        table = read_weight_files(path or "")
    except OSError as e:  # the wording of sglang's weight_updater.py
        return 400, {"success": False, "message": f"Failed to get weights iterator: {e}.", "num_paused_requests": 0}
    if not state.args.ignore_weight_updates:
        state.model.load(table)
        tensor_version, tensor_digest = state.tensor_update
        if tensor_version is not None and body.get("weight_version") == tensor_version:
            # the disk copy the client wrote of the tensors it sent (the stand-in does not open them): the same weights
            state.model.digest = tensor_digest
    state.model_path = path
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


def update_from_tensor(state: State, body: dict) -> tuple[int, object]:
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or len(payloads) != state.args.tp_size:
        return 400, {"success": False, "message": f"stand-in: expected one serialized payload per tp rank ({state.args.tp_size})"}
    try:
        raw = [base64.b64decode(p, validate=True) for p in payloads]
    except (TypeError, ValueError) as e:
        return 400, {"success": False, "message": f"stand-in: payload is not base64: {e}"}
    if not state.args.ignore_weight_updates:  # the tensors themselves (torch IPC handles) are not opened
        state.model.digest = hashlib.sha256(b"".join(raw)).hexdigest()
        state.tensor_update = (body.get("weight_version"), state.model.digest)
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return 200, {"success": True, "message": "Succeeded to update model weights."}


def _weight_sync():
    """runtime.placement.weight_sync (and torch), imported on first use: the stand-in otherwise runs on the stdlib."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from runtime.placement import weight_sync
    return weight_sync


def init_group(state: State, body: dict) -> tuple[int, object]:
    """POST /init_weights_update_group: join the group for real and block until every member has.

    SGLang's server joins with rank = rank_offset + tp_rank through a TCP rendezvous, a store
    prefixed by the group name and c10d's group helper (its `init_custom_process_group`).
    runtime.placement.weight_sync.init_group builds the group the same way (it is what the trainer's side
    uses), so the stand-in joins through it; it has one process, hence --tp-size 1 only."""
    try:
        address, port = str(body["master_address"]), int(body["master_port"])
        rank_offset, world_size = int(body["rank_offset"]), int(body["world_size"])
    except (KeyError, TypeError, ValueError) as e:
        return 400, {"success": False, "message": f"stand-in: bad InitWeightsUpdateGroupReqInput: {e!r}"}
    name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
    if state.args.tp_size != 1:
        return 400, {"success": False, "message": "stand-in: weight-sync groups need --tp-size 1 (one process, one rank)"}
    if name in state.sync_groups:
        return 400, {"success": False, "message": f"Failed to initialize custom process group: group {name!r} exists."}
    try:
        ws = _weight_sync()
        state.sync_groups[name] = ws.init_group(address, port, rank_offset, world_size, backend=backend,
                                                group_name=name, timeout_s=state.args.weight_sync_timeout_s)
    except Exception as e:  # noqa: BLE001 - the wording of sglang's model_runner
        return 400, {"success": False, "message": f"Failed to initialize custom process group: {e}."}
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def destroy_group(state: State, body: dict) -> tuple[int, object]:
    group = state.sync_groups.pop((body or {}).get("group_name", "weight_update_group"), None)
    if group is None:
        return 400, {"success": False, "message": "The group to be destroyed does not exist."}
    _weight_sync().destroy_group(group)
    return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def tensor_sha256(t) -> str:
    import torch
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def update_from_distributed(state: State, body: dict) -> tuple[int, object]:
    """POST /update_weights_from_distributed: receive every tensor named in the body from rank 0 of the
    group (one broadcast each, in order), then load them by name - as sglang's model runner does, so
    the broadcast completes even when a name turns out not to fit, and that is reported after."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        return 400, {"success": False, "message": "stand-in: names, dtypes and shapes must be lists of one length"}
    name = body.get("group_name", "weight_update_group")
    group = state.sync_groups.get(name)
    if group is None:
        return 400, {"success": False, "message": f"Group {name} not in {sorted(state.sync_groups)}. "
                                                  f"Please call `init_weights_update_group` first."}
    if "weights" in state.released:
        return 400, {"success": False, "message": "stand-in: weights are released; resume them first"}
    ws = _weight_sync()
    try:
        metadata = ws.as_metadata(zip(names, dtypes, shapes))
    except (AttributeError, TypeError, ValueError) as e:
        return 400, {"success": False, "message": f"Failed to update parameter online: {e!r}."}
    try:
        received = ws.receive(group, metadata, "cpu")
    except Exception as e:  # noqa: BLE001 - a broken collective
        return 400, {"success": False, "message": f"Failed to update parameter online: {e}. The full weights of "
                                                  f"the ModelRunner are partially updated. Please discard the whole weights."}
    model = state.model
    unknown = [n for n in received if n not in model.weights and not model.skips(n)]
    if unknown:  # load_weights raises KeyError; sglang may have loaded some names by then, the stand-in none
        return 400, {"success": False, "message": f"Failed to update parameter online: KeyError: {unknown[0]!r} "
                                                  f"({len(unknown)} name(s) not in the model). The full weights of the "
                                                  f"ModelRunner are partially updated. Please discard the whole weights."}
    if not state.args.ignore_weight_updates:
        model.load({n: (str(t.dtype).removeprefix("torch."), list(t.shape), tensor_sha256(t)) for n, t in received.items()})
    if body.get("weight_version") is not None:
        state.weight_version = body["weight_version"]
    return 200, {"success": True, "message": "Succeeded to update parameter online."}


MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES: none given = all


def memory(state: State, body: dict, release: bool) -> tuple[int, object]:
    tags = (body or {}).get("tags") or list(MEMORY_TAGS)
    if release:
        state.released |= set(tags)
    elif not_released := set(tags) - state.released:  # the scheduler's offload_tags.remove(tag) raises
        return 500, f"KeyError: {sorted(not_released)[0]!r}"
    else:
        state.released -= set(tags)
        if "weights" in tags:
            state.model.lose()
    return 200, None  # sglang's handler returns nothing: FastAPI answers `null`


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as SGLang's uvicorn: the client reuses its connections
        closing = False  # per connection: a 500 was answered on it

        def log_message(self, fmt, *args):  # quiet
            pass

        def _send(self, status: int, payload, text: bool = False) -> None:
            data = payload.encode() if text else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            t0, n0 = time.time(), next(state.order)
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if state.hung and path != "/_calls":
                while True:  # stop answering; the client must time out
                    time.sleep(3600)
            if self.closing:  # the 500 before on this connection: uvicorn closed it, this request is never answered
                self.close_connection = True
                return
            try:
                body = json.loads(raw) if raw else None
            except json.JSONDecodeError:
                self._send(400, {"error": {"message": "invalid JSON"}})
                return
            status, payload, text = self._route(method, path, body)
            if path not in ("/_calls",):
                summary = dict(body) if isinstance(body, dict) else body
                if isinstance(summary, dict) and "serialized_named_tensors" in summary:
                    summary["serialized_named_tensors"] = [len(p) for p in summary["serialized_named_tensors"]]
                state.record({"path": path, "method": method, "body": summary, "status": status,
                              "t0": t0, "t1": time.time(), "n0": n0, "n1": next(state.order), "pid": os.getpid()})
            self._send(status, payload, text)
            # a 500 is an exception nothing caught: uvicorn closes the connection once it has logged it, after the
            # client may already have sent its next request on it (modelled as always: that request is dropped)
            self.closing = status == 500

        def _route(self, method: str, path: str, body):
            if any(path in routes for version, routes in ONLY_IN.items() if version != state.args.sglang_version):
                return 404, {"detail": "Not Found"}, False
            if path == "/get_weight_version":
                return 200, {"weight_version": state.weight_version}, False
            if path == "/ready":
                return 200, "", True
            if path in ("/health", "/health_generate"):
                with state.lock:
                    warming, state.health_503_left = state.health_503_left > 0, max(state.health_503_left - 1, 0)
                return (503 if warming else 200), "", True
            if path in ("/model_info", "/get_model_info"):
                return 200, {"model_path": state.model_path, "tokenizer_path": state.args.model_path,
                             "is_generation": True, "preferred_sampling_params": None,
                             "weight_version": state.weight_version}, False
            if path == "/generate" and method in ("POST", "PUT"):
                probe = str((body or {}).get("rid", "")).startswith("gf-logprobs")
                if state.stall_marker and not probe:
                    with open(state.stall_marker, "a"):
                        pass
                    while True:  # held until the process ends
                        time.sleep(3600)
                with state.lock:
                    state.inflight_generate += 1
                    state.max_inflight_generate = max(state.max_inflight_generate, state.inflight_generate)
                rid = str((body or {}).get("rid") or "")
                run = None if probe else state.arrive(rid)
                try:
                    status, payload = generate(state, body or {}, run, held=not probe and state.held(rid))
                    if run is not None:
                        state.pass_gate(run)  # the answer is final; an abort from now on finds it finished
                finally:
                    if not probe:
                        state.leave(rid)
                    with state.lock:
                        state.inflight_generate -= 1
                return status, payload, isinstance(payload, str)
            if path == "/abort_request" and method == "POST":
                state.abort((body or {}).get("rid"), bool((body or {}).get("abort_all")))
                return 200, "", True  # sglang: Response(status_code=200), no body
            if path == "/flush_cache":
                return 200, "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n", True
            if path == "/update_weights_from_disk" and method == "POST":
                return (*update_from_disk(state, body or {}), False)
            if path == "/update_weights_from_tensor" and method == "POST":
                return (*update_from_tensor(state, body or {}), False)
            if path == "/update_weights_from_distributed" and method == "POST":
                return (*update_from_distributed(state, body or {}), False)
            if path == "/init_weights_update_group" and method == "POST":
                return (*init_group(state, body or {}), False)
            if path == "/destroy_weights_update_group" and method == "POST":
                return (*destroy_group(state, body or {}), False)
            if path == "/release_memory_occupation":
                return (*memory(state, body, release=True), False)
            if path == "/resume_memory_occupation":
                return (*memory(state, body, release=False), False)
            if path == "/_calls":
                with state.lock:
                    return 200, {"calls": list(state.calls), "max_inflight_generate": state.max_inflight_generate,
                                 "pid": os.getpid()}, False
            if path == "/_weights":
                return 200, {"weights": state.model.weights, "digest": state.model.digest,
                             "weight_version": state.weight_version}, False
            if path == "/_health_503" and method == "POST":
                with state.lock:
                    state.health_503_left = int((body or {}).get("n", 0))
                return 200, {"health_503": state.health_503_left}, False
            if path == "/_hang" and method == "POST":
                state.hung = True
                return 200, {"hung": True}, False
            if path == "/_gate" and method == "POST":
                state.arm_gate(int((body or {}).get("n", 0)))
                return 200, {"gate": state.gate_n}, False
            if path == "/_hold" and method == "POST":
                rids = (body or {}).get("rids")
                state.hold_rids = re.compile(rids) if rids else None
                state.hold_after = int((body or {}).get("after", state.hold_after))
                return 200, {"hold_rids": rids, "hold_after": state.hold_after}, False
            if path == "/_stall_generate" and method == "POST":
                state.stall_marker = str((body or {})["marker"])
                return 200, {"stalling": True}, False
            return 404, {"detail": "Not Found"}, False

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

        def do_PUT(self):
            self._handle("PUT")

    return Handler


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="SGLang HTTP stand-in (tests only)")
    # the sglang.launch_server flags grpoflow passes (names as in sglang/srt/arg_groups/fields/*.py)
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    # test-only
    p.add_argument("--sglang-version", choices=("0.5.23", "0.5.17"), default="0.5.23")
    p.add_argument("--calls-file", default=None)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--health-503-count", type=int, default=0)
    p.add_argument("--gen-jitter", type=float, default=0.0)
    p.add_argument("--ignore-weight-updates", action="store_true")
    p.add_argument("--weight-sync-timeout-s", type=float, default=600.0)
    p.add_argument("--gate", type=int, default=0)
    p.add_argument("--hold-rids", default=None)
    p.add_argument("--hold-after", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"stand-in sglang server (NOT SGLang) pid={os.getpid()} args={vars(args)}", flush=True)
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        # SGLang fails in start-up when it cannot read the model's config; so does the stand-in.
        print("Traceback (most recent call last):", file=sys.stderr)
        print(f"OSError: stand-in: can't load the configuration of '{args.model_path}': no config.json there",
              file=sys.stderr, flush=True)
        sys.exit(1)
    time.sleep(args.startup_delay)
    with open(os.path.join(args.model_path, "config.json")) as f:
        experts_per_token = json.load(f).get("num_experts_per_tok")
    if args.enable_return_routed_experts and not experts_per_token:  # RoutedExpertsCapturer reads it from the config
        print("Traceback (most recent call last):", file=sys.stderr)
        print("AttributeError: stand-in: --enable-return-routed-experts on a model without num_experts_per_tok",
              file=sys.stderr, flush=True)
        sys.exit(1)
    state = State(args)
    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer.request_queue_size = 256  # the client opens up to concurrency x engines connections at once
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    server.daemon_threads = True
    print(f"The server is fired up and ready to roll! port={args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
