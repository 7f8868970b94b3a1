"""Launch plans kept by what they read: the one least-recently-used store behind the decode plans
(:func:`kvqref.kernels.decode.plan_decode`) and the write plans (:func:`kvqref.backends.triton_backend.plan_write`).
Imports neither torch nor Triton, so the backends can hold one before their kernels are imported."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable


class KeptPlans(collections.OrderedDict):
    """Launch plans kept by their keys, least recently used first, safe for calls from several threads (a serving
    loop's): the decode plans of ``kvqref.kernels.decode.plan_decode`` and the write plans of
    ``kvqref.backends.triton_backend.plan_write``."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    @staticmethod
    def key_of(make_key: Callable[..., tuple], *args) -> tuple | None:
        """``make_key(*args)``, or None (the call is planned afresh) where an option cannot be a key (TypeError)."""
        try:
            return make_key(*args)
        except TypeError:
            return None

    def serve(self, key: tuple | None):
        """The plan kept for ``key``, now the most recently used; None if there is none or ``key`` is None."""
        if key is None:
            return None
        with self.lock:
            plan = self.get(key)
            if plan is not None:
                self.move_to_end(key)
        return plan

    def keep(self, key: tuple, plan, size: int) -> None:
        """Keep ``plan`` for ``key``, then drop the least recently used plans beyond ``size``."""
        with self.lock:
            self[key] = plan
            while len(self) > size:
                self.popitem(last=False)

    def forget(self) -> None:
        """Drop every kept plan."""
        with self.lock:
            self.clear()
