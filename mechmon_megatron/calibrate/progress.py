"""A progress bar for the long replays, shown only where a person watches."""

from __future__ import annotations

import sys
from typing import Any, Optional

__all__ = ["progress_bar"]


def progress_bar(total: int, desc: str, unit: str = "replay") -> Optional[Any]:
    """A tqdm bar of ``total`` steps on stderr when stderr is a terminal (never in logs or pipes),
    else None; None as well without tqdm (it is in the ``calibrate`` extra). Call ``update()``
    once per step and ``close()`` at the end."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True)
