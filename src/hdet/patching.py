"""Functions of ``torch.nn.functional`` swapped while the engine runs its replicas: :func:`patched`.

The engine's eager vmapped forward routes a few functions (``F.scaled_dot_product_attention``, ``F.linear``, the
convolutions) to versions made for vmapped replicas (:mod:`hdet.attention`, :mod:`hdet.linear`,
:mod:`hdet.autocast`). Each replacement wraps what the module held when the routing began, so a function a user or
a library put there (a FLOP counter, a LoRA or ZeRO-3 wrapper) is still called; and the swap is counted under a
lock, so that engines stepping in several threads restore torch's functions once the last one is done.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["patched"]

_lock = threading.Lock()
_active: dict[tuple[str, int, str], list[Any]] = {}  # (owner, id(module), name) -> [entries, the function before]


@contextlib.contextmanager
def patched(owner: str, module: Any, wrappers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]
            ) -> Iterator[None]:
    """Inside: ``module.<name>`` is ``wrap(<what it was>)`` for each ``name: wrap``. Entries of one ``owner`` (nested,
    or in other threads) share the first one's replacement, and its last exit puts the function before back; owners
    layer over each other when entered in one order (the engine's)."""
    with _lock:
        for name, wrap in wrappers.items():
            key = (owner, id(module), name)
            if key in _active:
                _active[key][0] += 1
            else:
                before = getattr(module, name)
                _active[key] = [1, before]
                setattr(module, name, wrap(before))
    try:
        yield
    finally:
        with _lock:
            for name in wrappers:
                key = (owner, id(module), name)
                _active[key][0] -= 1
                if _active[key][0] == 0:
                    setattr(module, name, _active.pop(key)[1])
