"""Initialize and load KerasHub LLMs straight into their shards.

Example:

```python
import keras
import keras_hub_dist

model = keras_hub_dist.load_sharded_preset("gemma_7b_en", mesh=(1, 8))
```
"""

from keras_hub_dist._compat import require_jax_backend as _require_jax_backend

_require_jax_backend()

from keras_hub_dist import initializers  # noqa: E402
from keras_hub_dist.initializers import DistributedGlorotNormal  # noqa: E402
from keras_hub_dist.initializers import DistributedGlorotUniform  # noqa: E402
from keras_hub_dist.initializers import DistributedHeNormal  # noqa: E402
from keras_hub_dist.initializers import DistributedHeUniform  # noqa: E402
from keras_hub_dist.initializers import DistributedLecunNormal  # noqa: E402
from keras_hub_dist.initializers import DistributedLecunUniform  # noqa: E402
from keras_hub_dist.initializers import DistributedRandomNormal  # noqa: E402
from keras_hub_dist.initializers import DistributedRandomUniform  # noqa: E402
from keras_hub_dist.initializers import DistributedTruncatedNormal  # noqa: E402
from keras_hub_dist.initializers import DistributedVarianceScaling  # noqa: E402
from keras_hub_dist import registry  # noqa: E402
from keras_hub_dist.errors import KerasHubDistWarning  # noqa: E402
from keras_hub_dist.errors import LayoutError  # noqa: E402
from keras_hub_dist.errors import LayoutFallbackWarning  # noqa: E402
from keras_hub_dist.errors import MissingLayoutWarning  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DistributedGlorotNormal",
    "DistributedGlorotUniform",
    "DistributedHeNormal",
    "DistributedHeUniform",
    "DistributedLecunNormal",
    "DistributedLecunUniform",
    "DistributedRandomNormal",
    "DistributedRandomUniform",
    "DistributedTruncatedNormal",
    "DistributedVarianceScaling",
    "KerasHubDistWarning",
    "LayoutError",
    "LayoutFallbackWarning",
    "MissingLayoutWarning",
    "initializers",
    "registry",
]
