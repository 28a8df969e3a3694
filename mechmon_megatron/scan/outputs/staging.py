"""Nothing half-written: outputs are built in a staging folder inside ``OUT`` and moved in at the end.

``os.replace`` of a file within one filesystem is atomic; a directory (``tensorboard/``,
``img/``) is swapped in by renaming the old one away first. ``summary.json`` is moved last, so
its presence means the scan finished and every other output belongs to it. On an error the
staging folder is deleted and the previous outputs stay as they were.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from types import TracebackType
from typing import Optional

__all__ = ["Staging", "write_text_atomic"]


def write_text_atomic(path: str, text: str) -> None:
    """Write ``path`` through a temporary file in the same folder and a rename."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class Staging:
    """``with Staging(out) as stage: ...write under stage.path...; stage.commit(names)``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.path = ""

    def __enter__(self) -> Staging:
        os.makedirs(self.out, exist_ok=True)
        self.path = tempfile.mkdtemp(dir=self.out, prefix=".staging-")
        return self

    def commit(self, entries: list[str]) -> None:
        """Move ``entries`` (names under the staging folder) into ``out``, in order."""
        for name in entries:
            src, dst = os.path.join(self.path, name), os.path.join(self.out, name)
            if os.path.isdir(src):
                old = None
                if os.path.exists(dst):
                    old = tempfile.mkdtemp(dir=self.out, prefix=".old-")
                    os.replace(dst, os.path.join(old, name))
                os.replace(src, dst)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(src, dst)

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
