"""One-line errors for the command-line entry points (train.py, evaluate.py,
scripts/self_distill.py).

A user error (bad data, a bad setting, a damaged or mismatched file, an engine such as
llama-server that is missing, fails to start or dies) is printed as one line that says what is
wrong and how to fix it, and the process exits with status 2. Ctrl-C prints one line too (what a
long step kept, e.g. self-distillation's conversations) and exits with status 130. Anything else
is a bug and keeps Hydra's traceback. `HYDRA_FULL_ERROR=1` shows the full traceback for every
error.

User errors are `data.errors.DraftsmithError` and its subclasses, the older error classes listed
in `_known_user_errors`, missing files, OmegaConf errors (a missing `???` value, a broken
interpolation), and a ValueError or TypeError raised while Hydra builds an object from the
config (a config dataclass's validation).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def _known_user_errors() -> tuple[type[BaseException], ...]:
    from omegaconf.errors import OmegaConfBaseException

    from data.chat import ChatTemplateError
    from data.errors import DraftsmithError
    from data.features import FeatureCacheMismatch
    from data.formats import DataFormatError
    from heads.base import HeadMismatchError

    found: list[type[BaseException]] = [
        DraftsmithError,
        DataFormatError,
        ChatTemplateError,
        FeatureCacheMismatch,
        HeadMismatchError,
        FileNotFoundError,
        OmegaConfBaseException,
    ]
    try:
        from heads.folder import HeadFolderError

        found.append(HeadFolderError)
    except ImportError:  # not every version has it
        pass
    return tuple(found)


def user_error(exc: BaseException) -> BaseException | None:
    """The user error behind `exc`: `exc` itself or an error in its chain of causes."""
    from hydra.errors import InstantiationException

    known = _known_user_errors()
    seen: set[int] = set()
    in_config = False
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, known):
            return exc
        if isinstance(exc, InstantiationException):
            in_config = True
        elif in_config and isinstance(exc, ValueError | TypeError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"error: {text}"


def report_user_errors(main: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Hydra task function: a user error becomes one line on stderr and exit status 2,
    Ctrl-C one line and exit status 130."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt as exc:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            what = " ".join(str(exc).split())  # data.errors.Interrupted: what was kept
            print(f"interrupted: {what}" if what else "interrupted", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)
        except Exception as exc:
            found = user_error(exc)
            if found is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(one_line(found), file=sys.stderr)  # one line; HYDRA_FULL_ERROR=1: traceback
            sys.exit(EXIT_USER_ERROR)

    return wrapper
