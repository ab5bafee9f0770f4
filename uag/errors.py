"""The one line between "you can fix this" and "we have a bug".

`UserError` (and its kinds) carries a message meant for the person at the keyboard: a bad setting, an
empty prompt, a model folder that is not a model. Every interface (CLI, app, API, sweeps) shows it as one
line. Anything else that escapes is a bug: it is logged with its traceback and shown as an internal error.
`UserError` derives from ValueError so that callers who only know the standard library still catch it.
"""

from __future__ import annotations


class UserError(ValueError):
    """Input the user can fix, with a message that says how."""


class InputError(UserError):
    """A bad setting or prompt."""


class ModelError(UserError):
    """A model that cannot be loaded or used for speculation."""
