"""Where everything of one run lives: ``<storage.root>/runs/<run_id>/`` (local dir or S3 prefix)."""
from __future__ import annotations

from dataclasses import dataclass

from . import storage


@dataclass(frozen=True)
class RunDir:
    root: str  # storage.root
    run_id: str

    @property
    def path(self) -> str:
        return storage.join(self.root, "runs", self.run_id)

    def sub(self, *parts: str) -> str:
        return storage.join(self.path, *parts)

    @property
    def config(self) -> str:
        return self.sub("config.yaml")

    @property
    def hf_model(self) -> str:
        return self.sub("model", "hf")

    @property
    def torch_dist(self) -> str:
        return self.sub("model", "torch_dist")

    @property
    def train_data(self) -> str:
        return self.sub("data", "train.parquet")

    def eval_data(self, name: str) -> str:
        return self.sub("data", "eval", f"{name}.parquet")

    @property
    def checkpoints(self) -> str:
        return self.sub("checkpoints")

    def checkpoint(self, rollout: int) -> str:
        return self.sub("checkpoints", f"rollout_{rollout}")

    @property
    def latest(self) -> str:
        return self.sub("checkpoints", "latest")

    def export(self, rollout: int) -> str:
        return self.sub("exports", f"rollout_{rollout}", "hf")

    def eval_result(self, rollout: int) -> str:
        return self.sub("eval", f"rollout_{rollout}.json")

    def stage_marker(self, stage: str) -> str:
        return self.sub("stages", f"{stage}.json")
