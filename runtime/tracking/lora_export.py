"""Exports of a LoRA checkpoint (its ``model/`` holds adapters and their optimizer state, not the base):

* the merged HF model (what eval and the registry serve): the run's converted base with ``W + scale B A``
  computed in fp32 on the host, then cast to the model's dtype (merging in bf16 would round the update
  away where it is small against W);
* the adapter alone in PEFT's layout (``runtime/models/peft_layout.py``), for serving with the base.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from runtime import storage
from runtime.errors import ModelError
from runtime.mcore.cpu_job import cpu_job
from runtime.testing.moments import moment


@cpu_job
def load_merged(ckpt_model_dir: str | Path, base_dir: str | Path, hf_config, lora) -> tuple[dict, dict]:
    """(whole megatron weights with the adapters merged in, fp32; the adapters) of a LoRA checkpoint whose
    base is the torch_dist checkpoint ``base_dir``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from runtime.mcore.convert import _quiet_checkpoint_warnings, load_torch_dist_into
    from runtime.mcore.env import build_gpt_model, cuda_to_cpu
    from runtime.trainer import lora as lora_model
    from runtime.trainer import master_weights

    model = build_gpt_model(hf_config, dtype=torch.float32, device="cpu", init_weights=False)
    load_torch_dist_into(model, base_dir)
    lora_model.attach(model, lora, seed=0)  # the initial values are replaced by the checkpoint's
    trained = master_weights.marked_dtype(ckpt_model_dir)
    with cuda_to_cpu(), _quiet_checkpoint_warnings():
        try:
            sharded = lora_model.sharded_state_dict(model)
            if trained is None:
                loaded = dist_checkpointing.load({"model": sharded}, str(ckpt_model_dir))["model"]
            else:  # the adapters are their fp32 masters rounded to the trained dtype: the trainer's, bitwise
                loaded = master_weights.read_weights(sharded, ckpt_model_dir, trained)
        except CheckpointingException as e:
            raise ModelError(f"{ckpt_model_dir}: its adapters do not fit the model built from config.json "
                             f"({str(e)[:200]})") from None
    lora_model.load_adapters(model, loaded)
    adapters = lora_model.adapter_tensors(model)
    base = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
    return lora_model.merge(base, adapters, lora.scale), adapters


def export_adapter(adapters: dict[str, torch.Tensor], hf_config, lora, out_dir: str, *, base_model: str,
                   provenance: dict | None = None) -> dict[str, Any]:
    """The adapter alone in PEFT's layout at ``out_dir`` (local or remote), published atomically with its
    config last. Tensors in the model's dtype."""
    import json

    from safetensors.torch import save_file

    from runtime.mcore.convert import _config_dtype
    from runtime.models.peft_layout import PEFT_CONFIG, PEFT_WEIGHTS, adapter_config, to_peft

    dtype = _config_dtype(hf_config)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_peft(adapters, hf_config).items()}
    config = adapter_config(lora, tensors, base_model)
    with storage.publish_dir(out_dir, last=[PEFT_CONFIG]) as tmp:
        save_file(tensors, str(Path(tmp) / PEFT_WEIGHTS), metadata={"format": "pt"})
        (Path(tmp) / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    moment("adapter-exported")
    return {"path": out_dir, "files": [PEFT_CONFIG, PEFT_WEIGHTS], "n_tensors": len(tensors),
            "target_modules": config["target_modules"], "dtype": str(dtype).removeprefix("torch."),
            "created": time.time(), **(provenance or {})}


def adapter_complete(out_dir: str) -> bool:
    from runtime.models.peft_layout import PEFT_CONFIG
    return storage.exists(storage.join(out_dir, PEFT_CONFIG))


__all__ = ["load_merged", "export_adapter", "adapter_complete"]
