"""Which device and dtype a run uses, the one map from dtype names (as the config spells them) to torch, and
what running out of device memory looks like."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.config import GrpoConfig

# The dtype names a config or a weight-sync message may carry, and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: GrpoConfig) -> str:
    """`cluster.device`, with "auto" meaning CUDA where this process sees a GPU, else the CPU."""
    if cfg.cluster.device != "auto":
        return cfg.cluster.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def this_machine_gpu_gb() -> float | None:
    """The memory of this machine's first GPU in GiB (to 0.1), None where this process sees none."""
    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)


def resolve_dtype(cfg: GrpoConfig, device: str) -> str:
    """`model.dtype`, with "auto" meaning bf16 on a GPU and fp32 on the CPU."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    return "bfloat16" if device == "cuda" else "float32"


def make_current(device: str) -> None:
    """Make a `cuda:N` device the current one (no-op otherwise): CUDA graphs capture on the current device,
    so an engine must be built with its own GPU current."""
    if device.startswith("cuda:"):
        torch.cuda.set_device(int(device.split(":")[1]))


def out_of_memory_error(error: BaseException | None) -> BaseException | None:
    """The device running out of memory in `error` or its cause/context chain (where a compiler or kernel
    library wrapped it): the first `torch.OutOfMemoryError` (CUDA's, also named `torch.cuda.OutOfMemoryError`;
    a RuntimeError, not a MemoryError) or error whose text says "out of memory"; None when there is none."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
            return error
        error = error.__cause__ or error.__context__
    return None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is (or wraps) the device running out of memory (`out_of_memory_error`)."""
    return out_of_memory_error(error) is not None
