"""SIGTERM for a one-process ``hdet train`` (a scheduler's kill): :func:`on_sigterm`, :func:`check`.

The handler raises :class:`Terminated` (a ``KeyboardInterrupt``, so the run ends as after Ctrl-C, saying that
``--resume`` goes on). Python runs a handler between two bytecodes of the main thread, and where that is inside a
finalizer (garbage collection, a ``__del__``, a weakref callback) the exception is reported as unraisable and
dropped: a run in the clean-clone CI went on training for 50 minutes after its SIGTERM. So the handler also sets a
flag, which the training loop reads at every step (:func:`check`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Terminated", "on_sigterm", "check", "requested"]

requested = False  # a SIGTERM came (set by on_sigterm)


class Terminated(KeyboardInterrupt):
    """SIGTERM (torchrun stopping its workers, a scheduler's kill): stopped as Ctrl-C stops a run."""


def on_sigterm(signum: int, frame: Any) -> None:
    global requested
    requested = True
    raise Terminated()


def check() -> None:
    """Raise :class:`Terminated` if a SIGTERM came and its exception was lost."""
    if requested:
        raise Terminated()
