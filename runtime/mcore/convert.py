"""HF <-> megatron ``torch_dist`` conversion, with a logit-parity check that proves the mapping.

``hf_to_torch_dist`` is the product's "convert" stage: it refuses to write a checkpoint whose logits
differ from Hugging Face's own (eager attention, same dtype, same device) by more than a tolerance, so a
wrong mapping fails here, not as a silently worse training run. ``torch_dist_to_hf`` is the export.

Both take the device (``cpu``, ``cuda``, ``auto``: the GPU where there is one) and the dtype they write in
(the trainer's: bf16 for a bf16 run, so a 9B model converts to 18.8 GB, not 37.6 GB of fp32). On the CPU
they run on a CPU parallel state (a fresh one, or the process's: torch.distributed can be started only once
per process); on a GPU in a process of their own (runtime/mcore/cpu_job.py's ``device_job``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from runtime.errors import ModelError
from runtime.mcore.cpu_job import device_job
from runtime.models import get_adapter, load_hf_config
from runtime.storage import atomic_dir, write_json_atomic

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PARITY_FILE = "parity.json"
# What an export copies from the source HF dir besides the weights (those present are copied).
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "vocab.json", "merges.txt", "tokenizer.model",
)
MAX_SHARD_BYTES = 5 * 1024**3


# ---- HF weights -----------------------------------------------------------------------------------
def _load_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise ModelError(f"{path} is missing (listed in {SAFETENSORS_INDEX}); re-download the model")
    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError / OSError: a header or data region that is not there
        raise ModelError(f"{path} is truncated or corrupt ({str(e)[:200]}); re-download the model") from None


def load_hf_state_dict(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF model dir: every shard named by the index, or the single file."""
    hf_dir = Path(hf_dir)
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"{index} is truncated or corrupt ({e}); re-download the model") from None
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(_load_safetensors_file(hf_dir / shard))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise ModelError(f"{index} names tensors no shard holds ({missing[0]}, ...); re-download the model")
        return state
    single = hf_dir / SAFETENSORS_SINGLE
    if single.is_file():
        return _load_safetensors_file(single)
    if any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise ModelError(f"{hf_dir} has only pickle weights (.bin/.pt); save the model as safetensors "
                         f"(save_pretrained(..., safe_serialization=True))")
    raise ModelError(f"{hf_dir} has no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}: no weights to convert")


def save_hf_state_dict(state: Mapping[str, torch.Tensor], out_dir: str | os.PathLike,
                       max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write tensors as HF does: one ``model.safetensors``, or numbered shards plus an index."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SAFETENSORS_SINGLE), metadata={"format": "pt"})
        return [SAFETENSORS_SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_json_atomic(str(out_dir / SAFETENSORS_INDEX),
                      {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names + [SAFETENSORS_INDEX]


def as_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    from runtime.devices import DTYPES

    if dtype is None:
        return default
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


# A low-precision conversion is checked against the fp32 truth (HF eager in fp32) with a bound calibrated on
# the model itself: HF's own model in that dtype is off the truth by some `noise` (bf16 rounding over the
# layers: 0.01 on the tiny Qwen3, 0.14 of logits up to 5 on a random-norm one); ours may be off by twice that
# (plus model.parity_tolerance). Measured: ours is off by ~0.85x HF's noise; a swapped gate/up or q/k/v group
# by 8x to 100x it.
NOISE_FACTOR = 2.0


def parity_bound(dtype: torch.dtype, tolerance: float, reference_noise: float) -> float:
    """The max |logit diff| from HF fp32 a conversion in ``dtype`` may show: ``tolerance``
    (model.parity_tolerance) in fp32; ``NOISE_FACTOR`` x ``reference_noise`` (HF's own model in ``dtype`` vs
    fp32) + ``tolerance`` in bf16/fp16."""
    return tolerance if dtype == torch.float32 else NOISE_FACTOR * reference_noise + tolerance


def _config_dtype(hf_config) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


# ---- torch_dist -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_checkpoint_warnings() -> Iterator[None]:
    """torch.distributed.checkpoint deprecations raised inside megatron's torch_dist strategy: not
    ours to act on, and they would print on every save/load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*`load_state_dict` is deprecated.*")
        warnings.filterwarnings("ignore", message=r".*deprecating ShardedTensor.*")
        yield


def _require_single_process(what: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise RuntimeError(f"{what} converts in a single process (TP=1); torch.distributed has "
                           f"world size {dist.get_world_size()}")


def _check_torch_dist_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelError(f"torch_dist checkpoint does not exist: {path}")
    if not (path / "metadata.json").is_file():
        raise ModelError(f"{path} is not a torch_dist checkpoint (no metadata.json); "
                         f"convert an HF model with hf_to_torch_dist first")


@contextlib.contextmanager
def atomic_dist_dir(final: str | os.PathLike) -> Iterator[Path]:
    """``storage.atomic_dir`` for a collective write: every rank writes into one scratch dir that
    rank 0 renames to ``final`` after all ranks are done."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        with atomic_dir(final) as tmp:
            yield tmp
        return
    with contextlib.ExitStack() as stack:
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            box[0] = str(stack.enter_context(atomic_dir(final)))
        dist.broadcast_object_list(box, src=0)
        yield Path(box[0])
        dist.barrier()  # all shards written before rank 0 renames
    dist.barrier()  # nobody reads `final` before it exists


def save_model_torch_dist(model, out_dir: str | os.PathLike, *,
                          extra_json: Mapping[str, Any] | None = None) -> Path:
    """Save a megatron model (any wrapper; collective over all ranks) as a torch_dist checkpoint,
    atomically; ``extra_json`` files (name -> object) are written into the same directory."""
    from megatron.core import dist_checkpointing

    from runtime.mcore.env import cuda_to_cpu, save_results_in_this_process, unwrap_model

    gpt = unwrap_model(model)
    save_results_in_this_process()
    with atomic_dist_dir(out_dir) as tmp:
        with cuda_to_cpu(), _quiet_checkpoint_warnings():
            dist_checkpointing.save(gpt.sharded_state_dict(), str(tmp))
        for name, obj in (extra_json or {}).items():
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() == 0:
                write_json_atomic(str(tmp / name), obj)
    return Path(out_dir)


def load_torch_dist_into(model, ckpt_dir: str | os.PathLike) -> None:
    """Load a torch_dist checkpoint into a megatron model (any wrapper, any TP: dist_checkpointing
    reshards), strictly."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from runtime.mcore.env import cuda_to_cpu, unwrap_model

    ckpt_dir = Path(ckpt_dir)
    _check_torch_dist_dir(ckpt_dir)
    gpt = unwrap_model(model)
    with cuda_to_cpu(), _quiet_checkpoint_warnings():
        try:
            state = dist_checkpointing.load(gpt.sharded_state_dict(), str(ckpt_dir))
        except CheckpointingException as e:
            raise ModelError(f"{ckpt_dir} does not match the model ({str(e)[:200]}); "
                             f"was it converted from the same config.json?") from None
    gpt.load_state_dict(state, strict=True)


def _load_mapped_weights(model, mcore_state: Mapping[str, torch.Tensor], source: Path) -> None:
    try:
        result = model.load_state_dict(dict(mcore_state), strict=False)
    except RuntimeError as e:  # size mismatch
        raise ModelError(f"{source}: weights do not fit the model built from config.json "
                         f"({str(e)[:200]})") from None
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ModelError(f"{source}: the mapped weights do not match the megatron model "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")


# ---- parity -------------------------------------------------------------------------------------
def probe_batch(vocab_size: int, shape: tuple[int, int] = (2, 32), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=g)


@torch.no_grad()
def mcore_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits [b, s, V] of a TP=1 megatron GPTModel on a causal batch (on the ids' device)."""
    from runtime.mcore.env import causal_attention_mask

    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    return model(input_ids, positions, causal_attention_mask(b, s, input_ids.device)).float()


@torch.no_grad()
def hf_logits(hf_dir: str | os.PathLike, input_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of the HF model (eager attention) in ``dtype`` on the ids' device; the model is freed after."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, attn_implementation="eager",
                                              device_map={"": input_ids.device})
    hf.eval()
    out = hf(input_ids=input_ids).logits.float()
    del hf
    return out


def _weight_bytes(hf_dir_arg_index: int = 0, with_fp32_reference: bool = False):
    """``device_job``'s GPU need of a conversion: the megatron model in the job's dtype beside the HF fp32
    reference (a conversion's parity check) or its HF-named copy (an export), with 15 % to spare."""
    def need(*args, dtype=None, **kwargs) -> int:
        from runtime.plan.memory import param_counts

        config_dir = kwargs.get("hf_config_dir") or kwargs.get("hf_dir") or args[hf_dir_arg_index]
        n, _ = param_counts(load_hf_config(Path(config_dir)))
        size = as_dtype(dtype).itemsize
        return int(1.15 * n * (size + (4 if with_fp32_reference else size)))
    return need


# ---- the two conversions --------------------------------------------------------------------------
@device_job(_weight_bytes(0, with_fp32_reference=True))
def hf_to_torch_dist(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tolerance: float = 1e-4,
                     dtype: torch.dtype | str = torch.float32, device: str = "cpu", probe_seed: int = 0,
                     probe_shape: tuple[int, int] = (2, 32)) -> dict[str, Any]:
    """Convert a local HF model dir to a megatron torch_dist checkpoint (TP=1) in ``dtype`` in ``out_dir``,
    on ``device`` ("cpu", "cuda", or "auto": the GPU where there is one with room).

    The converted model's logits on a seeded probe batch are compared with HF eager fp32 on the same device;
    a max |logit diff| above :func:`parity_bound` (``tolerance`` in fp32; scaled by HF's own error in
    ``dtype`` otherwise) raises ModelError and nothing is written. ``out_dir`` also gets ``parity.json``;
    the same report is returned.
    """
    from runtime.mcore.env import build_gpt_model

    t0 = time.time()
    dtype = as_dtype(dtype)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf_config = load_hf_config(hf_dir)
    adapter = get_adapter(hf_config)
    hf_state = load_hf_state_dict(hf_dir)
    mcore_state = {k: v.to(dtype) for k, v in adapter.from_hf(hf_state, hf_config).items()}
    del hf_state

    _require_single_process("hf_to_torch_dist")
    model = build_gpt_model(hf_config, dtype=dtype, device=device, init_weights=False)
    _load_mapped_weights(model, mcore_state, hf_dir)
    del mcore_state
    model.eval()
    t_load = time.time() - t0

    ids = probe_batch(hf_config.vocab_size, tuple(probe_shape), probe_seed).to(next(model.parameters()).device)
    ours = mcore_logits(model, ids)
    ref = hf_logits(hf_dir, ids, torch.float32)
    noise = 0.0 if dtype == torch.float32 else (hf_logits(hf_dir, ids, dtype) - ref).abs().max().item()
    diff = (ours - ref).abs().max().item()
    lp_diff = (torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs().max().item()
    max_logit = ref.abs().max().item()
    bound = parity_bound(dtype, tolerance, noise)
    if not diff <= bound:  # `not <=` also catches NaN
        noisy = "" if dtype == torch.float32 else f" (2 x {noise:.3g}, HF's own {str(dtype).removeprefix('torch.')} error, + parity_tolerance)"
        raise ModelError(
            f"{hf_dir}: megatron logits ({str(dtype).removeprefix('torch.')}, {device}) differ from Hugging Face fp32 "
            f"by max |logit diff| {diff:.3e} > tolerance {bound:.3g}{noisy}; the {hf_config.model_type} mapping "
            f"does not fit this checkpoint (raise model.parity_tolerance only if the difference is numerical noise)")
    report = {
        "model_type": hf_config.model_type,
        "source": str(hf_dir),
        "n_params": sum(p.numel() for p in model.parameters()),
        "tie_word_embeddings": bool(hf_config.tie_word_embeddings),
        "max_abs_logit_diff": diff,
        "max_abs_logprob_diff": lp_diff,
        "max_abs_logit": max_logit,
        "tolerance": bound,
        "probe_shape": list(ids.shape),
        "probe_seed": probe_seed,
        "reference": f"transformers eager attention, float32, {device}",
        "reference_noise": noise,  # HF's own model in `dtype` against its fp32: what the bound is scaled by
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "tensor_parallel": 1,
    }
    del ours, ref
    t_save = time.time()
    save_model_torch_dist(model, out_dir, extra_json={PARITY_FILE: report})
    report["seconds"] = round(time.time() - t0, 3)
    report["seconds_load"] = round(t_load, 3)
    report["seconds_save"] = round(time.time() - t_save, 3)
    report["path"] = str(out_dir)
    return report


def loading_dtype(device: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint is loaded in for an export in ``dtype``: on the GPU ``dtype`` itself (a bf16
    checkpoint loads as it is); on the host fp32 (the CPU path as it was: any stored dtype casts exactly up)."""
    return dtype if device == "cuda" else torch.float32


def hf_named_weights(model, hf_config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A megatron model's weights under HF names, in ``dtype`` on the host (ready for safetensors)."""
    adapter = get_adapter(hf_config)
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in adapter.to_hf(model.state_dict(), hf_config).items()}


@device_job(_weight_bytes(1))
def torch_dist_to_hf(torch_dist_dir: str | os.PathLike, hf_config_dir: str | os.PathLike,
                     out_dir: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                     device: str = "cpu") -> dict[str, Any]:
    """Export a torch_dist checkpoint to an HF model dir (atomically), loading it on ``device``.

    The architecture comes from ``hf_config_dir``'s config.json; its config, generation config and
    tokenizer files are copied. Weights are written in ``dtype`` (default: the config's dtype, so a
    bf16 model exports as bf16); tied embeddings write no ``lm_head.weight``, as ``save_pretrained``.
    """
    from runtime.mcore.env import build_gpt_model

    t0 = time.time()
    torch_dist_dir, hf_config_dir, out_dir = Path(torch_dist_dir), Path(hf_config_dir), Path(out_dir)
    hf_config = load_hf_config(hf_config_dir)
    _check_torch_dist_dir(torch_dist_dir)

    _require_single_process("torch_dist_to_hf")
    dtype = as_dtype(dtype, _config_dtype(hf_config))
    model = build_gpt_model(hf_config, dtype=loading_dtype(device, dtype), device=device, init_weights=False)
    load_torch_dist_into(model, torch_dist_dir)
    hf_state = hf_named_weights(model, hf_config, dtype)
    del model

    with atomic_dir(out_dir) as tmp:
        files = save_hf_state_dict(hf_state, tmp)
        for name in HF_SIDE_FILES:
            if (hf_config_dir / name).is_file():
                shutil.copyfile(hf_config_dir / name, tmp / name)
                files.append(name)
    return {
        "path": str(out_dir),
        "model_type": hf_config.model_type,
        "files": sorted(files),
        "n_tensors": len(hf_state),
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "seconds": round(time.time() - t0, 3),
    }


__all__ = [
    "hf_to_torch_dist", "torch_dist_to_hf", "load_torch_dist_into", "save_model_torch_dist",
    "load_hf_state_dict", "save_hf_state_dict", "atomic_dist_dir", "probe_batch", "mcore_logits",
    "hf_logits", "parity_bound", "as_dtype", "hf_named_weights", "loading_dtype",
]
