"""Model families and the registry that picks one from a Hugging Face config.

A family is one module here with a ``ModelAdapter`` subclass; add it to ``_FAMILIES``
(docs/model-families.md walks through it).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.errors import ModelError
from runtime.models.base import ModelAdapter
from runtime.models.glm4 import Glm4Adapter
from runtime.models.llama import LlamaAdapter
from runtime.models.qwen2 import Qwen2Adapter
from runtime.models.qwen3 import Qwen3Adapter
from runtime.models.qwen3_moe import Qwen3MoeAdapter

_FAMILIES: tuple[type[ModelAdapter], ...] = (Qwen3Adapter, Qwen3MoeAdapter, Qwen2Adapter, LlamaAdapter, Glm4Adapter)
_REGISTRY: dict[str, type[ModelAdapter]] = {t: cls for cls in _FAMILIES for t in cls.model_types}


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def get_adapter(hf_config_or_model_type: Any) -> ModelAdapter:
    """The adapter for an HF config (or a ``model_type`` string)."""
    if isinstance(hf_config_or_model_type, str):
        model_type = hf_config_or_model_type
    else:
        model_type = getattr(hf_config_or_model_type, "model_type", None)
    cls = _REGISTRY.get(model_type)
    if cls is None:
        raise ModelError(
            f"model_type '{model_type}' is not supported (supported: {', '.join(supported_model_types())}); "
            f"add a family in runtime/models/ (see docs/model-families.md)")
    return cls()


def load_hf_config(model_dir: str | os.PathLike):
    """The transformers config of a local HF model dir, with one-line errors for the usual mistakes."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelError(f"model path does not exist: {model_dir} (give a local dir, hf://org/name or s3://...)")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: not a Hugging Face model directory")
    import json

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}/config.json is not valid JSON ({e}); re-download the model") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise ModelError(f"{path}/config.json has no model_type: not a Hugging Face transformers config")
    get_adapter(model_type)  # refuse unsupported families before importing their code
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=False)


__all__ = ["ModelAdapter", "get_adapter", "load_hf_config", "supported_model_types"]
