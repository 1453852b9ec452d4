"""The exit handlers (``atexit``) of a ``partition`` process, bounded and quiet.

A plan's process ends by running the exit handlers itself (``partitioner.cli.main``'s
``_end_process``); the model's code may have registered some. One that never returns
(``atexit.register(lambda: time.sleep(3600))``) kept the process alive for ever after "Plan
written to ...", and one that raises printed Python's "Exception ignored in atexit callback"
traceback after it. Here they run in a daemon thread for at most a grace period, and each
misbehaving handler becomes one ``note:`` line naming it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import posix
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from partitioner.core.errors import escape_control

__all__ = ["EXIT_HANDLERS_GRACE_S", "HardExit", "hard_exits_refused", "run_exit_handlers"]

EXIT_HANDLERS_GRACE_S = 5.0
"""How long the exit handlers (``atexit``) of a ``partition`` process may run, once the plan is
written, before the process ends without them."""

_ATEXIT_MESSAGE = "Exception ignored in atexit callback"


def run_exit_handlers(grace_s: float = EXIT_HANDLERS_GRACE_S) -> list[str]:
    """Run this process's exit handlers (``atexit``, last registered first) in a daemon thread,
    waiting up to ``grace_s`` for them: the notes to print, one line each (without the
    ``partition: note:`` prefix). A handler that raises is one note (its exception, by type and
    message, instead of Python's traceback); one still running after ``grace_s`` is one note and
    is left behind (the handlers after it do not run). Ctrl-C during the wait stays the
    caller's: the main thread only waits."""
    raised: list[str] = []
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not str(unraisable.err_msg or "").startswith(_ATEXIT_MESSAGE):
            previous(unraisable)
            return
        raised.append(_raised_note(unraisable))

    frames: dict[str, types.FrameType | None] = {"outer": None}

    def run() -> None:
        frames["outer"] = sys._getframe()
        with _no_hard_exit():
            atexit._run_exitfuncs()

    sys.unraisablehook = hook
    runner = threading.Thread(target=run, name="partition-exit-handlers", daemon=True)
    try:
        runner.start()
        runner.join(grace_s)
    finally:
        if not runner.is_alive():
            sys.unraisablehook = previous
    notes = list(raised)
    if runner.is_alive():
        handler = _running_handler(runner, frames["outer"])
        notes.append(
            f"an exit handler (atexit) of the model's code, {handler}, was still running after "
            f"{grace_s:g} s; exiting without it: remove the atexit.register call, or make the "
            "handler return"
        )
    return notes


class HardExit(SystemExit):
    """Raised in place of ``os._exit(status)`` called by the model's code (:func:`_no_hard_exit`,
    :func:`hard_exits_refused`): a ``SystemExit``, so a thread it ends ends quietly."""

    def __init__(self, status: object) -> None:
        super().__init__(status)
        self.status = status


@contextlib.contextmanager
def hard_exits_refused() -> Iterator[list[str]]:
    """While the run plans, ``os._exit`` called by the model's code in this process raises
    :class:`HardExit` instead of ending the process with the status it chose and no plan
    written (a timer thread calling ``os._exit(0)`` made a stale plan look like this run's).
    In the main thread it unwinds the run as ``sys.exit`` does; in another thread it ends that
    thread only, and the yielded list gets a note saying so. A forked child gets the real one."""
    notes: list[str] = []
    main = threading.main_thread()

    def noted(status: object) -> None:
        if threading.current_thread() is not main:
            name = escape_control(threading.current_thread().name)
            notes.append(
                f"a thread of the model's code ({name}) called os._exit({status!r}) while the "
                "run planned; that thread was stopped and the run went on"
            )

    with _no_hard_exit(any_thread=True, called=noted):
        yield notes


@contextlib.contextmanager
def _no_hard_exit(
    *, any_thread: bool = False, called: Callable[[object], None] | None = None
) -> Iterator[None]:
    """While inside, ``os._exit`` called by this thread (``any_thread``: by any thread) raises
    :class:`HardExit` instead, after ``called(status)``: an exit handler of the model's code
    calling ``os._exit(0)`` ended a failed run with status 0 (atexit stops that handler and
    reports it; the process keeps its own status). Forked children get the real ``os._exit``."""
    real = os._exit
    thread, pid = threading.get_ident(), os.getpid()

    def guarded(status: int) -> None:
        if (any_thread or threading.get_ident() == thread) and os.getpid() == pid:
            if called is not None:
                called(status)
            if any_thread and threading.current_thread() is not threading.main_thread():
                raise SystemExit(status)  # a thread's run() ends quietly on exactly SystemExit
            raise HardExit(status)
        real(status)

    os._exit = posix._exit = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = posix._exit = real


def _raised_note(unraisable: Any) -> str:
    """``an exit handler (atexit) of the model's code, boom (model.py line 2), raised
    RuntimeError: atexit boom``."""
    exc = unraisable.exc_value
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    what = f"raised {detail}"
    if isinstance(exc, SystemExit):
        call = "os._exit" if isinstance(exc, HardExit) else "sys.exit"
        code = exc.status if isinstance(exc, HardExit) else exc.code
        what = f"called {call}({code!r}), ignored: the run's own exit status stands"
    tb = unraisable.exc_traceback
    handler = _described(tb.tb_frame) if tb is not None else _callable_name(unraisable.object)
    return escape_control(f"an exit handler (atexit) of the model's code, {handler}, {what}")


def _running_handler(runner: threading.Thread, outer: types.FrameType | None) -> str:
    """The exit handler ``runner`` is stuck in, as :func:`_described` shows it: the frame
    just inside :func:`run_exit_handlers`'s own (``atexit`` calls the handler from C)."""
    frame = sys._current_frames().get(runner.ident or -1)
    handler = None
    while frame is not None and frame is not outer:
        handler, frame = frame, frame.f_back
    if handler is None or frame is None:  # a handler written in C, or no frame
        return "one of them"
    return escape_control(_described(handler))


def _described(frame: types.FrameType) -> str:
    """``boom (model.py line 2)``: a frame's function, its file's name and its line."""
    code = frame.f_code
    name = code.co_filename.rsplit("/", 1)[-1]
    return f"{code.co_name} ({name} line {frame.f_lineno})"


def _callable_name(func: Callable[..., object] | None) -> str:
    return str(getattr(func, "__qualname__", None) or repr(func))
