"""The loopback servers of the remote-checkpoint tests (tests/remote/servers.py,
remote/hub.py, remote/stores.py) answer, log and fail as the tests of the
remote loader will rely on, and stop leaving no thread or port behind."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import urllib3

from remote import http_blobs as remote_http
from remote.servers import RangeServer

DATA = bytes(range(256)) * 40 + b"tail"
SIZE = len(DATA)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pool():
    return urllib3.PoolManager(retries=False)


def _get(url, headers=None, method="GET", **kwargs):
    return _pool().request(method, url, headers=headers or {}, **kwargs)


@pytest.fixture
def checkpoint_dir(tmp_path):
    root = tmp_path / "ckpt"
    (root / "assets").mkdir(parents=True)
    (root / "config.json").write_text('{"name": "tiny"}')
    (root / "model.weights.h5").write_bytes(DATA * 8)
    (root / "assets" / "vocab.txt").write_text("a\nb\n")
    return root


# RangeServer: ranges, headers, conditions.


@pytest.mark.parametrize("from_file", [False, True], ids=["bytes", "file"])
@pytest.mark.parametrize("range_header, status, start, end", [
    ("bytes=10-19", 206, 10, 20),
    ("bytes=10-", 206, 10, SIZE),
    ("bytes=-5", 206, SIZE - 5, SIZE),
    ("bytes=10000-99999", 206, 10000, SIZE),
    (None, 200, 0, SIZE),
    ("bytes=0-1,4-5", 200, 0, SIZE),  # several ranges: the whole object, as S3
    ("bytes=9-3", 200, 0, SIZE),  # malformed: ignored (RFC 9110)
])
def test_ranges(range_server, tmp_path, from_file, range_header, status, start, end):
    if from_file:
        (tmp_path / "blob").write_bytes(DATA)
    range_server.put("a/blob", str(tmp_path / "blob") if from_file else DATA)
    r = _get(range_server.url + "/a/blob", {"Range": range_header} if range_header else {})
    assert (r.status, r.data) == (status, DATA[start:end])
    assert r.headers["Content-Length"] == str(end - start)
    expected_range = f"bytes {start}-{end - 1}/{SIZE}" if status == 206 else None
    assert r.headers.get("Content-Range") == expected_range
    assert range_server.bytes_sent() == end - start


@pytest.mark.parametrize("range_header", [f"bytes={SIZE}-", f"bytes={SIZE + 5}-{SIZE + 9}", "bytes=-0"])
def test_unsatisfiable_range_is_416(range_server, range_header):
    range_server.put("blob", DATA)
    r = _get(range_server.url + "/blob", {"Range": range_header})
    assert r.status == 416 and r.headers["Content-Range"] == f"bytes */{SIZE}"
    assert range_server.bytes_sent() == 0  # error bodies only with errors=True
    assert range_server.bytes_sent(errors=True) == len(r.data) > 0


def test_head_gives_the_headers_only(range_server):
    range_server.put("blob", DATA)
    r = _get(range_server.url + "/blob", method="HEAD")
    assert r.status == 200 and r.data == b""
    assert r.headers["Content-Length"] == str(SIZE)
    assert r.headers["Accept-Ranges"] == "bytes"
    assert re.fullmatch(r'"[0-9a-f]{32}-\d+"', r.headers["ETag"])  # strong, quoted
    assert abs(time.mktime(time.strptime(r.headers["Last-Modified"], "%a, %d %b %Y %H:%M:%S GMT"))
               - time.mktime(time.gmtime())) < 60
    assert [(x.method, x.status, x.bytes_sent) for x in range_server.log] == [("HEAD", 200, 0)]


def test_if_match_and_replace(range_server):
    first = range_server.put("blob", DATA)
    r = _get(range_server.url + "/blob", {"If-Match": first.etag, "Range": "bytes=0-3"})
    assert (r.status, r.data) == (206, DATA[:4])
    range_server.replace("blob", DATA[::-1])
    r = _get(range_server.url + "/blob", {"If-Match": first.etag, "Range": "bytes=0-3"})
    assert r.status == 412 and first.etag in json.loads(r.data)["error"]
    r = _get(range_server.url + "/blob", {"Range": "bytes=0-3"})
    assert (r.status, r.data) == (206, DATA[::-1][:4]) and r.headers["ETag"] != first.etag
    range_server.replace("blob", DATA[::-1])  # the same bytes again: still a new ETag
    assert _get(range_server.url + "/blob", method="HEAD").headers["ETag"] != r.headers["ETag"]


def test_unknown_path_and_method(range_server):
    range_server.put("blob", DATA)
    assert _get(range_server.url + "/nope").status == 404
    assert _get(range_server.url + "/blob", method="DELETE").status == 405


def test_a_file_is_read_at_the_range_only(range_server, tmp_path, monkeypatch):
    (tmp_path / "big").write_bytes(DATA * 100)
    range_server.put("big", str(tmp_path / "big"))
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(remote_http.os, "pread",
                        lambda fd, n, at: reads.append((n, at)) or real_pread(fd, n, at))
    r = _get(range_server.url + "/big", {"Range": "bytes=500000-500099"})
    assert r.data == (DATA * 100)[500000:500100] and reads == [(100, 500000)]


# RangeServer: the log.


def test_keep_alive_and_the_log(range_server):
    range_server.put("a/blob", DATA)
    range_server.put("b/blob", DATA)
    pool = _pool()
    for process, (path, first) in enumerate([("a", 0), ("a", 100), ("b", 7)]):
        pool.request("GET", f"{range_server.url}/{path}/blob", headers={
            "Range": f"bytes={first}-{first + 9}", "X-Khd-Process": str(process),
            "User-Agent": "khd-test/1"})
    pool.request("GET", f"{range_server.url}/a/blob", headers={"Range": "bytes=5-"})
    log = range_server.log
    assert pool.connection_from_url(range_server.url).num_connections == 1
    assert len({r.client_port for r in log}) == 1  # one kept-alive connection
    assert [(r.path, r.start, r.end, r.process, r.key) for r in log] == [
        ("/a/blob", 0, 10, 0, "a/blob"), ("/a/blob", 100, 110, 1, "a/blob"),
        ("/b/blob", 7, 17, 2, "b/blob"), ("/a/blob", 5, None, None, "a/blob")]
    assert [r.user_agent for r in log[:3]] == ["khd-test/1"] * 3
    assert log[0].time <= log[1].time <= log[2].time
    assert range_server.bytes_sent(process=1) == 10
    assert range_server.bytes_sent(path_prefix="/a/") == 20 + SIZE - 5
    assert range_server.bytes_sent(key="b/blob") == 10
    assert len(range_server.requests(process=0)) == 1
    range_server.clear()
    assert range_server.log == [] and range_server.bytes_sent() == 0


def test_log_under_concurrent_clients(range_server):
    range_server.put("blob", DATA)

    def client(process):
        pool = _pool()
        for i in range(10):
            pool.request("GET", range_server.url + "/blob", headers={
                "Range": f"bytes={i}-{i + 99}", "X-Khd-Process": str(process)})

    threads = [threading.Thread(target=client, args=(p,)) for p in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(range_server.log) == 80
    assert [range_server.bytes_sent(process=p) for p in range(8)] == [1000] * 8


# RangeServer: faults, latency, bandwidth.


def _statuses(seed, n=40):
    with RangeServer({"blob": DATA}, seed=seed, fail_rate=0.5, retry_after=0) as server:
        pool = _pool()
        responses = [pool.request("GET", server.url + "/blob", headers={"Range": f"bytes={i}-{i}"})
                     for i in range(n)]
        assert all(r.headers.get("Retry-After") == "0" for r in responses if r.status == 503)
        assert all(r.fault == "fail" for r in server.log if r.status == 503)
        return [r.status for r in responses]


def test_failures_are_deterministic_from_the_seed():
    first, again, other = _statuses(7), _statuses(7), _statuses(8)
    assert first == again != other
    assert set(first) == {206, 503} and 10 <= first.count(503) <= 30


def test_a_retry_draws_anew(range_server):
    range_server.put("blob", DATA)
    range_server.fail_rate = 0.5
    statuses = [_get(range_server.url + "/blob", {"Range": "bytes=0-0"}).status for _ in range(30)]
    assert set(statuses) == {206, 503}


def test_a_cut_body_is_short_then_the_connection_closes(range_server):
    range_server.put("blob", DATA)
    range_server.cut_rate = 1.0
    pool = _pool()
    with pytest.raises(urllib3.exceptions.ProtocolError):
        pool.request("GET", range_server.url + "/blob", headers={"Range": "bytes=0-8191"})
    (record,) = range_server.log
    assert record.fault == "cut" and record.status == 206 and record.bytes_sent < 8192
    range_server.cut_rate = 0.0
    r = pool.request("GET", range_server.url + "/blob", headers={"Range": "bytes=0-8191"})
    assert r.data == DATA[:8192] and range_server.log[-1].client_port != record.client_port


def test_uploads_are_logged_and_faulted(range_server):
    """A request body is counted as read (`bytes_received`, the part number
    from `X-Khd-Part` or S3's `partNumber`); with `cut_rate` an upload is
    read in part, then the connection closes unanswered; `fail_status`
    answers 429 with `Retry-After`; `fault_parts_only` spares the rest."""
    range_server.fault_methods, range_server.fault_parts_only = ("PUT",), True
    range_server.cut_rate = 1.0
    pool = _pool()
    with pytest.raises(urllib3.exceptions.ProtocolError):
        pool.request("PUT", range_server.url + "/o", body=DATA * 100,
                     headers={"X-Khd-Part": "3", "X-Khd-Process": "1"})
    assert pool.request("PUT", range_server.url + "/o", body=DATA).status == 405  # not a part
    range_server.cut_rate, range_server.fail_rate = 0.0, 1.0
    range_server.fail_status, range_server.retry_after = 429, 0.5
    r = pool.request("PUT", range_server.url + "/o?partNumber=2&uploadId=x", body=DATA)
    assert r.status == 429 and r.headers["Retry-After"] == "0.5"
    cut, whole, throttled = range_server.log
    assert (cut.fault, cut.status, cut.part, cut.process) == ("cut", 0, 3, 1)
    assert 0 <= cut.bytes_received < SIZE * 100
    assert (whole.fault, whole.part, whole.bytes_received) == (None, None, SIZE)
    assert (throttled.fault, throttled.part, throttled.bytes_received) == ("fail", 2, SIZE)
    assert cut.client_host == "127.0.0.1"
    assert range_server.bytes_received(errors=True) == cut.bytes_received + 2 * SIZE
    assert range_server.bytes_received() == 0  # none answered 2xx


def test_each_client_address_gets_its_own_capped_link_both_ways(range_server):
    """`bytes_per_second_per_address`: every source address (127.0.0.x) is
    paced on its own, downloads and uploads alike, whatever its connections;
    `traffic` is that address's rate as the server saw it."""
    rate = 4e6
    range_server.put("blob", DATA * 100)  # 1 MB
    range_server.bytes_per_second_per_address = rate

    def client(host):
        pool = urllib3.PoolManager(retries=False, maxsize=2, source_address=(host, 0))
        for _ in range(2):  # two connections at once, one link
            threads = [threading.Thread(target=pool.request, args=("GET", range_server.url + "/blob"))
                       for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        pool.request("PUT", range_server.url + "/upload", body=DATA * 100)

    hosts = ["127.0.0.5", "127.0.0.6"]
    threads = [threading.Thread(target=client, args=(h,)) for h in hosts]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for host in hosts:
        moved, seconds = range_server.traffic(host)
        assert 5 * SIZE * 100 <= moved < 5 * SIZE * 100 + 4096  # + the 405 answer
        assert 0.7 * rate < moved / seconds < 1.1 * rate, (host, moved, seconds)
        assert {r.client_host for r in range_server.requests(host=host)} == {host}
    assert elapsed < 1.6 * 5 * SIZE * 100 / rate  # the two links at once, not one after the other


def test_status_hook_and_token(range_server):
    range_server.put("open", DATA)
    range_server.put("secret", DATA)
    range_server.status_for = lambda path: 403 if path.endswith("secret") else None
    range_server.require_token = "tok"
    assert _get(range_server.url + "/open").status == 401
    assert _get(range_server.url + "/open", {"Authorization": "Bearer nope"}).status == 403
    assert _get(range_server.url + "/open", {"Authorization": "Bearer tok"}).status == 200
    assert _get(range_server.url + "/secret", {"Authorization": "Bearer tok"}).status == 403
    assert [r.fault for r in range_server.log] == ["auth", "auth", None, "status"]


def test_latency_and_bandwidth(range_server):
    range_server.put("blob", DATA * 60)  # 614,640 bytes
    range_server.latency_s = 0.2
    start = time.perf_counter()
    _get(range_server.url + "/blob", {"Range": "bytes=0-0"})
    assert 0.2 <= time.perf_counter() - start < 2.0
    range_server.latency_s = 0.0
    range_server.bytes_per_second_per_connection = 2e6
    start = time.perf_counter()
    r = _get(range_server.url + "/blob")
    elapsed = time.perf_counter() - start
    assert r.data == DATA * 60
    # Paced in 40,000-byte steps, the first one at once: >= 14 steps of 20 ms.
    assert 0.28 <= elapsed < 3.0


def test_stop_leaves_no_thread_and_no_port():
    before = set(threading.enumerate())
    server = RangeServer({"blob": DATA * 100}, bytes_per_second_per_connection=1e5).start()
    idle = _pool()
    idle.request("GET", server.url + "/blob", headers={"Range": "bytes=0-0"})  # kept alive
    errors = []

    def read_slowly():
        try:
            _get(server.url + "/blob")
        except urllib3.exceptions.ProtocolError as e:
            errors.append(e)

    slow = threading.Thread(target=read_slowly)
    slow.start()  # a 1 MB body at 100 kB/s: still streaming when stopped
    deadline = time.monotonic() + 10
    while not server.requests(method="GET", status=200) and time.monotonic() < deadline:
        time.sleep(0.01)  # logged as its first byte leaves
    time.sleep(0.1)
    start = time.perf_counter()
    server.stop()
    assert time.perf_counter() - start < 5
    slow.join(5)
    assert len(errors) == 1  # the client saw its body cut short
    assert set(threading.enumerate()) - before == set()
    cut, = [r for r in server.log if r.start is None]
    assert 0 < cut.bytes_sent < 200_000  # what left before the stop, not the planned 1 MB
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1)


# RangeServer as a proxy.


def test_proxy_forwards_logs_and_faults(range_server):
    blob = range_server.put("x/blob", DATA)
    with RangeServer(upstream=range_server.url) as proxy:
        headers = {"Range": "bytes=3-9", "X-Khd-Process": "5", "User-Agent": "khd-test/1"}
        r = _get(proxy.url + "/x/blob", headers)
        assert (r.status, r.data, r.headers["Content-Range"]) == (206, DATA[3:10], f"bytes 3-9/{SIZE}")
        assert r.headers["ETag"] == blob.etag
        upstream, = range_server.log
        assert (upstream.process, upstream.user_agent, upstream.start) == (5, "khd-test/1", 3)
        assert proxy.bytes_sent(process=5) == 7
        assert _get(proxy.url + "/x/blob", method="HEAD").headers["Content-Length"] == str(SIZE)
        assert _get(proxy.url + "/x/blob", method="POST", body=b"123").status == 405
        assert range_server.log[-1].method == "POST"
        proxy.fail_rate = 1.0
        assert _get(proxy.url + "/x/blob").status == 503
        assert len(range_server.log) == 3  # the failed GET never reached the upstream
        proxy.fail_rate, proxy.cut_rate = 0.0, 1.0
        with pytest.raises(urllib3.exceptions.ProtocolError):
            _get(proxy.url + "/x/blob")
        assert proxy.log[-1].fault == "cut" and proxy.log[-1].bytes_sent < SIZE


def test_proxy_to_a_dead_upstream_is_502():
    with RangeServer() as gone:
        url = gone.url
    with RangeServer(upstream=url) as proxy:
        r = _get(proxy.url + "/x")
    assert r.status == 502 and url in json.loads(r.data)["error"]


# The command line.


def test_serve_command_line(checkpoint_dir, tmp_path):
    log = tmp_path / "log.jsonl"
    process = subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "remote/servers.py"), "--dir", str(checkpoint_dir),
         "--hub", "o/n", "--latency", "0.01", "--rate", "50e6", "--log", str(log)],
        stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(process.stdout.readline())
        r = _get(info["url"] + "/model.weights.h5", {"Range": "bytes=0-9", "X-Khd-Process": "0"})
        assert (r.status, r.data) == (206, DATA[:10])
        r = _get(f"{info['HF_ENDPOINT']}/o/n/resolve/{info['hf_sha']}/config.json")
        assert r.data == b'{"name": "tiny"}' and info["hf"] == "hf://o/n"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        process.stdout.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["key"], x["bytes_sent"], x["process"]) for x in records] == [
        ("ckpt/model.weights.h5", 10, 0), ("config.json", 16, None)]
