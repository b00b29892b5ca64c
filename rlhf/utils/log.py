"""The package's console lines: one ``logging`` set-up, the lines as they always printed, and capture to a file.

Every module logs through a logger under the ``rlhf`` namespace::

    from rlhf.utils.log import get_logger

    log = get_logger(__name__)
    log.info(f"[{name}] checkpoint {path}")     # a console line on stdout, exactly this text
    log.warning(f"warning: {problem}")          # a line on stderr, exactly this text

The ``rlhf`` logger has one handler, installed here, the first time this module is imported (idempotently: a
re-import or :func:`install_console` again adds no second one). It writes the message alone (no level, time or
logger name: the lines are byte for byte the ``print`` lines they replace), INFO and below to stdout, WARNING and
above to stderr, flushed, to the *current* ``sys.stdout`` / ``sys.stderr`` at each line (pytest's ``capsys`` and a
``contextlib.redirect_stdout`` see them as they saw ``print``).

Why at import and not by the entry points: the lines must appear as they did for ``python -m rlhf.cli.*``, for a
user calling ``rlhf.trainers.offline.sft.train_sft(cfg)`` from Python, and in the Ray actors' processes (whose output
Ray forwards to the driver), none of which runs a common entry point; every module that logs imports this one first.
``import rlhf`` does not import it (nothing heavy either way: this module is the standard library only).

The ``rlhf`` logger does not propagate to the root logger: an application that configured logging (a root handler,
``logging.basicConfig``) would otherwise print every line twice. An application that wants the lines in its own
handlers instead calls :func:`use_root_handlers`. Quieter: ``logging.getLogger("rlhf").setLevel(logging.WARNING)``
(a level set before this module is imported is kept).

:func:`capture` sends the lines to a file for its duration (and, with ``console=False``, keeps them off the
console): the audit keeps each run's lines in the run's log file this way (:func:`rlhf.audit.runner.run_one`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator, TextIO, Union

ROOT = "rlhf"
_CONSOLE = "rlhf-console"  # the handler's name: found again after a reload of this module (a new class object)


class ConsoleHandler(logging.Handler):
    """The message alone, INFO and below to the current ``sys.stdout``, WARNING and above to the current
    ``sys.stderr``, flushed after every line (a crash or a killed run keeps every line printed)."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.set_name(_CONSOLE)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.muted = 0  # how many captures with console=False are open

    def emit(self, record: logging.LogRecord) -> None:
        if self.muted:
            return
        try:
            # looked up per line, never held: a test's capsys or a redirect installed later must receive it
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy: report through handleError, never raise
            self.handleError(record)


def install_console() -> ConsoleHandler:
    """The ``rlhf`` logger's console handler, added on the first call only; the logger's level is INFO unless one
    was set, and it does not propagate (module docstring)."""
    logger = logging.getLogger(ROOT)
    for handler in logger.handlers:
        if handler.get_name() == _CONSOLE:
            return handler  # type: ignore[return-value]  # the class of this or an earlier import of the module
    handler = ConsoleHandler()
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:  # else the root's WARNING would hide every INFO line
        logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (pass ``__name__``), under ``rlhf``. A module run as a script
    (``python -m rlhf.cli.demo``: ``__name__ == "__main__"``) gets ``rlhf.__main__``, so its lines still reach the
    console handler."""
    if name != ROOT and not name.startswith(ROOT + "."):
        name = f"{ROOT}.{name}"
    return logging.getLogger(name)


def use_root_handlers() -> None:
    """Hand the ``rlhf`` lines to the application's own logging set-up: the console handler is removed and the
    records propagate to the root logger's handlers (which add whatever prefix they format)."""
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if h.get_name() == _CONSOLE]:
        logger.removeHandler(handler)
    logger.propagate = True


class _StreamLines(logging.StreamHandler):
    """The message alone to an open text stream, flushed after every line."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.setFormatter(logging.Formatter("%(message)s"))


@contextlib.contextmanager
def capture(target: Union[str, TextIO], console: bool = True) -> Iterator[TextIO]:
    """Every ``rlhf`` line of every level also goes to ``target`` while the context is open.

    Args:
        target: A path (opened for writing, truncated, closed at the end) or an open text stream (left open).
        console: ``False`` keeps the lines off the console meanwhile (the console handler drops them).

    Yields:
        The open stream the lines go to (e.g. for other writers of the same log, such as Ray's forwarded actor
        output in the audit).
    """
    logger = logging.getLogger(ROOT)
    console_handler = install_console()
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(open(target, "w", encoding="utf-8")) if isinstance(target, str) else target
        handler = _StreamLines(stream)
        logger.addHandler(handler)
        if not console:
            console_handler.muted += 1
        try:
            yield stream
        finally:
            if not console:
                console_handler.muted -= 1
            logger.removeHandler(handler)
            handler.flush()


install_console()
