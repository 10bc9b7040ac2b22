"""The object-store writers (`storage.uploads.open_writer`): S3 against moto
and GCS against gcp-storage-emulator, each behind a logging, fault-injecting
`RangeServer` proxy on 127.0.0.1, so what reached the store is counted and
faulted at the server."""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest

from keras_hub_dist.errors import SaveError
from keras_hub_dist.storage import gcs_writer
from keras_hub_dist.storage.object_stores import S3Store
from keras_hub_dist.storage.ranged_http import ObjectInfo, RangeClient, RetryPolicy
from keras_hub_dist.storage.uploads import ObjectWriter, open_writer
from keras_hub_dist.storage.writer_base import MIN_PART, RESERVED
from remote.servers import Reply

MIB = 1 << 20
FAST = RetryPolicy(attempts=6, backoff_s=0.01, max_backoff_s=0.1, connect_timeout_s=5,
                   read_timeout_s=30)
SCHEMES = ["s3", "gs"]


class Target:
    """A fresh bucket of one store behind a proxy (`remote_target`), and
    writers of it whose clients retry fast."""

    def __init__(self, remote, clients):
        self.remote, self.clients = remote, clients
        self.scheme, self.bucket, self.proxy = remote.scheme, remote.bucket, remote.server

    def url(self, prefix: str = "preset") -> str:
        return f"{self.scheme}://{self.bucket}/{prefix}".rstrip("/")

    def writer(self, prefix: str = "preset", **options) -> ObjectWriter:
        client = RangeClient(concurrency=4, retry=options.pop("retry", FAST), **options)
        self.clients.append(client)
        return open_writer(self.url(prefix), client)

    def keys(self) -> list[str]:
        """Every object in the bucket, asked of the store itself."""
        return self.remote.stored_keys()


@pytest.fixture
def make_target(remote_target):
    """`make_target(scheme, **RangeServer options)`: a `Target` whose proxy
    faults, throttles or refuses as asked."""
    clients = []
    yield lambda scheme, **options: Target(remote_target(scheme, **options), clients)
    for client in clients:
        client.close()


@pytest.fixture(params=SCHEMES)
def target(request, make_target):
    return make_target(request.param)


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _cuts(sizes):
    """`(number, start, end)` of consecutive parts of these sizes."""
    out, start = [], 0
    for number, size in enumerate(sizes, 1):
        out.append((number, start, start + size))
        start += size
    return out


def _multipart(writer, name, data, sizes, order=None, threads=1):
    """Uploads `data` in parts of `sizes` (in `order`, from `threads`
    threads, memoryviews of `data`); returns (upload id, sorted tokens)."""
    upload_id = writer.create_upload(name)
    cuts = {n: (s, e) for n, s, e in _cuts(sizes)}
    order = order or sorted(cuts)
    tokens, errors = {}, []

    def run(numbers):
        try:
            for n in numbers:
                s, e = cuts[n]
                tokens[n] = writer.upload_part(name, upload_id, n, memoryview(data)[s:e])
        except Exception as e:  # noqa: BLE001  (raised below)
            errors.append(e)

    workers = [threading.Thread(target=run, args=(order[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return upload_id, sorted(tokens.items())


def test_open_writer_takes_only_s3_and_gcs():
    for location in ["/local/dir", "file:///x", "hf://owner/name", "https://host/dir", "s3://", "gs:///x"]:
        with pytest.raises(SaveError, match=r"s3://bucket/prefix or gs://bucket/prefix.*Received"):
            open_writer(location)


def test_small_objects_put_get_list_delete(target):
    writer = target.writer()
    started = time.time()
    writer.put("config.json", b'{"a": 1}')
    writer.put("assets/tokenizer/vocab.txt", memoryview(b"x" * 1000))
    target.writer("preset-other").put("config.json", b"{}")  # a sibling prefix
    assert writer.get("config.json") == b'{"a": 1}'
    assert writer.get("missing.json") is None
    listed = writer.list()
    assert sorted(listed) == ["assets/tokenizer/vocab.txt", "config.json"]
    assert listed["assets/tokenizer/vocab.txt"].size == 1000 and listed["config.json"].size == 8
    assert all(m.version and abs(m.updated - started) < 120 for m in listed.values())
    assert list(writer.list("assets/")) == ["assets/tokenizer/vocab.txt"]
    writer.put("config.json", b"{}")
    assert writer.list()["config.json"].version != listed["config.json"].version
    writer.delete(["config.json", "never-written.bin"])
    assert list(writer.list()) == ["assets/tokenizer/vocab.txt"]
    with pytest.raises(SaveError, match="writer keeps for itself"):
        writer.put(f"{RESERVED}/x", b"")


def test_multipart_parts_out_of_order_from_two_threads(target):
    writer = target.writer()
    sizes = [5 * MIB, 5 * MIB, 5 * MIB, 12345]
    data = _data(sum(sizes))
    upload_id, tokens = _multipart(writer, "model.weights.h5", data, sizes, order=[4, 2, 3, 1],
                                   threads=2)
    # Nothing to see before the upload completes.
    assert writer.get("model.weights.h5") is None and "model.weights.h5" not in writer.list()
    assert [(u.name, u.upload_id) for u in writer.list_uploads()] == [("model.weights.h5", upload_id)]
    writer.complete_upload("model.weights.h5", upload_id, tokens)
    assert writer.get("model.weights.h5") == data.tobytes()
    assert writer.list()["model.weights.h5"].size == data.size
    assert writer.list_uploads() == []
    assert target.keys() == ["preset/model.weights.h5"]  # no temporaries left
    # The server saw each part once, whole, from process 0.
    parts = target.proxy.requests(parts=True)
    assert sorted(r.part for r in parts) == [1, 2, 3, 4]
    assert {r.process for r in parts} == {0}
    assert target.proxy.bytes_received(parts=True) == data.size


def test_abort_leaves_nothing(target):
    writer = target.writer()
    sizes = [5 * MIB, 100]
    upload_id, _ = _multipart(writer, "model.safetensors", _data(sum(sizes)), sizes)
    [upload] = writer.list_uploads()
    assert (upload.name, upload.upload_id) == ("model.safetensors", upload_id)
    if target.scheme == "gs":  # moto dates every upload 2010-11-10
        assert abs(upload.initiated - time.time()) < 120
    writer.abort_upload("model.safetensors", upload_id)
    writer.abort_upload("model.safetensors", upload_id)  # again: fine
    assert writer.list_uploads() == [] and target.keys() == []
    if target.scheme == "s3":
        assert target.remote.backend.list_uploads(target.bucket) == []
    # Real S3 answers NoSuchUpload; moto a 500 (KeyError), retried, then raised.
    late = "Expected an unfinished upload .* Received: none" if target.scheme == "gs" else "part 3"
    with pytest.raises(SaveError, match=late):
        writer.upload_part("model.safetensors", upload_id, 3, b"late part")
    assert target.keys() == []  # the late part did not stay (GCS deletes it again)


def test_s3_complete_whose_answer_was_lost_passes_when_the_object_is_those_parts(make_target):
    """A complete tried again after its first answer was lost meets
    NoSuchUpload (the proxy answers so; moto would answer 200 again): the
    object's multipart ETag (the MD5 of the parts' MD5s) says whether it is
    made of these very parts."""
    lost = threading.Event()

    def upload_gone(server, method, path, query, headers):
        if lost.is_set() and method == "POST" and "uploadId=" in query:
            body = b"<Error><Code>NoSuchUpload</Code><Message>gone</Message></Error>"
            return Reply.of(404, {"Content-Type": "application/xml"}, body)
        return None

    writer = make_target("s3", upstream_hook=upload_gone).writer()
    sizes = [5 * MIB, 10]
    upload_id, tokens = _multipart(writer, "w.bin", _data(sum(sizes)), sizes)
    writer.complete_upload("w.bin", upload_id, tokens)
    lost.set()
    writer.complete_upload("w.bin", upload_id, tokens)
    with pytest.raises(SaveError, match="Expected an unfinished upload"):
        writer.complete_upload("w.bin", upload_id, tokens[:1])


def test_complete_refuses_a_short_middle_part_or_a_stale_token(target):
    writer = target.writer()
    sizes = [5 * MIB, 1000, 10]
    data = _data(sum(sizes))
    upload_id, tokens = _multipart(writer, "w.bin", data, sizes)
    with pytest.raises(SaveError, match=r"(at least 5242880 bytes|EntityTooSmall)"):
        writer.complete_upload("w.bin", upload_id, tokens)
    with pytest.raises(SaveError, match="strictly ascending"):
        writer.complete_upload("w.bin", upload_id, tokens[::-1])
    if target.scheme == "gs":  # a part uploaded again since its token was taken
        writer.upload_part("w.bin", upload_id, 1, memoryview(data)[:5 * MIB])
        with pytest.raises(SaveError, match="not the one uploaded with token"):
            writer.complete_upload("w.bin", upload_id, [tokens[0], tokens[2]])
    writer.abort_upload("w.bin", upload_id)
    assert target.keys() == []


@pytest.mark.parametrize("limit, parts", [(32, 70), (4, 20)])
def test_gcs_composes_a_tree_of_32_at_a_time(make_target, monkeypatch, limit, parts):
    target = make_target("gs")
    monkeypatch.setattr(gcs_writer, "COMPOSE_LIMIT", limit)
    writer = target.writer()
    writer.MIN_PART = 1  # compose needs none; small parts keep the test fast
    sizes = [1000 + n for n in range(parts)]
    data = _data(sum(sizes), seed=parts)
    upload_id, tokens = _multipart(writer, "w.bin", data, sizes)
    writer.complete_upload("w.bin", upload_id, tokens)
    assert writer.get("w.bin") == data.tobytes()
    composes = [r for r in target.proxy.requests("POST") if r.path.endswith("/compose")]
    levels, n = 0, parts
    expected = 0
    while n > limit:
        n = -(-n // limit)
        expected += n
        levels += 1
    assert len(composes) == expected + 1 and levels == (1 if limit == 32 else 2)
    # The target appeared only at the last compose.
    assert composes[-1].key.startswith("preset/w.bin")
    assert all(RESERVED in r.key for r in composes[:-1])
    assert target.keys() == ["preset/w.bin"]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("fault", ["503", "429", "cut"])
def test_faulted_part_uploads_are_retried_whole(make_target, scheme, fault):
    # Every part's first try faulted, later ones at random (the draws depend
    # on the upload id, which differs from run to run).
    options = dict(fault_methods=("PUT", "POST"), fault_parts_only=True, fault_first_tries=1)
    if fault == "cut":
        options.update(cut_rate=0.3)
    else:
        options.update(fail_rate=0.3, fail_status=int(fault), retry_after=0.01 if fault == "429" else None)
    target = make_target(scheme, **options)
    writer = target.writer(retry=RetryPolicy(attempts=12, backoff_s=0.01, max_backoff_s=0.05))
    sizes = [5 * MIB, 5 * MIB, 5 * MIB, 777]
    data = _data(sum(sizes), seed=1)
    upload_id, tokens = _multipart(writer, "w.bin", data, sizes, threads=2)
    writer.complete_upload("w.bin", upload_id, tokens)
    assert writer.get("w.bin") == data.tobytes()
    parts = target.proxy.requests(parts=True)
    faulted = [r for r in parts if r.fault]
    assert {r.part for r in faulted} == {1, 2, 3, 4}  # every part's first try at least
    assert len(parts) == len(faulted) + 4  # each fault retried, each part once whole
    if fault == "cut":
        assert all(r.status == 0 and r.bytes_received < sizes[r.part - 1] for r in faulted)
    else:
        assert {r.status for r in faulted} == {int(fault)}
    answered = [r for r in parts if not r.fault]
    assert sorted(r.part for r in answered) == [1, 2, 3, 4]
    assert target.proxy.bytes_received(parts=True) == data.size
    assert target.keys() == ["preset/w.bin"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_part_that_cannot_pass_names_url_object_part_and_bytes(make_target, scheme):
    target = make_target(scheme, fault_methods=("PUT", "POST"), fault_parts_only=True, fail_rate=1.0)
    writer = target.writer(retry=RetryPolicy(attempts=2, backoff_s=0.01))
    upload_id = writer.create_upload("w.bin")
    with pytest.raises(SaveError) as raised:
        writer.upload_part("w.bin", upload_id, 2, bytes(1234))
    message = str(raised.value)
    for text in ["part 2", "1234 bytes", f"{scheme}://{target.bucket}/preset/w.bin", target.proxy.url,
                 "HTTP 503", "failed 2 times"]:
        assert text in message, (text, message)
    assert len(target.proxy.requests(parts=True)) == 2
    writer.abort_upload("w.bin", upload_id)


def test_check_writable_passes_and_leaves_no_probe(target):
    target.writer().check_writable()
    assert target.keys() == []


def test_check_writable_missing_bucket(target):
    writer = open_writer(f"{target.scheme}://khd-no-such-bucket-{uuid.uuid4().hex[:8]}/p")
    with writer, pytest.raises(SaveError, match=r"Expected an existing bucket 'khd-no-such-bucket"):
        writer.check_writable()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_check_writable_without_write_permission(make_target, scheme):
    def deny_writes(server, method, path, query, headers):
        if method in ("PUT", "POST", "DELETE"):
            return server.error(403, "Injected: no write permission")
        return None

    target = make_target(scheme, upstream_hook=deny_writes)
    with pytest.raises(SaveError) as raised:
        target.writer().check_writable()
    message = str(raised.value)
    assert "was refused" in message and "403" in message
    assert "Credentials used:" in message and "provide other credentials" in message
    assert (("AWS credentials from botocore's chain" in message) if scheme == "s3"
            else ("emulator" in message))


def test_check_writable_prefix_that_is_an_object(target):
    target.writer("").put("preset", b"12345")
    with pytest.raises(SaveError, match=r"Expected .*/preset to be a folder.*a file of 5 bytes"):
        target.writer("preset").check_writable()


def test_nothing_is_written_to_local_disk(target, tmp_path, monkeypatch):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(), tmp.mkdir()
    for name, value in {"HOME": home, "TMPDIR": tmp, "TMP": tmp, "TEMP": tmp}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.chdir(tmp_path)
    writer = target.writer()
    writer.check_writable()
    writer.put("config.json", b"{}")
    upload_id, tokens = _multipart(writer, "w.bin", _data(5 * MIB + 5), [5 * MIB, 5])
    writer.complete_upload("w.bin", upload_id, tokens)
    assert sorted(os.listdir(tmp_path)) == ["home", "tmp"]
    assert os.listdir(home) == [] and os.listdir(tmp) == []


def test_each_client_binds_its_source_address_and_each_address_gets_its_own_link(make_target, monkeypatch):
    """Two processes' clients, each from its own 127.0.0.x, through a
    server that caps every client address at 8 MB/s: each gets its cap at
    once (measured at the server), the pair twice one's."""
    rate = 8e6
    target = make_target("s3", bytes_per_second_per_address=rate)
    writers = {host: target.writer(source_address=host, process_index=i)
               for i, host in enumerate(["127.0.0.2", "127.0.0.3"])}
    sizes = [5 * MIB, 5 * MIB]
    data = _data(sum(sizes))
    spans = {}

    def upload(host):
        writer = writers[host]
        start = time.monotonic()
        upload_id, tokens = _multipart(writer, f"w-{host}.bin", data, sizes)
        writer.complete_upload(f"w-{host}.bin", upload_id, tokens)
        spans[host] = (start, time.monotonic())

    threads = [threading.Thread(target=upload, args=(host,)) for host in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, host in enumerate(writers):
        assert {r.client_host for r in target.proxy.requests(process=i)} == {host}
        assert target.proxy.bytes_received(host=host, parts=True) == data.size
        moved, seconds = target.proxy.traffic(host)
        assert moved >= data.size
        assert 0.7 * rate < moved / seconds < 1.1 * rate, (host, moved, seconds)
    (a0, a1), (b0, b1) = spans.values()
    assert min(a1, b1) - max(a0, b0) > 0.8 * min(a1 - a0, b1 - b0)  # at the same time

    # Reads too: `KERAS_HUB_DIST_SOURCE_ADDRESS` binds a reader's client.
    target.proxy.bytes_per_second_per_address = None
    monkeypatch.setenv("KERAS_HUB_DIST_SOURCE_ADDRESS", "127.0.0.4")
    reader = RangeClient(concurrency=2, retry=FAST)
    monkeypatch.delenv("KERAS_HUB_DIST_SOURCE_ADDRESS")
    with reader:
        store = S3Store(target.url(), reader)
        info = store.stat("w-127.0.0.2.bin")
        assert reader.open(ObjectInfo(info.url, info.size, info.etag), store, "w").read(0, 10) == data[:10].tobytes()
    assert {r.method for r in target.proxy.requests(host="127.0.0.4")} == {"HEAD", "GET"}


def test_min_part_and_max_parts_are_s3s():
    assert MIN_PART == 5 * MIB and ObjectWriter.MAX_PARTS == 10_000


def test_s3_writers_share_the_parsed_service_models_not_the_credentials(monkeypatch):
    """Each S3 writer reads the credentials afresh (a job may rotate them),
    while the parsed service models are parsed once per process."""
    from keras_hub_dist.storage.s3_writer import S3Writer

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # never contacted
    writers = []
    for key in ("AKIAFIRST", "AKIASECOND"):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
        writers.append(S3Writer("s3://bucket/prefix"))
    try:
        assert [w._credentials.access_key for w in writers] == ["AKIAFIRST", "AKIASECOND"]
        loaders = [w.s3._loader for w in writers]
        assert loaders[0] is loaders[1]
    finally:
        for writer in writers:
            writer.close()
