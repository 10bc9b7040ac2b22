"""Model families: which KerasHub family a backbone class belongs to."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

__all__ = ["keras_hub_family"]

_MODULE = re.compile(r"keras_hub\.src\.models\.(\w+)\.")


def keras_hub_family(model_or_class: Any, known: Collection[str] | None = None) -> str | None:
    """The KerasHub family of a backbone class or instance (`"gemma"`, ...).

    KerasHub modules live at `keras_hub.src.models.<family>.<module>`, which
    names the family without a hand-kept class table. A subclass defined
    elsewhere gets the family of its nearest KerasHub base class.

    Args:
        model_or_class: A backbone (or task) class or instance.
        known: If given, only these family names count.

    Returns:
        The family name, or `None`.
    """
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    for klass in cls.__mro__:
        match = _MODULE.match(klass.__module__)
        if match and (known is None or match.group(1) in known):
            return match.group(1)
    return None
