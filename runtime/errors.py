"""Errors a user can fix. The CLI prints them as one line and exits 2; nothing else is caught."""

# An error line's most characters: a quoted value can be megabytes (a list that YAML aliases multiplied).
MAX_ERROR_LINE = 1000


def error_line(message: object, limit: int = MAX_ERROR_LINE) -> str:
    """``message`` as one printable line: whitespace joined, secrets masked (runtime.secrets), at most ``limit``
    characters — cut in the middle, so the field (first) and the fix (last) both stay."""
    from runtime.secrets import redact_text
    line = redact_text(" ".join(str(message).split()))
    if len(line) <= limit:
        return line
    head = (limit - 3) * 2 // 3
    return f"{line[:head]} … {line[len(line) - (limit - 3 - head):]}"


class UserError(Exception):
    """A mistake in the user's config, files or environment. The message names what and how to fix it."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(error_line(message))  # always one bounded line, secrets masked


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


class TrainingDiverged(UserError):
    """The loss, gradient norm or weights became inf or NaN: the run stops before anything of it is saved."""
