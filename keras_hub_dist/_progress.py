"""Progress bars over bytes (`tqdm`), shared by loading and preset writing."""

from __future__ import annotations

from tqdm.auto import tqdm

__all__ = ["byte_progress"]


def byte_progress(total: int, description: str, enabled: bool | None) -> tqdm:
    """A `tqdm` bar counting bytes on stderr.

    Args:
        total: Bytes expected.
        description: Text before the bar.
        enabled: `True` / `False` to force it on / off; `None` draws it only
            when stderr is a terminal (tqdm's own rule), so logs and CI stay
            clean.
    """
    return tqdm(
        total=max(int(total), 1),
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=None if enabled is None else not enabled,
        leave=True,
        dynamic_ncols=True,
    )
