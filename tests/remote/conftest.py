"""Fixtures for remote checkpoints: S3 (moto), GCS (gcp-storage-emulator), a
Hugging Face Hub and plain HTTP, all on 127.0.0.1, each behind a logging and
fault-injecting `RangeServer` (tests/remote/servers.py).

- `range_server`: a started `RangeServer()`, stopped after the test.
- `moto_server` / `gcs_server`: one emulator for the session (skipped when
  the `test` extra is not installed); `s3` / `gcs`: the same, with the
  environment of a client of it set for the test.
- `hub_server`: a `RangeServer` that huggingface_hub talks to for the test.
- `remote_target(scheme, **server_options)`: a fresh empty bucket ("s3"
  or "gs") behind a proxy made with those options (faults on uploads,
  per-address caps), the environment of a client of it set; returns the
  `remote_stores.Remote` (its `url` is where a save writes).
- `remote_checkpoint(local_dir, schemes=..., **faults)`: uploads a directory
  to every scheme and returns `{scheme: remote_stores.Remote}` with the
  environment of each set for the test (`AWS_ENDPOINT_URL` and
  `STORAGE_EMULATOR_HOST` at the proxies, huggingface_hub at the Hub).

Example:

```python
@pytest.mark.parametrize("scheme", ["s3", "gs", "hf", "http"])
def test_load(remote_checkpoint, tmp_path, scheme):
    remote = remote_checkpoint(preset_dir, schemes=[scheme])[scheme]
    load_sharded_preset(remote.url, ...)
    assert remote.bytes_sent("model.weights.h5", process=0) == ...
```
"""

import contextlib
import os
import sys
import threading

import pytest

from keras_hub_dist.formats import checksums
from keras_hub_dist.storage import uploads

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:  # tests/conftest.py's folder is there under pytest already
    sys.path.insert(0, TESTS)

from remote import hub as remote_hub  # noqa: E402
from remote import servers as remote_servers  # noqa: E402
from remote import stores as remote_stores  # noqa: E402


def _set_env(monkeypatch, env):
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


@pytest.fixture(autouse=True)
def _no_server_left_running():
    """Every server a test starts is stopped by its end, connections too."""
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("RangeServer:")]
    assert not left, f"servers or connections left running: {left}"


@pytest.fixture
def range_server():
    with remote_servers.RangeServer() as server:
        yield server


@pytest.fixture(scope="session")
def moto_server():
    pytest.importorskip("moto.server", reason="needs moto[server]: pip install -e '.[test]'")
    pytest.importorskip("boto3", reason="needs boto3: pip install -e '.[test]'")
    with remote_stores.MotoS3() as s3:
        yield s3


@pytest.fixture(scope="session")
def gcs_server():
    pytest.importorskip("gcp_storage_emulator", reason="needs gcp-storage-emulator: pip install -e '.[test]'")
    with remote_stores.GcsEmulator() as gcs:
        yield gcs


@pytest.fixture
def s3(moto_server, monkeypatch):
    _set_env(monkeypatch, remote_stores.s3_env(moto_server.endpoint))
    return moto_server


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    _set_env(monkeypatch, remote_stores.gcs_env(gcs_server.endpoint))
    return gcs_server


@pytest.fixture
def hub_server(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    with remote_servers.RangeServer() as server:
        remote_hub.patch_huggingface_hub(monkeypatch, server.url, str(tmp_path / "hf-cache"))
        yield server


@pytest.fixture
def remote_target(request, monkeypatch):
    with contextlib.ExitStack() as stack:

        def make(scheme, **options):
            s3 = request.getfixturevalue("moto_server") if scheme == "s3" else None
            gcs = request.getfixturevalue("gcs_server") if scheme == "gs" else None
            remote = stack.enter_context(remote_stores.empty_remote(scheme, s3=s3, gcs=gcs, **options))
            _set_env(monkeypatch, remote.env)
            return remote

        yield make


@pytest.fixture
def remote_checkpoint(request, monkeypatch, tmp_path):
    with contextlib.ExitStack() as stack:

        def upload(local_dir, schemes=("s3", "gs", "hf", "http"), **options):
            s3 = request.getfixturevalue("moto_server") if "s3" in schemes else None
            gcs = request.getfixturevalue("gcs_server") if "gs" in schemes else None
            remotes = stack.enter_context(remote_stores.checkpoint_everywhere(
                str(local_dir), s3=s3, gcs=gcs, schemes=schemes, **options))
            for remote in remotes.values():
                _set_env(monkeypatch, remote.env)
            if "hf" in remotes:
                pytest.importorskip("huggingface_hub")
                remote_hub.patch_huggingface_hub(
                    monkeypatch, remotes["hf"].server.url, str(tmp_path / "hf-cache"))
            return remotes

        yield upload


@pytest.fixture
def small_parts(monkeypatch):
    """5 MiB parts and checksum chunks, so tiny models upload several parts."""
    monkeypatch.setattr(checksums, "CHUNK_BYTES", 5 << 20)


@pytest.fixture(params=["s3", "gs"])
def store(request):
    """`(scheme, url of a fresh bucket's prefix, writer)` with the env set."""
    scheme = request.param
    server = request.getfixturevalue("s3" if scheme == "s3" else "gcs")
    url = f"{scheme}://{remote_stores.fresh_bucket(server)}/presets/tuned"
    return scheme, url, uploads.open_writer(url)
