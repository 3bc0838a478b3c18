"""The jsonargparse call the tests need under every version the package supports.

litgpt 0.5.13 (a dev dependency) caps jsonargparse at 4.41, which names the step
``instantiate_classes``; later versions call it ``instantiate`` and deprecate the old name.
"""

from __future__ import annotations

from typing import Any


def instantiate(parser: Any, config: Any) -> Any:
    """``parser.instantiate(config)``, or ``parser.instantiate_classes(config)`` before jsonargparse 4.42."""
    method = getattr(parser, "instantiate", None) or parser.instantiate_classes
    return method(config)
