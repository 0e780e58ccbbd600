"""The error every boundary (config, CLI, HTTP) turns into a clear message naming the field at fault."""
from __future__ import annotations


class ConfigError(ValueError):
    """Invalid user input; `field` names what was wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
