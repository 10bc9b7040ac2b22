"""The plan of a checkpoint restore: which stored array fills which variable,
and in which groups they are read. Pure (no JAX, no files): testable alone.

A checkpoint written by `keras.callbacks.OrbaxCheckpoint` holds one `pytree`
item, the model's `get_state_tree()`: `trainable_variables`,
`non_trainable_variables`, `optimizer_variables` and `metrics_variables`,
each a nested dict keyed by the parts of the variables' paths
(`"token_embedding/embeddings"` -> `{"token_embedding": {"embeddings": ...}}`).

Matching, per section (the model's variables against the trainable and
non-trainable arrays together, so a layer frozen or unfrozen since the save
still matches; the optimizer's against `optimizer_variables`):

1. equal paths;
2. what is left, by the path with Keras's automatic numbering dropped from
   every part (`adam_1/iteration` -> `adam/iteration`,
   `seed_generator_7/seed_generator_state` -> `seed_generator/...`), in the
   order of those numbers: a model built again in a new process is numbered
   from wherever that process's counters stand;
3. anything still unmatched, or a shape or dtype that differs, is a
   `CheckpointError` naming the variables.

`metrics_variables` are not restored: `fit` resets them at the start of
every epoch.

Groups: variables in model order, then optimizer order, cut so that each
group reads at most `budget` bytes on any one process (a variable larger
than that is a group of its own). Every process computes the same groups
(the sizes are global figures), as the collective reads need.

Example:

```python
plan = plan_restore(model_wanted, optimizer_wanted, stored, step=2,
                    label="/ckpt", budget=1 << 30)
for group in plan.groups:
    keys = [plan.keys[i] for i in group]
```
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from keras_hub_dist.errors import CheckpointError

__all__ = [
    "MODEL_SECTIONS",
    "OPTIMIZER_SECTION",
    "RestorePlan",
    "Stored",
    "Wanted",
    "group_reads",
    "match_paths",
    "plan_restore",
]

MODEL_SECTIONS = ("trainable_variables", "non_trainable_variables")
OPTIMIZER_SECTION = "optimizer_variables"
# Names listed in an error before "and N more".
_SHOWN = 6
_AUTO_NUMBER = re.compile(r"^(.*?)_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Stored:
    """One array of the checkpoint: its key path in the `pytree` item."""

    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: Any

    @property
    def section(self) -> str:
        return self.key[0]

    @property
    def path(self) -> str:
        """The variable path it was saved from (`"/".join` of the rest)."""
        return "/".join(self.key[1:])


@dataclasses.dataclass(frozen=True)
class Wanted:
    """One variable to restore: its path, shape, dtype, and the most bytes
    any one process reads for it (its distinct blocks on that process)."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    read_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Per variable (model variables first, then the optimizer's, in the
    order given) its path and the key of its stored array; the groups read
    together (indices into that order); the most bytes a process reads in
    all."""

    step: int
    paths: tuple[str, ...]
    keys: tuple[tuple[str, ...], ...]
    groups: tuple[tuple[int, ...], ...]
    read_bytes: int


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    more = len(names) - _SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _unnumbered(path: str) -> tuple[str, tuple[int, ...]]:
    """`adam_1/dense_3_kernel` -> (`adam/dense_3_kernel`, (1, -1)): each part
    without a trailing `_<n>`, and the numbers dropped (-1 where none)."""
    parts, numbers = [], []
    for part in path.split("/"):
        match = _AUTO_NUMBER.match(part)
        if match:
            parts.append(match.group(1))
            numbers.append(int(match.group(2)))
        else:
            parts.append(part)
            numbers.append(-1)
    return "/".join(parts), tuple(numbers)


def match_paths(wanted: Sequence[str], stored: Sequence[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """Pairs variable paths with stored paths: equal ones, then the rest by
    their paths without automatic numbering, in the order of the numbers.

    Returns:
        `(pairs {wanted: stored}, wanted left unmatched, stored left
        unmatched)`, the lists in the order given.
    """
    stored_set = set(stored)
    pairs = {p: p for p in wanted if p in stored_set}
    taken = set(pairs.values())
    left_wanted = [p for p in wanted if p not in pairs]
    left_stored = [p for p in stored if p not in taken]
    by_name: dict[str, tuple[list[str], list[str]]] = {}
    for p in left_wanted:
        by_name.setdefault(_unnumbered(p)[0], ([], []))[0].append(p)
    for p in left_stored:
        by_name.setdefault(_unnumbered(p)[0], ([], []))[1].append(p)
    for ours, theirs in by_name.values():
        if len(ours) != len(theirs):
            continue
        in_order = lambda p: _unnumbered(p)[1]  # noqa: E731
        pairs.update(zip(sorted(ours, key=in_order), sorted(theirs, key=in_order)))
    return (
        pairs,
        [p for p in left_wanted if p not in pairs],
        [p for p in left_stored if p not in set(pairs.values())],
    )


def _check_match(
    wanted: Sequence[Wanted], stored: dict[str, Stored], what: str, label: str, step: int, fix: str
) -> list[tuple[str, ...]]:
    pairs, missing, extra = match_paths([w.path for w in wanted], list(stored))
    if missing or extra:
        found = []
        if missing:
            found.append(f"{len(missing)} {what} not in it ({_listed(missing)})")
        if extra:
            found.append(f"{len(extra)} stored arrays {what.split(' of ')[-1]} lacks ({_listed(extra)})")
        raise CheckpointError(
            f"Expected the checkpoint to hold exactly the {what}. Received: "
            f"{label} step {step}, with " + "; and ".join(found) + f". {fix}"
        )
    keys = []
    for w in wanted:
        s = stored[pairs[w.path]]
        if tuple(s.shape) != tuple(w.shape) or _dtype_name(s.dtype) != _dtype_name(w.dtype):
            raise CheckpointError(
                f"Expected '{s.path}' in {label} step {step} to have shape "
                f"{tuple(w.shape)} and dtype {_dtype_name(w.dtype)}, as "
                f"variable '{w.path}' of the model has. Received: shape "
                f"{tuple(s.shape)}, dtype {_dtype_name(s.dtype)}. {fix}"
            )
        keys.append(s.key)
    return keys


def group_reads(sizes: Sequence[int], budget: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive indices of `sizes`, cut so each group's sum stays within
    `budget` (an item larger than `budget` alone in its group)."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not groups or total + size > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return tuple(tuple(g) for g in groups)


def _by_section(stored: Iterable[Stored]) -> dict[str, dict[str, Stored]]:
    sections: dict[str, dict[str, Stored]] = {}
    for s in stored:
        sections.setdefault(s.section, {})[s.path] = s
    return sections


def plan_restore(
    model: Sequence[Wanted],
    optimizer: Sequence[Wanted] | None,
    stored: Iterable[Stored],
    *,
    step: int,
    label: str,
    budget: int,
    optimizer_name: str = "the optimizer",
) -> RestorePlan:
    """Matches the variables to the checkpoint's arrays and groups the reads.

    Args:
        model: The model's variables (trainable and non-trainable).
        optimizer: The optimizer's variables (as built), or `None` for a
            model without an optimizer (the checkpoint's optimizer state is
            then not read).
        stored: Every array of the checkpoint's `pytree` item.
        step: The step read (for messages).
        label: The checkpoint directory (for messages).
        budget: The most bytes a group reads on any one process.
        optimizer_name: How to call the optimizer in messages
            (e.g. `"Adam 'adam_1'"`).

    Returns:
        A `RestorePlan`.

    Raises:
        CheckpointError: A path that appears twice in the model; variables
            missing from the checkpoint or arrays the model lacks (listed);
            a shape or dtype that differs (the variable, both values); a
            model compiled with an optimizer whose variables differ, or a
            checkpoint without optimizer state.
    """
    for what, variables in (("model", model), ("optimizer", optimizer or ())):
        seen: set[str] = set()
        for w in variables:
            if w.path in seen:
                raise CheckpointError(
                    f"Expected every variable path of the {what} to be unique, as "
                    f"keras.callbacks.OrbaxCheckpoint needs to save it. Received: "
                    f"'{w.path}' twice. Give the layers unique names."
                )
            seen.add(w.path)
    sections = _by_section(stored)
    saved_model: dict[str, Stored] = {}
    for section in MODEL_SECTIONS:
        saved_model.update(sections.get(section, {}))
    keys = _check_match(
        model, saved_model, "variables of the model", label, step,
        "Restore a checkpoint of this model (same architecture, layer names "
        "and dtype as when it was saved).",
    )
    if optimizer is not None:
        saved_optimizer = sections.get(OPTIMIZER_SECTION, {})
        if not saved_optimizer:
            raise CheckpointError(
                f"Expected optimizer state in {label} step {step}: the model is "
                f"compiled with {optimizer_name}. Received: a checkpoint without "
                "optimizer variables (saved with save_weights_only=True?). "
                "Its weights restore into a model whose optimizer has no state "
                "yet (compiled, not fitted)."
            )
        keys += _check_match(
            optimizer, saved_optimizer, f"variables of {optimizer_name}", label, step,
            "Compile the model with the optimizer (class and settings, e.g. "
            "amsgrad, use_ema, gradient_accumulation_steps) it was trained with.",
        )
    wanted = list(model) + list(optimizer or ())
    return RestorePlan(
        step=step,
        paths=tuple(w.path for w in wanted),
        keys=tuple(keys),
        groups=group_reads([w.read_bytes for w in wanted], budget),
        read_bytes=sum(w.read_bytes for w in wanted),
    )
