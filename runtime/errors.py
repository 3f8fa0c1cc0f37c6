"""Errors a user can fix. The CLI prints them as one line and exits 2; nothing else is caught."""


class UserError(Exception):
    """A mistake in the user's config, files or environment. The message names what and how to fix it."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class ModelError(UserError):
    pass


class TransientError(Exception):
    """Network or I/O trouble worth a retry (the Prefect tasks retry only these)."""


class MemoryPlanError(UserError, MemoryError):
    """What a step needs does not fit the memory it has (the device ran out, or the KV pool is too small for
    one sequence). The message names the plan's numbers and the setting to change."""
