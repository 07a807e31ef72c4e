"""One error type for everything a user can get wrong, the signal that ends a run as KILLED, and how a maxout
process exits.

The CLI turns a MaxoutError into a single line on stderr and its exit code, so every message must name
the bad value and what is valid, and fit on one line.

Ground floor. May import: nothing.
"""

from __future__ import annotations

import atexit
import gc
import signal
from typing import Any, Callable, Optional, Sequence

USAGE = 2  # bad config, bad override, bad CLI arguments: the user must change the command
RUNTIME = 1  # the command was fine but the run could not complete (missing file, no GPU, ...)


class MaxoutError(Exception):
    """A problem the user can fix. ``str(err)`` is one line."""

    exit_code = RUNTIME

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(" ".join(str(message).split()))  # never multi-line
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(MaxoutError):
    """Invalid configuration or override: a usage error (exit 2)."""

    exit_code = USAGE


class DataError(MaxoutError):
    """The data files do not match the data config."""


class HardwareError(MaxoutError):
    """The requested hardware profile cannot run on this machine."""


class Diverged(MaxoutError):
    """Training produced a non-finite loss or gradient norm (train/divergence.py), or an objective that is not a
    number: the model is wrong, so the run fails and nothing is logged or registered. HPO prunes such a trial and
    goes on. ``step`` is the optimizer step where it first appeared (None when not known)."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM (cli.py installs the handler), so the run is closed as KILLED instead
    of left RUNNING. A BaseException: ``except Exception`` blocks must not swallow it."""


# The stop asked for, raised again at the next safe point (each step's end, each evaluation, before the model is
# logged, the supervisor's polls). Two kinds of request:
# - SIGINT or SIGTERM, once a handler raised for it (cli.py). Python runs a signal handler wherever the main thread
#   is: inside a finalizer or a weakref callback, where the exception it raises is printed ("Exception ignored in
#   ...") and dropped, so the run trained on and finished (issue 36 saw it under load: a Ctrl-C during evaluation,
#   a Ctrl-C to an HPO supervisor). What a handler raised for is kept here.
# - a stop that must not be raised wherever a signal lands (the audit's budget timer): only asked for here, and
#   raised at the next safe point. An exception raised in the middle of torch's code breaks its state: a torch
#   function mode half pushed ("trying to pop from empty mode stack", and every later compile in the process
#   recompiled), a checkpoint's zip record half written.
_stop: Optional[Callable[[], BaseException]] = None


def stop_error(signum: int) -> BaseException:
    """What stops the command for ``signum``: KeyboardInterrupt for SIGINT (Ctrl-C), Terminated for SIGTERM."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def request_stop(make: Callable[[], BaseException]) -> None:
    """Ask this process to stop at its next safe point, with ``make()``'s exception (the first request wins)."""
    global _stop
    _stop = _stop or make


def stop_requested(signum: int) -> BaseException:
    """Record that ``signum`` (SIGINT or SIGTERM) asked this process to stop; the exception to raise for it."""
    request_stop(lambda: stop_error(signum))
    return stop_error(signum)


def raise_if_stop_requested() -> None:
    """At a safe point: raise the stop asked for (a signal's, in case the handler's exception was dropped)."""
    if _stop is not None:
        raise _stop()


def withdraw_stop_request(make: Callable[[], BaseException]) -> None:
    """``make``'s request, if it is the one pending, is gone: what it was to stop has ended (the audit's timer)."""
    global _stop
    if _stop is make:
        _stop = None


def forget_stop_request() -> None:
    """A new command in this process (cli.main, called again in-process) starts with no stop asked."""
    global _stop
    _stop = None


class OutOfMemory(HardwareError):
    """Out of memory that maxout could not recover from (one row per forward pass already, or the batch finder
    found that not even one sample fits). HPO prunes such a trial instead of failing the study."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return (str(err).splitlines() or [type(err).__name__])[0]


def one_of(value: object, valid: object) -> str:
    """'x' (valid: a, b, c) — the shared tail of most messages."""
    options = ", ".join(str(v) for v in valid) if not isinstance(valid, str) else valid
    return f"{value!r} (valid: {options})"


def combined(problems: Sequence[MaxoutError]) -> MaxoutError:
    """One error for several problems, still one line: '3 problems: a; b; c'. A single problem stays itself;
    several are a usage error (exit 2) when any of them is one. A problem found by several checks is told once."""
    problems = list({str(p): p for p in problems}.values())
    if len(problems) == 1:
        return problems[0]
    usage = any(p.exit_code == USAGE for p in problems)
    err = (ConfigError if usage else MaxoutError)(f"{len(problems)} problems: " + "; ".join(map(str, problems)))
    err.problems = list(problems)
    return err


def collect(problems: list, func: Callable, *args: Any) -> Any:
    """``func(*args)``, or None with its MaxoutError appended to ``problems`` (how checks list every problem
    instead of stopping at the first). A check that returns nothing gives True, so the caller can tell it
    passed."""
    try:
        result = func(*args)
    except MaxoutError as err:
        problems.append(err)
        return None
    return True if result is None else result


def exit_without_collecting() -> None:
    """This process ends without the interpreter's last garbage collection. At exit Python traverses every object
    it still holds, ~800,000 with torch, transformers and MLflow loaded: 1.5-4 CPU-s per process (a tracked tiny
    training run: 9.0 -> 6.9 CPU-s; an HPO worker's exit 3.8 -> 0.3 s on 2 busy cores), paid by every `maxout`
    command, torchrun rank and HPO worker, and waited for by whoever waits on them. Objects frozen at exit are
    skipped by that collection; atexit handlers (registered earlier: they run after this one) and module teardown
    still run, and the kernel frees the rest. Python never promised __del__ at exit for objects still alive, and
    nothing maxout writes depends on it: files, runs, spools and checkpoints are closed explicitly."""
    atexit.unregister(gc.freeze)  # once, however often this is called
    atexit.register(gc.freeze)  # atexit runs last-in first-out: the handlers registered before still run after it
