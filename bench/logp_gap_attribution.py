"""Where the engine-vs-trainer log-prob gap comes from (issue 61 item 1), one class of kernel at a time.

    python3 bench/logp_gap_attribution.py --out $OUT                 # one GPU, Qwen3-0.6B shape, < 450 s
    python3 bench/logp_gap_attribution.py --family glm4 --layers 4   # GLM-4-9B's shape, 4 layers
    python3 bench/logp_gap_attribution.py --cpu                      # smoke: tiny model, fp32, same code paths
    python3 bench/logp_gap_attribution.py --cpu --dtype bfloat16 --leave-one-out   # the bf16 attribution on CPU

One process holds both sides (as bench/gpu_grpo.py's trainer section does): a random model of the family's known
config (runtime/models/known_configs; `--layers` cuts it), converted to torch_dist; the megatron trainer
(runtime/trainer/megatron_trainer.py, the recipe's micro-batch 1, its fusions and deterministic mode) and the
built-in engine (paged decoder, compiled, CUDA graphs) on the same weights. The engine samples prompts x samples
responses at fixed length (no stop token); the trainer scores them (`compute_logprobs`); the gap is |engine log p -
trainer log p| over the sampled tokens: mean, p99, max and the fraction bitwise equal.

Then the engine's forward is rebuilt by this bench (`EngineForward`: the same pieces as
runtime/rollout/decode_model.py's `_pre_attn` / `_post_attn` / `_logits`, compiled with the engine's options; its
copy with nothing aligned must give the engine's bits, `copy_matches_engine`) with slots for each class of kernel,
and `EngineForward.install(aligned, TrainerKernels)` puts the trainer's implementation of each class in `aligned`
into its slot. The trainer's piece is called as it is (opaque to the engine's compiler: its own kernel, its output
rounded where the trainer rounds it; in the trainer's deterministic mode):

  norm        the trainer's RMSNorm module's forward (CompiledRMSNorm on CUDA, in the trainer's deterministic mode;
              torch's RMSNorm on CPU) with the engine's weight
  rope        megatron's angle table (`rotary_pos_emb`) and `apply_rotary_pos_emb` with the trainer's config (the
              compiled grpoflow kernel on CUDA for rotate-half RoPE)
  swiglu      megatron's `bias_swiglu_impl` when the trainer fuses it, else megatron's glu expression
  logsoftmax  the sampled token's log-prob by the trainer's `_fwd_math` (runtime/trainer/logprobs.py, compiled on
              CUDA) on the engine's logits, rows in blocks of FIXED_ROWS (`fixed_rows`; the trainer's side so too
              where the matmuls are aligned); the engine still draws the token itself
  attention   the trainer's core attention module (SdpaCoreAttention on CUDA) at every step: prefill causal per
              prompt, decode one query against the row's whole context read from the pages (the trainer runs every
              query of a sequence in one call: the engine cannot, so this is the trainer's kernel at another shape)
  attention_common
              BOTH sides: the setting's attention (`common_decode` for the engine's decode, `common_prefill` for
              its prefill, `common_attention` for the trainer's core attention, patched for the bench only): on
              CUDA one Triton kernel, one program per query row and KV head (runtime/kernels/row_attention.py);
              elsewhere every query row as the engine's decode reference computes one (key blocks of 256 from
              position 0 under a running fp32 softmax), query rows in blocks of FIXED_ROWS so every einsum and
              reduction has one shape. The first GPU run called that PyTorch form with each side's rows in one call
              (engine decode: the live rows; prefill: the prompt; trainer: the sequence): on the GPU not bitwise
  linear      no swap is possible (both sides call cuBLAS through the same op; the bits differ because the row
              count picks the kernel): BOTH sides use a common batch-invariant matmul (`fixed_shape_mm`: rows in
              blocks of a fixed count, so every call has one shape), the trainer's linear layers and its chunked
              output layer included (patched for the bench only). One difference stays: the trainer's fused q/k/v
              rows are megatron's per-group order, the engine's HF's; one GEMM kernel gives a column the same bits
              wherever it sits, unless the kernel cuBLAS picks splits K per tile (stream-K)

Rows: the engine, the copy, everything aligned (first: if `--deadline` cuts the list, it cuts the partial sums), each
class alone, then cumulatively in the order given (`--classes`); with `--leave-one-out`, everything aligned and then
everything but each class (in bf16 a class aligned alone leaves about the whole gap: one differing bit anywhere grows
to it). Before them, `row_invariance`: each aligned kernel at the engine's and the trainer's shape, the same rows
compared (on a GPU, what keeps the all-aligned row from 0). Besides: batch invariance (a few samples alone
against the same samples in the batch of 64) and preempted-and-recomputed samples (a pool too small for the batch)
against the same keys unpreempted, for the default engine and the all-aligned one. Nothing in runtime/ changes: the
swaps are instance attributes of this bench's engine and trainer. JSON in OUT/logp_gap_attribution.json
(`--results-dir` keeps a copy named by device and date).
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
import types
from pathlib import Path

import harness as H
from harness import ROOT

# the batch-invariant set both sides take under rollout.true_on_policy; the bench's variants install it piecewise
from runtime.kernels.batch_invariant import (FIXED_ROWS, _attention_rows, common_attention,  # noqa: F401 (tests)
                                             common_decode, common_prefill, fixed_rows, fixed_shape_mm)

CLASSES = ("logsoftmax", "norm", "rope", "swiglu", "linear", "attention", "attention_common")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512)
SHAPES = {
    "gpu": dict(prompts=8, samples=8, prompt_len=256, new=256, dtype="bfloat16", device="cuda", kv_cache_gb=8.0,
                tiny=False, alone_rows=4),
    "cpu": dict(prompts=2, samples=4, prompt_len=12, new=40, dtype="float32", device="cpu", kv_cache_gb=0.001,
                tiny=True, alone_rows=2),
}
KNOWN = {"qwen3": "Qwen3-0.6B.json", "glm4": "GLM-4-9B-0414.json"}
PIECE_CLASSES = {"norm", "linear", "rope", "swiglu"}  # the classes inside the engine's compiled per-layer pieces


def _torch():
    import torch
    return torch


def dtype_of(S):
    torch = _torch()
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[S["dtype"]]


# ---- setup -------------------------------------------------------------------------------------------------

def setup(S, W: Path, family: str, layers: int | None) -> dict:
    """A random model of the family's known config (cut to `layers`), its tokenizer (the tiny one: prompts are ids),
    and its torch_dist copy."""
    torch = _torch()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from runtime.mcore.convert import hf_to_torch_dist
    t0 = time.time()
    H.fresh_setup(W)
    tok = AutoTokenizer.from_pretrained(W / "tok")
    d = json.loads((ROOT / "runtime" / "models" / "known_configs" / KNOWN[family]).read_text())
    arch = d.pop("architectures")
    d.pop("torch_dtype", None)
    if S["tiny"]:
        d.update(TINY)
    if layers:
        d["num_hidden_layers"] = layers
    d.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    cfg = AutoConfig.for_model(**d)
    cfg.architectures = arch
    torch.manual_seed(0)
    with torch.device(S["device"]):
        model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # a trained model's norms and biases: HF's init leaves them 1 and 0, where the norm's
        for name, p in model.named_parameters():  # rounding (before or after the weight) and the bias's place
            if p.dim() == 1:  # (inside or after the GEMM) change no bit
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.to(dtype_of(S)).save_pretrained(W / "hf")
    del model
    H.copy_tokenizer(W)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=True, temperature=1.0,
                     top_p=1.0, top_k=0).save_pretrained(W / "hf")
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
        conv = hf_to_torch_dist(W / "hf", W / "td", dtype="bfloat16", device="auto")
    else:
        conv = hf_to_torch_dist(W / "hf", W / "td", tolerance=1e-3)
    return {"family": family, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
            "parity_max_abs_logit_diff": conv.get("max_abs_logit_diff"), "setup_s": round(time.time() - t0, 1)}


def build_trainer(S, W: Path):
    from runtime.config import AlgorithmSection, TrainSection
    from runtime.trainer.megatron_trainer import MegatronTrainer
    # the recipe's trainer (configs/qwen3-0.6b-dapo.yaml: micro-batch 1, fusions and deterministic mode at their
    # defaults); the chunked output layer on CPU too, as on the GPU
    train = TrainSection(lr=1e-6, micro_batch_size=1, num_rollout=1, num_steps_per_rollout=1,
                         **({"chunked_logprobs": "on"} if S["device"] == "cpu" else {}))
    return MegatronTrainer(hf_dir=str(W / "hf"), init_checkpoint=str(W / "td"), train=train,
                           algorithm=AlgorithmSection(), temperature=1.0, device=S["device"], dtype=S["dtype"])


def build_engine(S, W: Path, rows: int, kv_cache_gb=None, sync_every: int = 16):
    from runtime.rollout.builtin import BuiltinEngine
    eng = BuiltinEngine(str(W / "hf"), device=S["device"], dtype=dtype_of(S), max_batch_size=rows,
                        decode_path="paged", kv_cache_gb=kv_cache_gb or S["kv_cache_gb"], sync_every=sync_every)
    eng.eos_token_ids = set()  # fixed length: a random model would stop at random
    return eng


def requests(S, vocab: int, rows: list[int] | None = None):
    torch = _torch()
    from runtime.rollout.base import SampleRequest
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (S["prompts"], S["prompt_len"]), generator=g).tolist()
    reqs = [SampleRequest(prompt_ids=ids[p], key=(61, 0, p, j))
            for p in range(S["prompts"]) for j in range(S["samples"])]
    return reqs if rows is None else [reqs[i] for i in rows]


def sampling(S):
    from runtime.rollout.base import SamplingParams
    return SamplingParams(temperature=1.0, max_new_tokens=S["new"])


# ---- measures ----------------------------------------------------------------------------------------------

def gap_stats(engine_lp: list[list[float]], trainer_lp: list[list[float]]) -> dict:
    torch = _torch()
    e = torch.tensor([x for row in engine_lp for x in row], dtype=torch.float64)
    t = torch.tensor([x for row in trainer_lp for x in row], dtype=torch.float64)
    d = (e - t).abs()
    return {"tokens": int(d.numel()), "mean": float(d.mean()), "p99": float(torch.quantile(d, 0.99)),
            "max": float(d.max()), "bitwise_equal_frac": round(float((d == 0).double().mean()), 4)}


def agreement(a, b) -> dict:
    """Two runs' samples for the same requests: rows identical, and log-probs on each row's common prefix."""
    torch = _torch()
    same, diffs, eq, n_tok = 0, [], 0, 0
    for x, y in zip(a, b):
        same += x.response_ids == y.response_ids
        n = 0
        for s, t in zip(x.response_ids, y.response_ids):
            if s != t:
                break
            n += 1
        for p, q in zip(x.response_logprobs[:n], y.response_logprobs[:n]):
            diffs.append(abs(p - q))
            eq += p == q
        n_tok += len(x.response_ids)
    d = torch.tensor(diffs or [0.0], dtype=torch.float64)
    return {"rows_identical": f"{same}/{len(a)}", "common_prefix_frac": round(len(diffs) / max(n_tok, 1), 4),
            "logp_bitwise_equal_frac": round(eq / max(len(diffs), 1), 4), "logp_absdiff_max": float(d.max()),
            "logp_absdiff_mean": float(d.mean())}


@contextlib.contextmanager
def trainer_common(tr, aligned):
    """The trainer's side of the classes both sides take in common (matmuls, attention_common)."""
    with contextlib.ExitStack() as stack:
        if "linear" in aligned:
            stack.enter_context(trainer_common_linear(tr))
        if "attention_common" in aligned:
            stack.enter_context(trainer_common_attention(tr))
        yield


def scored(samples, tr, trainer_ctx=contextlib.nullcontext) -> tuple[list, dict]:
    batch = H.samples_batch(samples)
    with trainer_ctx():
        trainer_lp = tr.compute_logprobs(batch)
    return trainer_lp, gap_stats([s.response_logprobs for s in samples], trainer_lp)


# ---- the trainer's side of the common classes (patched by this bench for its variants) ------------------

def common_linear_logprobs(hidden, weight, targets, temperature: float = 1.0, *, chunk: int = 2048,
                           with_entropy: bool = False, batch_invariant: bool = False):
    """runtime/trainer/logprobs.linear_logprobs's forward (no autograd: log-prob passes only) with the output layer's
    GEMM by `fixed_shape_mm` and its log-softmax on rows in fixed blocks (`fixed_rows`), as the engine's."""
    torch = _torch()
    from runtime.trainer import logprobs as L
    assert not with_entropy and not torch.is_grad_enabled()
    fwd, _ = L._fns(hidden.device)
    out = []
    for s in range(0, hidden.shape[0], chunk):
        zb = fixed_shape_mm(hidden[s:s + chunk], weight)
        math = lambda z, t: L._call(fwd, L._fwd_math, z, t, temperature, False)  # noqa: E731
        out.append(fixed_rows(math, zb, targets[s:s + chunk])[0])
    return torch.cat(out), None


@contextlib.contextmanager
def trainer_common_linear(tr):
    """The trainer's linear layers and chunked output layer through `fixed_shape_mm` (bench only; undone after)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from runtime.trainer import logprobs as L

    def impl(input, weight, *args, bias=None, **kwargs):
        return fixed_shape_mm(input, weight, bias)

    mods = [m for m in tr.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for m in mods:
        m._forward_impl = impl
    before = L.linear_logprobs
    L.linear_logprobs = common_linear_logprobs
    try:
        yield
    finally:
        L.linear_logprobs = before
        for m in mods:
            del m._forward_impl


@contextlib.contextmanager
def trainer_common_attention(tr):
    """Every layer's core attention of the trainer through `common_attention` (bench only; undone after)."""
    torch = _torch()
    cores = [layer.self_attention.core_attention for layer in tr.model.decoder.layers]

    def forward_of(core):
        def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert packed_seq_params is None and attention_bias is None
            sq, b = query.shape[:2]
            out = torch.stack([common_attention(query[:, i], key[:, i], value[:, i], core.softmax_scale)
                               for i in range(b)], dim=1)
            return out.reshape(sq, b, -1)
        return forward

    for c in cores:
        c.forward = forward_of(c)
    try:
        yield
    finally:
        for c in cores:
            del c.forward


# ---- the trainer's kernels, callable from the engine's forward ----------------------------------------------

class TrainerKernels:
    """The trainer's implementation of each class, with the engine's signatures. Each runs in the trainer's
    deterministic mode (as the trainer's compute does) and is opaque to the engine's compiler."""

    def __init__(self, tr, max_len: int):
        torch = _torch()
        from runtime.mcore import env as menv
        from runtime.mcore.determinism import deterministic_kernels
        gpt = menv.unwrap_model(tr.model)
        self.cfg = gpt.config
        self.mode = lambda: deterministic_kernels(tr.train_cfg.deterministic)
        self.norm_module = gpt.decoder.final_layernorm
        self.core = gpt.decoder.layers[0].self_attention.core_attention
        with torch.no_grad():
            self.freqs = gpt.rotary_pos_emb(max_len)  # [max_len, 1, 1, rot] fp32 angles, megatron's
        self.device = next(gpt.parameters()).device

    def opaque(self, fn):
        torch = _torch()

        def run(*a, **k):
            with self.mode():
                return fn(*a, **k)
        return torch.compiler.disable(run)

    # norm(x, w, eps): the norm module's forward with the engine's weight (the same values)
    def norm(self, x, w, eps):
        mod = self.norm_module
        shim = types.SimpleNamespace(weight=w, eps=mod.eps, normalized_shape=(x.shape[-1],),
                                     elementwise_affine=True)
        return type(mod).forward(shim, x)

    def rope_table(self, pos):
        return self.freqs.index_select(0, pos), None

    def rope(self, x, freqs, _unused):
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
        return apply_rotary_pos_emb(x[:, None], freqs, config=self.cfg)[:, 0]

    def swiglu(self, gu):
        torch = _torch()
        cfg = self.cfg
        if cfg.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
            return bias_swiglu_impl(gu, None)
        a, b = torch.chunk(gu, 2, dim=-1)
        return cfg.activation_func(a) * (b + cfg.glu_linear_offset)

    def logsoftmax(self, logits, tokens, temperature: float):
        """The trainer's log-softmax math on rows in fixed blocks (`fixed_rows`): the trainer's side calls it so too
        when the matmuls are aligned (`common_linear_logprobs`)."""
        from runtime.trainer import logprobs as L
        fwd, _ = L._fns(logits.device)
        return fixed_rows(lambda z, t: L._call(fwd, L._fwd_math, z, t, temperature, False), logits, tokens)[0]

    def logsoftmax_one_call(self, logits, tokens, temperature: float):
        from runtime.trainer import logprobs as L
        fwd, _ = L._fns(logits.device)
        return L._call(fwd, L._fwd_math, logits, tokens, temperature, False)[0]

    def _core(self, q, k, v, causal: bool):
        """q [sq, b, nh, hd], k/v [sk, b, nkv, hd] -> [sq, b, nh, hd] by the trainer's core attention module."""
        torch = _torch()
        from megatron.core.transformer.enums import AttnMaskType

        from runtime.mcore.env import SdpaCoreAttention
        sq, b, nh, hd = q.shape
        sk = k.shape[0]
        if isinstance(self.core, SdpaCoreAttention):
            mask = None  # causal is the kernel's; no mask: every key (a mask would take SDPA off the flash kernel)
        elif causal:
            mask = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=q.device), diagonal=1).view(1, 1, sq, sk)
        else:
            mask = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=q.device)
        out = self.core(q, k, v, mask, attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.no_mask)
        return out.view(sq, b, nh, hd)

    def prefill_attention(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        """The engine's `_flash` signature: packed sequences, each through the trainer's attention alone."""
        torch = _torch()
        cu = cu_q.tolist()
        return torch.cat([self._core(q[s:e, None], k[s:e, None], v[s:e, None], True)[:, 0]
                          for s, e in zip(cu[:-1], cu[1:])])

    def decode_attention(self, q, k_pool, v_pool, table, prefix_len, own_len, prefix_cols: int, scale: float,
                         split_tokens=None):
        """The engine's paged-attention signature: one query per row against its whole context, gathered in order
        from the pages; rows of one length in one call."""
        torch = _torch()
        B, nh, hd = q.shape
        P, nkv = k_pool.shape[1], k_pool.shape[2]
        kf, vf = k_pool.reshape(-1, nkv, hd), v_pool.reshape(-1, nkv, hd)
        groups: dict = {}
        for b, key in enumerate(zip(prefix_len.tolist(), own_len.tolist())):
            groups.setdefault(key, []).append(b)
        out = torch.empty_like(q)
        for (p, o), rows in groups.items():
            idx = torch.tensor(rows, device=q.device)
            j = torch.arange(p + o, device=q.device)
            pre = j < p
            at = torch.where(pre, j, j - p)
            col = torch.where(pre, at // P, prefix_cols + at // P)
            slot = table.index_select(0, idx).long()[:, col] * P + at % P  # [g, L]
            k, v = kf[slot].transpose(0, 1), vf[slot].transpose(0, 1)  # [L, g, nkv, hd]
            out[idx] = self._core(q.index_select(0, idx)[None], k, v, False)[0]
        return out


# ---- row invariance of each aligned kernel, by itself -----------------------------------------------------

def row_invariance(S, tr, K: TrainerKernels, dec) -> dict:
    """Each kernel the all-aligned set runs on both sides, called on random inputs at the engine's shape (a decode
    step's B rows) and at the trainer's ([s, 1, ...] for one sequence of s tokens), the same rows compared: equal
    bits, or the max |diff|. On CPU every row is expected equal; on a GPU a False names a kernel whose
    configuration follows the shape: what the all-aligned gap is made of (the gap's size says nothing there, in
    bf16 one differing bit anywhere grows to about the full gap)."""
    torch = _torch()
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from runtime.mcore import env as menv
    from runtime.rollout.decode_attention import reference_paged_decode_attention
    dev, dt = torch.device(S["device"]), dtype_of(S)
    g = torch.Generator(device=dev).manual_seed(1)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=dev).to(dt)  # noqa: E731
    n, B = S["prompt_len"] + S["new"], S["prompts"] * S["samples"]
    nh, nkv, hd, Hd, F2 = dec.nh, dec.nkv, dec.hd, dec.embed.shape[1], 2 * dec.ffn
    rows = torch.linspace(0, n - 1, B, device=dev).long()  # the engine's rows: positions spread over the sequence
    out = {}

    def cmp(name, engine, trainer):
        d = (engine.float() - trainer.float()).abs()
        out[name] = {"bitwise": bool(torch.equal(engine, trainer)), "max_abs": float(d.max()) if d.numel() else 0.0}

    with torch.no_grad(), K.mode():
        x = rnd(n, Hd)
        w = rnd(Hd)
        cmp("norm (hidden)", K.norm(x[rows], w, dec.eps), K.norm(x.view(n, 1, Hd), w, dec.eps)[rows, 0])
        qh = rnd(n, nh, hd)
        gpt = menv.unwrap_model(tr.model)
        qn = getattr(gpt.decoder.layers[0].self_attention, "q_layernorm", None)
        if getattr(qn, "weight", None) is not None:  # Qwen3's; GLM4 has none
            cmp("q-norm (engine: the norm module's forward; trainer: its q_layernorm)",
                K.norm(qh[rows], qn.weight, dec.eps), qn(qh.view(n, 1, nh, hd))[rows, 0])
            out["q_layernorm_class"] = type(qn).__name__
        for N, what in ((dec.layers[0].qkv_w.shape[0], "qkv"), (F2, "gate/up"), (dec.lm.shape[0], "lm head")):
            wt = rnd(N, Hd) * 0.05
            cmp(f"matmul {what}, F.linear", torch.nn.functional.linear(x[rows], wt),
                torch.nn.functional.linear(x.view(n, 1, Hd), wt)[rows, 0])
            cmp(f"matmul {what}, fixed_shape_mm", fixed_shape_mm(x[rows], wt),
                fixed_shape_mm(x.view(n, 1, Hd), wt)[rows, 0])
        # the q/k/v columns in HF's order (the engine's) and megatron's per-group order (the trainer's)
        r = nh // nkv
        heads = [list(range(k * r, (k + 1) * r)) + [nh + k, nh + nkv + k] for k in range(nkv)]
        perm = torch.tensor([h * hd + i for grp in heads for h in grp for i in range(hd)], device=dev)
        wq = rnd((nh + 2 * nkv) * hd, Hd) * 0.05
        cmp("matmul qkv, fixed_shape_mm, HF vs megatron column order", fixed_shape_mm(x[rows], wq)[:, perm],
            fixed_shape_mm(x[rows], wq[perm]))
        freqs = K.freqs[:n]
        cmp("rope", K.rope(qh[rows], freqs[rows], None),
            apply_rotary_pos_emb(qh.view(n, 1, nh, hd), freqs, config=K.cfg)[rows, 0])
        gu = rnd(n, F2)
        cmp("swiglu", K.swiglu(gu[rows]), K.swiglu(gu.view(n, 1, F2))[rows, 0])
        z = rnd(n, dec.lm.shape[0]) * 3
        t = torch.randint(0, dec.lm.shape[0], (n,), generator=g, device=dev)
        cmp("log-softmax (one call)", K.logsoftmax_one_call(z[rows], t[rows], 1.0),
            K.logsoftmax_one_call(z, t, 1.0)[rows])
        cmp(f"log-softmax (rows in blocks of {FIXED_ROWS})", K.logsoftmax(z[rows], t[rows], 1.0),
            K.logsoftmax(z, t, 1.0)[rows])
        q, k, v = rnd(n, nh, hd), rnd(n, nkv, hd), rnd(n, nkv, hd)
        # the engine's decode of row i (its context: positions [0, i], one sequence's pages) vs the trainer's call
        P = dec.page_size
        pages = -(-n // P)
        pool = lambda t: torch.cat([t, t.new_zeros(pages * P - n, nkv, hd)]).view(pages, P, nkv, hd)  # noqa: E731
        table = torch.arange(pages, device=dev, dtype=torch.int32)[None].expand(B, pages).contiguous()
        plen, own = rows + 1, torch.zeros_like(rows)
        scale = hd ** -0.5
        every = torch.arange(n, device=dev)
        for tag, fn_t, fn_e in (  # the PyTorch form (the first GPU run's), then the setting's (Triton on CUDA)
                ("PyTorch, one call", lambda: _attention_rows(q, k, v, scale, every),
                 lambda: reference_paged_decode_attention(q[rows], pool(k), pool(v), table, plen, own, pages, scale)),
                ("the setting's: Triton on CUDA, else PyTorch rows in blocks", lambda: common_attention(q, k, v, scale),
                 lambda: common_decode(q[rows], pool(k), pool(v), table, plen, own, pages, scale))):
            cmp(f"attention, common ({tag}): engine decode vs trainer", fn_e(), fn_t()[rows])
        cmp("attention, common: prefill of 1/2 the sequence vs trainer", common_attention(q[:n // 2], k[:n // 2],
            v[:n // 2], scale), common_attention(q, k, v, scale)[:n // 2])
    return out


# ---- the engine's forward with slots ----------------------------------------------------------------------

def _renamed(fn, tag: str):
    """fn as a function of its own code object: dynamo's cache lives on the code object, so each variant compiles
    afresh instead of meeting another variant's guards."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}", co_qualname=f"{fn.__qualname__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class EngineForward:
    """The engine's per-layer pieces (runtime/rollout/decode_model.py `_pre_attn`, `_post_attn`, `_logits`; HF's
    q/k/v order, no LoRA) with a slot per class; installed on a `PagedDecoder` as its instance attributes."""

    SAVED = ("_pre", "_post", "_head", "_paged_attention", "_flash", "use_triton", "use_flash", "use_graphs")

    def __init__(self, dec):
        assert dec.adapters is None and not dec.qkv_grouped, "the bench's copy has no LoRA and HF's q/k/v order"
        self.dec = dec
        self.orig = {k: dec.__dict__[k] for k in self.SAVED}
        self.built: dict = {}  # compiled pieces by the classes aligned inside them
        self.n = 0

    def defaults(self) -> dict:
        import torch.nn.functional as F

        from runtime.rollout import decode_model as dm
        ffn = self.dec.ffn

        def act(gu):
            g, u = gu.split([ffn, ffn], dim=-1)
            return F.silu(g) * u
        return {"norm": dm._rms, "linear": F.linear, "rope": dm._rope_interleaved if self.dec.interleaved else dm._rope,
                "act": act}

    def pieces(self, slot: dict):
        d = self.dec
        nh, nkv, hd, eps = d.nh, d.nkv, d.hd, d.eps
        norm, linear, rope, act = slot["norm"], slot["linear"], slot["rope"], slot["act"]

        def pre(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, *no_lora):
            x = norm(h, ln_w, eps)
            qkv = linear(x, qkv_w, qkv_b)
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.reshape(-1, nh, hd)
            k = k.reshape(-1, nkv, hd)
            if qn_w is not None:
                q = norm(q, qn_w, eps)
                k = norm(k, kn_w, eps)
            return rope(q, cos, sin), rope(k, cos, sin), v.reshape(-1, nkv, hd).contiguous()

        def post(h, attn, o_w, o_b, ln_w, gu_w, down_w, pa_w, pm_w, *no_lora):
            a = linear(attn, o_w, o_b)
            h = h + (a if pa_w is None else norm(a, pa_w, eps))
            x = norm(h, ln_w, eps)
            m = linear(act(linear(x, gu_w, None)), down_w, None)
            return h + (m if pm_w is None else norm(m, pm_w, eps))

        def head(h, norm_w, lm_w):
            return linear(norm(h, norm_w, eps), lm_w, None)
        return pre, post, head

    def install(self, aligned: tuple, K: TrainerKernels | None) -> None:
        """The engine's forward with the classes in `aligned` taken from the trainer (`K`); CUDA graphs off (a
        replay gives the eager steps' bits: bench/README.md), the pieces compiled again with the engine's options (the
        engine's own compiled pieces where no class inside them is aligned)."""
        torch = _torch()
        d = self.dec
        self.n += 1
        slot = self.defaults()
        if "norm" in aligned:
            slot["norm"] = K.opaque(K.norm)
        if "linear" in aligned:
            slot["linear"] = torch.compiler.disable(fixed_shape_mm)
        if "rope" in aligned:
            slot["rope"] = K.opaque(K.rope)
        if "swiglu" in aligned:
            slot["act"] = K.opaque(K.swiglu)
        inside = frozenset(PIECE_CLASSES & set(aligned))
        if aligned and not inside:  # the pieces as they were: the engine's own, compiled
            pre, post, head = (self.orig[k] for k in ("_pre", "_post", "_head"))
        elif inside in self.built:  # compiled for an earlier variant with the same classes inside
            pre, post, head = self.built[inside]
        else:
            pre, post, head = self.pieces(slot)
            if d.compiled:
                pre, post, head = (torch.compile(_renamed(f, f"v{self.n}"), dynamic=True, options=d.compile_options)
                                   for f in (pre, post, head))
            if aligned:  # the copy (nothing aligned) is compiled on its own: it checks the engine's own
                self.built[inside] = pre, post, head
        for k, v in self.orig.items():
            setattr(d, k, v)
        d._pre, d._post, d._head = pre, post, head
        d.use_graphs = False
        d.graphs.clear()
        d._settled.clear()
        for name in ("rope_tables", "_sampler"):
            d.__dict__.pop(name, None)
        if "rope" in aligned:
            d.rope_tables = K.rope_table
        if "attention_common" in aligned:  # decode by the reference, prefill and trainer alike, rows in fixed blocks
            d._paged_attention, d.use_triton = torch.compiler.disable(common_decode), True
            d._flash, d.use_flash = common_prefill, True
        elif "attention" in aligned:
            d._paged_attention, d.use_triton = K.opaque(K.decode_attention), True
            d._flash, d.use_flash = K.opaque(K.prefill_attention), True
        if "logsoftmax" in aligned:
            d._sampler = _trainer_logprob_sampler(d, K)


def _trainer_logprob_sampler(dec, K: TrainerKernels):
    """The engine's own sampler for the token; the token's log-prob by the trainer's log-softmax."""
    own = type(dec)._sampler.__get__(dec)
    lsm = K.opaque(K.logsoftmax)

    def sampler(sp):
        step, skey, prefill = own(sp)
        temp = sp.temperature if sp.temperature > 0 else 1.0

        def wrap(fn):
            def draw(logits, kh, pos):
                t, _ = fn(logits, kh, pos)
                return t, lsm(logits, t, temp)
            return draw
        return wrap(step), (*skey, "trainer-logsoftmax"), wrap(prefill)
    return sampler


# ---- the run ----------------------------------------------------------------------------------------------

def run(S, W: Path, a, t_start: float) -> dict:
    torch = _torch()
    import os

    from runtime.mcore.determinism import fix_cublas_workspace
    fix_cublas_workspace()  # before the process's first cuBLAS handle, as the trainer's process has it
    res: dict = {"cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                 "setup": setup(S, W, a.family, a.layers)}
    classes = [c.strip() for c in a.classes.split(",") if c.strip()]
    if unknown := sorted(set(classes) - set(CLASSES)):
        raise SystemExit(f"--classes: unknown {unknown}; choose from {', '.join(CLASSES)}")
    left = lambda: a.deadline - (time.time() - t_start)  # noqa: E731
    tr = build_trainer(S, W)
    from runtime.mcore.fusions import report as fusion_report
    res["trainer"] = {"fusions": fusion_report(tr.model), "deterministic": tr.train_cfg.deterministic,
                      "core_attention": type(tr.model.decoder.layers[0].self_attention.core_attention).__name__,
                      "norm": type(tr.model.decoder.final_layernorm).__name__,
                      "chunked_logprobs": tr._chunked_logprobs_enabled()}
    R = S["prompts"] * S["samples"]
    eng = build_engine(S, W, R)
    dec = eng.decoder
    reqs, sp = requests(S, eng.vocab_size), sampling(S)
    t0 = time.time()
    base = eng.generate(reqs, sp)
    res["engine"] = {"compiled": dec.compiled, "cuda_graphs": dec.use_graphs, "attention": dec.stats.get("attention"),
                     "prefill_attention": dec.stats.get("prefill_attention"), "generate_s": round(time.time() - t0, 1)}
    base_tlp, res["baseline"] = scored(base, tr)
    rows = []

    def row(name, aligned, stats, same=None, **extra):
        rows.append({"variant": name, "aligned": list(aligned), **stats,
                     **({"samples_vs_baseline": same} if same else {}), **extra})
        print("ROW", json.dumps(rows[-1]), flush=True)

    row("engine (default)", (), res["baseline"])
    # -- batch invariance: a few samples alone against the same samples in the batch
    pick = sorted({round(i * (R - 1) / max(S["alone_rows"] - 1, 1)) for i in range(S["alone_rows"])})
    alone = [eng.generate([r], sp)[0] for r in requests(S, eng.vocab_size, pick)]
    res["batch_invariance"] = {"rows": pick, **agreement(alone, [base[i] for i in pick])}
    # -- preempted and recomputed: a pool that cannot hold the batch, the same keys
    page_bytes = dec.page_size * dec.kv_bytes_per_token()
    need = S["prompts"] * -(-S["prompt_len"] // dec.page_size) + R * -(-S["new"] // dec.page_size)
    small = max(int(0.55 * need), 2) * page_bytes / 2**30
    dec.release()
    pre_eng = build_engine(S, W, R, kv_cache_gb=small, sync_every=4 if S["device"] == "cpu" else 16)
    preempted = pre_eng.generate(reqs, sp)
    res["preemption"] = {"kv_cache_gb": round(small, 4), "preemptions": pre_eng.decoder.stats.get("preemptions"),
                         "reprefill_tokens": pre_eng.decoder.stats.get("reprefill_tokens"),
                         **agreement(preempted, base), "gap": scored(preempted, tr)[1]}
    pre_eng.shutdown()
    del pre_eng
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
    # -- one class at a time, then cumulatively
    from runtime.rollout.decode_model import SETTLE_TOKENS
    K = TrainerKernels(tr, max(S["prompt_len"] + S["new"] + 64, SETTLE_TOKENS))  # the settle call's positions too
    t0 = time.time()
    res["row_invariance"] = row_invariance(S, tr, K, dec)
    print("ROW_INVARIANCE", json.dumps(res["row_invariance"]), f"({time.time() - t0:.1f} s)", flush=True)
    fwd = EngineForward(dec)
    # cumulatively in the given order; attention_common takes the place of attention (one attention per engine)
    cumulative = [("cumulative +" + c, tuple(x for x in classes[:i + 1] if not (
        x == "attention" and "attention_common" in classes[:i + 1]))) for i, c in enumerate(classes) if i > 0]
    alls = [(f"all (= cumulative +{classes[-1]})", cumulative[-1][1])] if cumulative else []
    if "attention" in classes and "attention_common" in classes:  # everything with the trainer's own attention
        alls.append(("all, the trainer's attention", tuple(c for c in classes if c != "attention_common")))
    # the all-aligned rows right after the copy: if the deadline cuts the list, it cuts the partial sums
    plan = [("copy (nothing aligned)", ())] + alls + [(f"align {c}", (c,)) for c in classes] + cumulative[:-1]
    if a.leave_one_out and alls:  # in bf16 one differing bit grows to about the whole gap: what each class carries
        # shows as the gap that comes back when everything but it is aligned
        plan = [("copy (nothing aligned)", ()), alls[0]] + [
            (f"all but {c}", tuple(x for x in alls[0][1] if x != c)) for c in alls[0][1]]
    per_variant_s = None
    for name, aligned in plan:
        if per_variant_s is not None and left() < 1.3 * per_variant_s + 10:
            row(name, aligned, {"status": "SKIPPED", "error": "deadline"})
            continue
        t0 = time.time()
        try:
            fwd.install(aligned, K)
            out = eng.generate(reqs, sp)
            _, st = scored(out, tr, lambda: trainer_common(tr, aligned))
            core_s = time.time() - t0  # what the deadline check expects of a variant (without the extras below)
            extra = {}
            if name.startswith("copy"):
                extra["copy_matches_engine"] = agreement(out, base)["logp_bitwise_equal_frac"] == 1.0 and \
                    all(x.response_ids == y.response_ids for x, y in zip(out, base))
            if name in [n for n, _ in alls]:  # the all-aligned engines: batch invariant?
                solo = [eng.generate([r], sp)[0] for r in requests(S, eng.vocab_size, pick)]
                extra["batch_invariance"] = agreement(solo, [out[i] for i in pick])
            if alls and name == alls[0][0]:  # and its preempted samples: recomputed through its prefill
                pe = build_engine(S, W, R, kv_cache_gb=small, sync_every=4 if S["device"] == "cpu" else 16)
                pf = EngineForward(pe.decoder)
                pf.built = fwd.built  # the pieces compiled for this variant: they hold the model's sizes, no engine
                pf.install(aligned, K)
                pout = pe.generate(reqs, sp)
                extra["preemption"] = {"preemptions": pe.decoder.stats.get("preemptions"), **agreement(pout, out),
                                       "gap": scored(pout, tr, lambda: trainer_common(tr, aligned))[1]}
                pe.shutdown()
                del pe
            row(name, aligned, st, agreement(out, base), s=round(time.time() - t0, 1), **extra)
            per_variant_s = max(per_variant_s or 0.0, core_s)
        except Exception as e:  # noqa: BLE001 - one variant's failure is recorded, the rest still run
            import traceback
            traceback.print_exc()
            row(name, aligned, {"status": "FAILED", "error": f"{type(e).__name__}: {e}"[:800]})
            per_variant_s = max(per_variant_s or 0.0, time.time() - t0)
    res["variants"] = rows
    base_mean = res["baseline"]["mean"]
    for r in rows:
        if "mean" in r and base_mean:
            r["mean_vs_baseline"] = round(r["mean"] / base_mean, 4)
    eng.shutdown()
    return res


def print_table(summary: dict) -> None:
    r = summary.get("result") or {}
    if "error" in summary:
        print("FAILED:", summary["error"])
    rows = [("variant", "tokens", "mean |d|", "x baseline", "p99", "max", "bitwise", "rows same as engine")]
    for v in r.get("variants", []):
        if "mean" not in v:
            rows.append((v["variant"], v.get("status", "-"), str(v.get("error", ""))[:60], "", "", "", "", ""))
            continue
        same = (v.get("samples_vs_baseline") or {}).get("rows_identical", "-")
        rows.append((v["variant"], v["tokens"], f"{v['mean']:.3g}", v.get("mean_vs_baseline", "-"), f"{v['p99']:.3g}",
                     f"{v['max']:.3g}", v["bitwise_equal_frac"], same))
    H.print_columns(rows)
    if r.get("row_invariance"):
        H.print_columns([("kernel, engine shape vs trainer shape", "bitwise", "max |diff|")] + [
            (k, v["bitwise"], f"{v['max_abs']:.3g}") for k, v in r["row_invariance"].items() if isinstance(v, dict)])
    for k in ("batch_invariance", "preemption"):
        if k in r:
            print(k, json.dumps(r[k]))
    for v in r.get("variants", []):
        for k in ("batch_invariance", "preemption"):
            if k in v:
                print(f"{v['variant']}: {k}", json.dumps(v[k]))


def main(argv=None) -> int:
    ap = H.parser(__doc__, "logp_gap_attribution", 450.0, section=False)
    ap.add_argument("--family", choices=sorted(KNOWN), default="qwen3")
    ap.add_argument("--layers", type=int, default=None, help="cut the known config to this many layers")
    ap.add_argument("--classes", default=",".join(CLASSES),
                    help=f"kernel classes to align, in the cumulative order (of {', '.join(CLASSES)})")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="rows: everything aligned, then everything but each class (instead of each class alone and "
                         "the partial sums)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="both sides' dtype (default: bfloat16 on the GPU, float32 with --cpu)")
    a = ap.parse_args(argv)
    S = dict(SHAPES["cpu" if a.cpu else "gpu"])
    if a.dtype:
        S["dtype"] = a.dtype
    out, W = H.start(a, "logp_gap_attribution")
    if a.cpu:
        _torch().set_num_threads(1)
    t_start = time.time()
    summary = {**H.summary_head("logp_gap_attribution", H.env_info(S)), "shapes": S, "family": a.family,
               "classes": a.classes}
    H.run_into(summary, lambda: run(S, W, a, t_start), t_start)
    H.save_summary(summary, out, "logp_gap_attribution", a.results_dir, a.cpu)
    print_table(summary)
    variants = summary.get("result", {}).get("variants", [])
    failed = "error" in summary or any(v.get("status") == "FAILED" for v in variants)
    return 1 if a.cpu and failed else 0


if __name__ == "__main__":
    sys.exit(main())
