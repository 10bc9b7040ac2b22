"""A save that the test kills outright (driven by tests/save/test_save_staging.py).

Usage: python killed_save_worker.py PRESET_DIR TARGET READY_FILE

Loads PRESET_DIR sharded over mesh (2, 4) of 8 simulated CPU devices and
calls `save_sharded_preset(model, TARGET)`. After its third positioned write
it creates READY_FILE and waits there: the test then kills it with SIGKILL,
mid-write, as the OOM killer would.
"""

import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import simulate_cpu_devices  # noqa: E402


def main() -> None:
    preset, target, ready = sys.argv[1:4]
    simulate_cpu_devices(8)
    import keras_hub_dist

    model = keras_hub_dist.load_sharded_preset(preset, mesh=(2, 4), progress=False)
    real_pwritev = os.pwritev
    writes = []

    def pwritev_then_wait(fd, buffers, offset, *args):
        writes.append(real_pwritev(fd, buffers, offset, *args))
        if len(writes) == 3:
            pathlib.Path(ready).write_text(str(os.getpid()))
            time.sleep(600)  # until killed
        return writes[-1]

    os.pwritev = pwritev_then_wait
    keras_hub_dist.save_sharded_preset(model, target, progress=False)
    sys.exit("the save was not killed")


if __name__ == "__main__":
    main()
