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

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_INTERNAL = (_HERE, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
_APP = os.path.join(_HERE, "app") + os.sep  # (hdet's CLI: its own lines are the user's code there)
_HELPERS = (os.path.abspath(contextlib.__file__),)  # (a generator context manager's code after its yield runs there)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called in the frame that calls this: the first frame outside hdet
    (its CLI excepted), torch and contextlib (the user's code, or the framework that called hdet), or the outermost
    one. Frames of a module being imported are not counted, as ``warnings.warn`` skips them."""
    frame, level = sys._getframe(1), 1  # (level 1: the frame that calls warnings.warn)
    while frame.f_back is not None and (_internal(frame.f_code.co_filename) or _importing(frame.f_code.co_filename)):
        frame = frame.f_back
        if not _importing(frame.f_code.co_filename):
            level += 1
    return level


def _internal(name: str) -> bool:
    if not os.path.isabs(name):  # ("<string>", "<frozen runpy>", a notebook's cell: the user's)
        return False
    return (name.startswith(_INTERNAL) and not name.startswith(_APP)) or name in _HELPERS


def _importing(name: str) -> bool:
    """CPython's test of a frame that ``warnings.warn`` does not count (importlib's bootstrap)."""
    return "importlib" in name and "_bootstrap" in name
