"""Output: atomic file writes (a reader, or a restart after a kill, never sees half a file) and progress lines."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable


def _read_umask() -> int:
    # The umask can only be read by setting it: done once, at import, not while other threads create files.
    umask = os.umask(0)
    os.umask(umask)
    return umask


_UMASK = _read_umask()


def write_json_atomic(obj, path: str, *, indent: int | None = 2, default=None) -> None:
    """Writes `obj` as JSON to `path` through a temporary file and `os.replace`.

    The temporary file lives in the same directory (so the rename is atomic)
    and is flushed to disk before the rename; on any error it is removed and
    the previous `path`, if any, is left as it was. The file gets the
    permissions `open` would give it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, default=default)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file 0600; give it the mode a plain `open` would (0666 less the umask).
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def printer(verbose) -> Callable:
    """`print` when `verbose`, else a function that prints nothing (progress lines of long runs)."""
    return print if verbose else (lambda *args, **kwargs: None)
