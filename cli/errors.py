"""Turn the errors a user can cause into one clear line and a non-zero exit, never a traceback."""
from __future__ import annotations

import functools

import click

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, KeyError, LookupError, RuntimeError,
                                                TimeoutError)


def _user_errors() -> tuple[type[BaseException], ...]:
    try:
        from ..p2p.errors import WireError
    except ImportError:  # the network stack is not installed
        return USER_ERRORS
    return USER_ERRORS + (WireError,)


def friendly(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except KeyboardInterrupt:
            raise click.Abort() from None
        except _user_errors() as e:
            msg = str(e) or type(e).__name__
            raise click.ClickException(msg) from None
    return wrapper
