"""A reward with no dependencies for speed runs on random models (TRL's benchmark uses the same:
the response length modulo 13), so reward scoring costs nothing and the group advantages are non-zero."""

FAIL_VALUE = 0.0


def length_mod13(response: str, label: str, metadata: dict | None = None) -> float:
    return float(len(response) % 13)
