"""Log levels, as sd-daemon(3) priorities: every log call states one, never inferred from its words."""

ERR, WARNING, INFO = 3, 4, 6

# a run's end that is trouble for its agent (the others are the ring's ordinary turns)
_TROUBLE = frozenset({"failed", "timeout", "stalled", "error"})


def of_end(status: str) -> int:
    """The level of the line that says how a run ended."""
    return WARNING if status in _TROUBLE else INFO
