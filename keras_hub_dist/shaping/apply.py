"""Build a model as it will run on the mesh: `build_shaped`, `shape_model`.

`plan.build.build_without_values` builds a model as stock KerasHub does,
with no weight values; the loader, the factories and the job planner then
shape how it runs (`shape_model`): each decoder block's batch kept on the
mesh's data axis and its weights gathered when it runs
(`shaping.batch_axis.keep_batch_split`), and the blocks rematerialized as
`remat=` asks (`shaping.remat.apply_remat`). `build_shaped` does both, in
that order, as one call.

Example:

```python
import keras_hub
from keras_hub_dist.shaping.apply import build_shaped

backbone, pending = build_shaped(
    keras_hub.models.GemmaBackbone,
    dict(vocabulary_size=256, num_layers=2, num_query_heads=2,
         num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8),
    remat="full",
)
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keras_hub_dist.plan.build import build_without_values
from keras_hub_dist.shaping.batch_axis import keep_batch_split
from keras_hub_dist.shaping.remat import apply_remat, remat_scope

__all__ = ["build_shaped", "shape_model"]


def shape_model(model: Any, remat: Any = None, *, batch_split: bool = True) -> Any:
    """Shapes how `model` runs on the mesh, in place.

    Args:
        model: A backbone or a task around one.
        remat: Rematerialization of the decoder blocks in training
            (`shaping.remat.apply_remat`): `None` (off), a `keras.RematScope`
            mode name or a scope.
        batch_split: Keep the batch on the mesh's data axis between the
            decoder blocks, and grouped-KV attention's q / k / v outputs on
            (batch, heads) (`shaping.batch_axis.keep_batch_split`); `False`:
            as stock KerasHub.

    Returns:
        `model`.
    """
    remat_scope(remat)  # an unknown mode fails before anything is changed
    if batch_split:
        keep_batch_split(model)
    if remat is not None:
        apply_remat(model, remat)
    return model


def build_shaped(
    cls: type, config: Mapping[str, Any], remat: Any = None, *, batch_split: bool = True
) -> tuple[Any, list[Any]]:
    """`plan.build.build_without_values(cls, config)`, then `shape_model`.

    An unknown `remat=` mode fails before anything is built.

    Returns:
        `(model, variables created)`, the variables still pending.
    """
    remat_scope(remat)
    model, created = build_without_values(cls, config)
    shape_model(model, remat, batch_split=batch_split)
    return model, created
