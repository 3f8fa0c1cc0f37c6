"""What a pool of SGLang servers runs with: the `rollout.sglang` section itself, plus what the rest of the
config decides for it (memory saver when colocated, the run's seed, the trainer's collective backend)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Literal

from runtime.config import GrpoConfig, SGLangSection
from runtime.devices import resolve_device
from runtime.errors import ConfigError
from runtime.placement.weight_sync import backend_for

# the SGLang releases the client speaks to (pyproject's `sglang` extra pins the same): 0.5.17 ran on an H200,
# 0.5.23's API (read from its source, http_protocol.py) is what tests/sglang_standin.py speaks by default
SUPPORTED_SGLANG = ">=0.5.17,<0.6"
INSTALL_HINT = "pip install 'grpoflow[sglang]'"


@dataclass(frozen=True)
class Supervision:
    """How closely the client watches its servers. These decide how soon a fault is noticed, never what is
    sampled, so they are not config settings; tests shrink them."""

    health_timeout_s: float = 20.0  # one health check of a suspect server
    health_poll_s: float = 0.5      # start-up polling interval
    kill_grace_s: float = 15.0      # SIGTERM -> SIGKILL
    max_attempts: int = 4           # tries per request


@dataclass(frozen=True)
class SGLangSettings:
    section: SGLangSection = field(default_factory=SGLangSection)
    colocate: bool = False          # --enable-memory-saver; release/resume memory around training
    random_seed: int | None = None  # --random-seed
    # the torch.distributed backend the servers join a weight-sync group with: the trainer's (nccl when the
    # trainer runs on CUDA; gloo, on CPU, only the stand-in can take)
    sync_backend: Literal["nccl", "gloo"] = "nccl"
    routing_replay: bool = False    # rollout.routing_replay: servers return each token's experts (routes.py)
    supervision: Supervision = field(default_factory=Supervision)

    def __post_init__(self):
        if self.sync_backend not in ("nccl", "gloo"):
            raise ConfigError(f"SGLang sync_backend must be 'nccl' or 'gloo', got {self.sync_backend!r}")

    @classmethod
    def from_config(cls, cfg: GrpoConfig, supervision: Supervision | None = None) -> "SGLangSettings":
        return cls(section=cfg.rollout.sglang, colocate=bool(cfg.cluster.colocate), random_seed=int(cfg.train.seed),
                   sync_backend=backend_for(resolve_device(cfg)), routing_replay=bool(cfg.rollout.routing_replay),
                   supervision=supervision or Supervision())

    def launch_prefix(self) -> list[str]:
        """The server command before grpoflow's flags: `rollout.sglang.launch` with "{python}" = this Python."""
        if not self.section.launch:
            return [sys.executable, "-m", "sglang.launch_server"]
        return [sys.executable if part == "{python}" else str(part) for part in self.section.launch]

    def uses_real_sglang(self) -> bool:
        prefix = self.launch_prefix()
        return any(a == "sglang.launch_server" for a in prefix) and prefix[0] == sys.executable


def check_sglang_installed(settings: SGLangSettings) -> None:
    """One line naming the install command when the launch command needs `sglang` in this Python."""
    if settings.uses_real_sglang() and importlib.util.find_spec("sglang") is None:
        raise ConfigError(f"rollout.engine=sglang needs the sglang package, which is not installed: {INSTALL_HINT}")
