"""Where hdet's warnings point: the user's line, not hdet's (or torch's) own.

One function reaches the same warning from a training loop, from the one-process engine, from a Trainer or
Lightning callback, each through its own number of hdet frames: a fixed ``stacklevel`` pointed into hdet on some
of those paths. :func:`user_stacklevel` counts the frames instead.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

__all__ = ["user_stacklevel"]

_INTERNAL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))
_HELPERS = (os.path.abspath(contextlib.__file__),)  # (a generator context manager's code after its yield runs there)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called in the frame that calls this: the first frame outside hdet,
    torch and contextlib (the user's code, or the framework that called hdet), or the outermost one."""
    frame, level = sys._getframe(1), 1  # (level 1: the frame that calls warnings.warn)
    while frame.f_back is not None and _internal(os.path.abspath(frame.f_code.co_filename)):
        frame, level = frame.f_back, level + 1
    return level


def _internal(path: str) -> bool:
    return path.startswith(_INTERNAL) or path in _HELPERS
