"""Where everything of one run lives: ``<storage.root>/runs/<run_id>/`` (local dir or S3 prefix).

On a remote root, code that needs local files (megatron, transformers, the trainer) asks
``rd.local(uri)`` for a local copy; it is kept under ``<storage.state_dir>/scratch`` (or a temp dir)
and downloaded once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from runtime import storage
from runtime.errors import ConfigError

# A run id names a directory under <root>/runs/: one path component, no '..', no hidden names.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r}: use 1-128 letters, digits, '.', '_' and '-', starting with a "
                          f"letter or digit (it names the directory runs/<run id>)")
    return run_id


def resume_command(run_id: str, root: str) -> str:
    """The command that continues run `run_id` under storage root `root`."""
    return f"grpoflow resume {run_id} --root {root}"


@dataclass(frozen=True)
class RunDir:
    root: str  # storage.root
    run_id: str
    state_dir: str | None = field(default=None, compare=False)  # storage.state_dir: local scratch for a remote root

    def __post_init__(self) -> None:
        check_run_id(self.run_id)  # before anything is written: an id like ../x would escape the root

    @property
    def remote(self) -> bool:
        return storage.is_remote(self.root)

    def checked(self) -> "RunDir":
        """This run dir, after checking that its root can be used (a remote one: bucket there, credentials
        accepted, endpoint reachable; a local one, and the local state dir: writable); raises a one-line
        StorageError / ConfigError otherwise, before anything is written."""
        storage.check_root(self.root)
        storage.check_writable(self.path, "storage.root", shown=self.root)
        if self.state_dir:
            storage.check_writable(self.state_dir, "storage.state_dir")
        return self

    def local(self, uri: str) -> str:
        """A local path holding ``uri`` (a file or a directory of this run): ``uri`` itself when the run
        is local, else a copy under the scratch dir, downloaded on first use."""
        return storage.local_copy(uri, self.state_dir)

    def staged(self, uri: str):
        """Where the local copy of remote ``uri`` lives (nothing is downloaded)."""
        return storage.staged_path(uri, self.state_dir)

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

    def export_adapter(self, rollout: int) -> str:
        """The LoRA adapter alone, in PEFT's layout (a LoRA run's export beside the merged ``hf``)."""
        return self.sub("exports", f"rollout_{rollout}", "adapter")

    def eval_result(self, rollout: int) -> str:
        return self.sub("eval", f"rollout_{rollout}.json")

    def stage_marker(self, stage: str) -> str:
        return self.sub("stages", f"{stage}.json")
