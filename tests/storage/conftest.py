"""The remote fixtures (tests/remote/conftest.py: moto, the GCS emulator,
`RangeServer`) for the storage tests too."""

from remote.conftest import (  # noqa: F401  (fixtures, found by name)
    _no_server_left_running,
    gcs_server,
    moto_server,
    range_server,
    remote_target,
)
