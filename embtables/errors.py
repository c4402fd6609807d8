"""Error types and message helpers.

Every error raised by embtables says who (feature or table), which rule was broken, what was
received and how to fix it. The classes subclass the builtin types users already catch.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value breaks a documented rule."""


class InputError(ValueError):
    """A batch of ids, weights or gradients breaks a documented rule; nothing was changed."""
