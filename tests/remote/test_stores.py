"""S3 (moto) and GCS (gcp-storage-emulator) on loopback as a range-reading
client sees them, raw and behind the logging proxy, and one checkpoint in
all four places (tests/remote/stores.py). The quirks asserted here are the
ones its docstring lists: a new emulator release that changes one fails here."""

import hashlib
import json
import os
import pathlib
import urllib.parse

import pytest
import urllib3

from remote import stores as remote_stores
from remote.servers import RangeServer

DATA = bytes(range(256)) * 40  # 10,240 bytes
SIZE = len(DATA)


def _get(url, headers=None, method="GET", **kwargs):
    return urllib3.PoolManager(retries=False).request(method, url, headers=headers or {}, **kwargs)


@pytest.fixture
def checkpoint_dir(tmp_path):
    root = tmp_path / "ckpt"
    (root / "assets").mkdir(parents=True)
    (root / "config.json").write_text('{"name": "tiny"}')
    (root / "model.weights.h5").write_bytes(DATA)
    (root / "assets" / "vocab.txt").write_text("a\nb\n")
    return root


# S3.


def test_moto_ranges_etags_and_signing(s3, checkpoint_dir):
    botocore = pytest.importorskip("botocore")
    import botocore.auth
    import botocore.awsrequest
    import botocore.credentials

    url = s3.upload_dir(str(checkpoint_dir), "khd-moto", "ckpt")
    assert url == "s3://khd-moto/ckpt"
    assert os.environ["AWS_ENDPOINT_URL"] == s3.endpoint
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"
    key_url = f"{s3.endpoint}/khd-moto/ckpt/model.weights.h5"
    assert _get(key_url, {"Range": "bytes=0-9"}).status == 403  # unsigned
    signed = remote_stores.sign_s3
    md5 = f'"{hashlib.md5(DATA).hexdigest()}"'
    for header, start, end in [("bytes=10-19", 10, 20), ("bytes=10-", 10, SIZE), ("bytes=-5", SIZE - 5, SIZE)]:
        r = _get(key_url, signed("GET", key_url, {"Range": header}))
        assert (r.status, r.data, r.headers["ETag"]) == (206, DATA[start:end], md5)
        assert r.headers["Content-Range"] == f"bytes {start}-{end - 1}/{SIZE}"
    # moto does not check the signature: any credentials pass (auth failures
    # are for the proxy's `status_for` to inject).
    wrong = botocore.auth.S3SigV4Auth(botocore.credentials.Credentials("x", "y"), "s3", "eu-west-3")
    request = botocore.awsrequest.AWSRequest("GET", key_url, headers={"Range": "bytes=0-3"})
    wrong.add_auth(request)
    assert _get(key_url, dict(request.headers)).data == DATA[:4]
    r = _get(key_url, signed("GET", key_url, {"Range": f"bytes={SIZE}-"}))
    assert r.status == 416 and b"<Code>InvalidRange</Code>" in r.data
    r = _get(key_url, signed("GET", key_url, {"Range": "bytes=0-1,4-5"}))
    assert (r.status, len(r.data)) == (200, SIZE)
    r = _get(key_url, signed("GET", key_url, {"If-Match": '"other"'}))
    assert r.status == 412 and b"PreconditionFailed" in r.data
    assert r.headers["Connection"] == "close"
    missing = f"{s3.endpoint}/khd-moto/ckpt/missing"
    assert b"NoSuchKey" in _get(missing, signed("GET", missing)).data
    s3.upload_dir(str(checkpoint_dir), "khd-moto-public", "ckpt", public=True)
    public = f"{s3.endpoint}/khd-moto-public/ckpt/model.weights.h5"
    assert _get(public, {"Range": "bytes=0-9"}).data == DATA[:10]  # unsigned


def test_s3_through_the_proxy(s3, checkpoint_dir):
    s3.upload_dir(str(checkpoint_dir), "khd-proxy", "ckpt")
    with RangeServer(upstream=s3.endpoint, flavor="s3", seed=1) as proxy:
        key_url = f"{proxy.url}/khd-proxy/ckpt/model.weights.h5"
        headers = {"Range": "bytes=100-199", "X-Khd-Process": "2"}
        r = _get(key_url, remote_stores.sign_s3("GET", key_url, headers))  # signed for the proxy
        assert (r.status, r.data) == (206, DATA[100:200])
        assert proxy.bytes_sent(key="ckpt/model.weights.h5", process=2) == 100
        etag = r.headers["ETag"]
        s3.client().put_object(Bucket="khd-proxy", Key="ckpt/model.weights.h5", Body=DATA[::-1])
        r = _get(key_url, remote_stores.sign_s3("GET", key_url, {**headers, "If-Match": etag}))
        assert r.status == 412
        proxy.fail_rate = 1.0
        r = _get(key_url, remote_stores.sign_s3("GET", key_url, headers))
        assert r.status == 503 and b"<Code>SlowDown</Code>" in r.data


# GCS.


def _media(endpoint, bucket, name, query=""):
    quoted = urllib.parse.quote(name, safe="")
    return f"{endpoint}/download/storage/v1/b/{bucket}/o/{quoted}?alt=media{query}"


def test_gcs_emulator_as_it_is(gcs, checkpoint_dir):
    url = gcs.upload_dir(str(checkpoint_dir), "khd-gcs", "ckpt")
    assert url == "gs://khd-gcs/ckpt" and os.environ["STORAGE_EMULATOR_HOST"] == gcs.endpoint
    name = "ckpt/model.weights.h5"
    media = _media(gcs.endpoint, "khd-gcs", name)
    r = _get(media, {"Range": "bytes=10-19"})
    assert (r.status, r.data, r.headers["Content-Range"]) == (206, DATA[10:20], f"bytes 10-19/{SIZE}")
    assert "ETag" not in r.headers
    meta = json.loads(_get(f"{gcs.endpoint}/storage/v1/b/khd-gcs/o/{urllib.parse.quote(name, safe='')}").data)
    assert meta["size"] == str(SIZE) and meta["etag"] == meta["md5Hash"]
    assert meta["generation"].isdigit()
    listing = json.loads(_get(f"{gcs.endpoint}/storage/v1/b/khd-gcs/o?prefix=ckpt/").data)
    assert sorted(item["name"] for item in listing["items"]) == [
        "ckpt/assets/vocab.txt", "ckpt/config.json", "ckpt/model.weights.h5"]
    # The quirks: a suffix range, a stale generation and ifGenerationMatch are ignored,
    # a start past the end is an empty 206, HEAD is not implemented, a 404 has no body.
    assert (_get(media, {"Range": "bytes=-5"}).status, len(_get(media, {"Range": "bytes=-5"}).data)) == (200, SIZE)
    assert _get(_media(gcs.endpoint, "khd-gcs", name, "&generation=1")).status == 200
    assert _get(_media(gcs.endpoint, "khd-gcs", name, "&ifGenerationMatch=1")).status == 200
    past = _get(media, {"Range": f"bytes={SIZE + 10}-"})
    assert (past.status, past.data) == (206, b"")
    assert _get(media, method="HEAD").status == 501
    missing = _get(_media(gcs.endpoint, "khd-gcs", "missing"))
    assert (missing.status, missing.data) == (404, b"")
    second = gcs.upload("khd-gcs", name, DATA[::-1])
    assert second["generation"] != meta["generation"]


def test_gcs_through_the_proxy_answers_as_gcs(gcs, checkpoint_dir):
    gcs.upload_dir(str(checkpoint_dir), "khd-gcs-proxy", "ckpt")
    name = "ckpt/model.weights.h5"
    with RangeServer(upstream=gcs.endpoint, flavor="gcs",
                     upstream_hook=remote_stores.gcs_semantics) as proxy:
        meta = json.loads(_get(f"{proxy.url}/storage/v1/b/khd-gcs-proxy/o/{urllib.parse.quote(name, safe='')}").data)
        generation = meta["generation"]
        r = _get(_media(proxy.url, "khd-gcs-proxy", name, f"&generation={generation}"),
                 {"Range": "bytes=-5", "X-Khd-Process": "1"})
        assert (r.status, r.data, r.headers["X-Goog-Generation"]) == (206, DATA[-5:], generation)
        assert r.headers["ETag"] == f'"{meta["etag"]}"'
        assert proxy.bytes_sent(key=name, process=1) == 5
        r = _get(_media(proxy.url, "khd-gcs-proxy", name), {"Range": f"bytes={SIZE}-"})
        assert (r.status, r.headers["Content-Range"]) == (416, f"bytes */{SIZE}")
        gcs.upload("khd-gcs-proxy", name, DATA[::-1])  # replaced: a new generation
        stale = _get(_media(proxy.url, "khd-gcs-proxy", name, f"&generation={generation}"))
        assert stale.status == 404 and json.loads(stale.data)["error"]["code"] == 404
        guarded = _get(_media(proxy.url, "khd-gcs-proxy", name, f"&ifGenerationMatch={generation}"))
        assert guarded.status == 412
        assert json.loads(guarded.data)["error"]["errors"][0]["reason"] == "conditionNotMet"
        assert _get(_media(proxy.url, "khd-gcs-proxy", "missing")).status == 404


# One checkpoint in four places.


def test_checkpoint_everywhere(remote_checkpoint, checkpoint_dir, tmp_path):
    remotes = remote_checkpoint(checkpoint_dir)
    assert remotes["s3"].url.startswith("s3://khd-") and remotes["s3"].url.endswith("/ckpt")
    assert remotes["gs"].url.startswith("gs://khd-") and remotes["gs"].url.endswith("/ckpt")
    assert remotes["hf"].url == "hf://khd-tests/ckpt"
    assert remotes["hf"].pinned_url.startswith("hf://khd-tests/ckpt@")
    assert remotes["http"].url == remotes["http"].server.url + "/ckpt"
    assert os.environ["AWS_ENDPOINT_URL"] == remotes["s3"].server.url
    assert os.environ["STORAGE_EMULATOR_HOST"] == remotes["gs"].server.url
    import huggingface_hub

    assert huggingface_hub.constants.ENDPOINT == remotes["hf"].server.url
    path = huggingface_hub.hf_hub_download("khd-tests/ckpt", "assets/vocab.txt", cache_dir=tmp_path)
    assert pathlib.Path(path).read_text() == "a\nb\n"
    for scheme, remote in remotes.items():
        r = remote.get("model.weights.h5", {"Range": "bytes=100-199", "X-Khd-Process": "1"})
        assert (r.status, r.data) == (206, DATA[100:200]), scheme
        assert remote.get("assets/vocab.txt").data == b"a\nb\n", scheme
        assert remote.bytes_sent("model.weights.h5", process=1) == 100, scheme
        assert remote.bytes_sent() == 100 + 4 + (4 if scheme == "hf" else 0), scheme


def test_faults_in_front_of_every_store(remote_checkpoint, checkpoint_dir):
    remotes = remote_checkpoint(checkpoint_dir, fail_rate=1.0, retry_after=0)
    for scheme, remote in remotes.items():
        r = remote.get("config.json")
        assert (r.status, r.headers["Retry-After"]) == (503, "0"), scheme
        assert [x.fault for x in remote.requests("config.json")] == ["fail"], scheme
