"""``warn_user``: a warning attributed to the user's line, past the library's and Lightning's frames.

A warning raised while Lightning restores a checkpoint would otherwise point into
Lightning (``checkpoint_connector.py``) with any fixed ``stacklevel``: the depth between
the user's ``trainer.fit`` and the library differs by entry point. Python 3.12's
``skip_file_prefixes`` does the same; this works on 3.10 too.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_user"]

# Packages whose frames are never the user's line.
_LIBRARIES = ("lightning_muon", "lightning", "lightning_fabric", "pytorch_lightning", "torch")


def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(dirs)


def _in_library(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_library_dirs())


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the innermost frame outside the library, Lightning and torch.

    Where every frame is theirs (or the next one is the interpreter's own, ``<frozen runpy>``
    under ``python -m``), the outermost of theirs.
    """
    frame = sys._getframe(1)
    level = 2  # warnings.warn's stacklevel of the caller of warn_user
    while frame is not None and _in_library(frame.f_code.co_filename):
        outer = frame.f_back
        if outer is None or outer.f_code.co_filename.startswith("<"):
            break
        frame, level = outer, level + 1
    warnings.warn(message, category, stacklevel=level)
