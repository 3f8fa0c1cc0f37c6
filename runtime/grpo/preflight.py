"""Checks of a config that need more than its own fields (user code to import), run by `grpoflow
validate` and again before the train stage builds anything: whatever the train stage would refuse,
validate refuses first — except what "auto" resolves to on the machine a run starts on (check_this_machine),
checked by the run before it writes anything."""
from __future__ import annotations

from runtime.config import GrpoConfig


def check_trainable(cfg: GrpoConfig) -> None:
    """Raise ConfigError (one line) for a reward or custom rollout that cannot be loaded, or prompts and responses
    that cannot fit the model's positions (where its config is known before the fetch)."""
    from runtime.inputs.context import check_context
    from runtime.rewards.catalog import get_reward_fn
    check_context(cfg)
    get_reward_fn(cfg.rollout.reward)
    if cfg.rollout.custom_rollout:
        from runtime.rollout.custom import load_custom_rollout
        load_custom_rollout(cfg.rollout.custom_rollout)


def check_this_machine(cfg: GrpoConfig) -> None:
    """Raise ConfigError (one line) for what "auto" settings resolve to on the machine the run starts on
    (validate checks a config for any machine, so these are not its checks)."""
    from runtime.devices import resolve_device, resolve_dtype
    from runtime.errors import ConfigError
    device = resolve_device(cfg)
    if cfg.train.optimizer_on_host and resolve_dtype(cfg, device) == "float32":
        raise ConfigError(f"train.optimizer_on_host keeps an fp32 master of half-precision weights on the host, "
                          f"but model.dtype: {cfg.model.dtype} means float32 weights here (device {device}), which "
                          f"are their own master; set model.dtype: bfloat16 or train.optimizer_on_host: false")


def check_fits(cfg: GrpoConfig, run_dir: str | None = None) -> None:
    """Raise ConfigError (one line naming settings that would fit) when the memory plan says the run
    does not fit `cluster.gpu_memory_gb` (when unset: this machine's GPU, 80 GiB without one), or, given the run's
    directory, the disk plan says it does not fit the free space where it writes (and `storage.disk_gb`)."""
    from runtime.errors import ConfigError
    from runtime.plan.summary import disk_report, memory_report
    _, does_not_fit = memory_report(cfg)
    if does_not_fit:
        raise ConfigError(does_not_fit)
    if run_dir is not None:
        _, does_not_fit = disk_report(cfg, run_dir)
        if does_not_fit:
            raise ConfigError(does_not_fit)
