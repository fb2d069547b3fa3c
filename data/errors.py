"""Errors a user can fix: the command-line entry points print these as one line, no traceback.

`DraftsmithError` is the common base. It lives in data/, the lowest layer, so that every package
(data, heads, train, eval) can subclass it without breaking the import order. Subclasses that
describe a bad value also derive from ValueError, so callers catching ValueError still work.
A message names the path or setting at fault and the fix, in one line.
"""

from __future__ import annotations


class DraftsmithError(Exception):
    """Something in the user's data, config or files is wrong; the message says what to do."""


class ConfigError(DraftsmithError, ValueError):
    """A setting is out of range or contradicts another one."""


class NonFiniteError(DraftsmithError, ValueError):
    """A loss, gradient or weight is inf/NaN: training diverged or its inputs overflowed."""


class FeatureRangeError(DraftsmithError, ValueError):
    """Target features do not fit the dtype chosen to store them (e.g. above float16's 65504)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a long step; the message says what was kept and how to continue. A
    KeyboardInterrupt still, so code that lets Ctrl-C through lets this through."""
