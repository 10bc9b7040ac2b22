"""`RangeClient` fills the caller's buffers from the socket: no response body
is read through urllib3's `read`/`readinto`, each of which makes a new
`bytes` object and copies it."""

import numpy as np
import urllib3

from keras_hub_dist.storage import ranged_http
from keras_hub_dist.storage.host_io import aligned_empty
from keras_hub_dist.storage.object_stores import open_store


def test_bodies_land_in_the_buffers_without_a_copy(range_server, monkeypatch):
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    range_server.put("d/blob.bin", data)
    with ranged_http.RangeClient(concurrency=4, chunk_bytes=1 << 20) as client:
        store = open_store(f"{range_server.url}/d", client)
        remote = client.open(store.stat("blob.bin"), store, "blob.bin")

        def copied(self, *args, **kwargs):
            raise AssertionError("a body was read through urllib3 (a copy of every byte)")

        monkeypatch.setattr(urllib3.response.HTTPResponse, "read", copied)
        monkeypatch.setattr(urllib3.response.HTTPResponse, "readinto", copied)
        out = aligned_empty((len(data) - 10,), np.uint8)
        view = memoryview(out)
        # Two buffers, split inside the second request.
        remote.read_stretches([(5, [view[: 1500000], view[1500000:]])])
    assert out.tobytes() == data[5:-5]
    gets = range_server.requests("GET", key="d/blob.bin")
    assert sorted((r.start, r.end) for r in gets) == [
        (5, 5 + (1 << 20)), (5 + (1 << 20), 5 + (2 << 20)), (5 + (2 << 20), len(data) - 5)]


def test_a_large_body_on_a_slow_link_is_sent_in_pieces(tmp_path):
    """A 12 MiB body over a 4 MB/s link (3 s) with a 1 s socket timeout
    arrives: the timeout bounds each MiB sent, not the whole body (sent in
    one `sendall`, it bounded the whole body: every try timed out)."""
    from remote import servers

    body = np.random.default_rng(1).integers(0, 256, 12 << 20, dtype=np.uint8)
    retry = ranged_http.RetryPolicy(attempts=1, connect_timeout_s=1.0)
    with servers.RangeServer(bytes_per_second_per_address=4e6) as server, \
            ranged_http.RangeClient(retry=retry) as client:
        store = open_store(f"{server.url}/d", client)
        response = client.request("PUT", f"{server.url}/d/part", store, body=memoryview(body))
        [put] = server.requests("PUT")
    assert response.status == 405  # a server that takes no uploads, after reading the body
    assert put.bytes_received == body.nbytes and client.bytes_sent == body.nbytes
