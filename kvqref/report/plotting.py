"""matplotlib, when installed (the ``report`` extra): every plot of the report goes through :func:`pyplot`."""

from __future__ import annotations

import importlib.util
from typing import Any

NO_MPL = "install matplotlib for plots (pip install matplotlib, or pip install -e \".[report]\")"


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` with the non-interactive Agg backend, or None without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
