"""No secret in any error, and none sent to another host: AWS secret keys,
session tokens and SigV4 signatures, Hugging Face tokens, GCS bearer
tokens and presigned query strings never reach a message
(`storage.redaction.redact`), and a redirect to another host (another port
on 127.0.0.1 is another origin) drops every credential header.

The servers here are two `http.server` threads on 127.0.0.1 that record
each request's headers: "origin" answers as a test asks (a redirect to
"other", or an error whose body echoes the request's headers, as S3's
`SignatureDoesNotMatch` echoes its canonical request), "other" serves 16
bytes.
"""

import contextlib
import http.server
import threading

import pytest

from keras_hub_dist import PresetError
from keras_hub_dist.storage import object_stores, redaction
from keras_hub_dist.storage.ranged_http import ObjectInfo, RangeClient, RetryPolicy

SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
SESSION_TOKEN = "FwoGZXIvYXdzEJr//////////wEaDSESSIONTOKENEXAMPLE0123456789"
HF_TOKEN = "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH"
GCS_TOKEN = "ya29.a0AfH6SMBexampleBearerTokenForTests_0123456789"
BODY = b"0123456789abcdef"


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answer):
        self.answer, self.seen = answer, []
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _reply(self):
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()})
        status, headers, body = self.server.answer(self)
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _reply


def _serve_bytes(handler):
    if "Range" in handler.headers:
        return 206, {"Content-Range": f"bytes 0-15/{len(BODY)}"}, BODY
    return 200, {}, BODY


@contextlib.contextmanager
def _servers(origin_answer):
    other = _Server(_serve_bytes)
    origin = _Server(lambda h: origin_answer(h, other))
    for server in (origin, other):
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield origin, other
    finally:
        for s in (origin, other):
            s.shutdown()
            s.server_close()


def _redirect(handler, other):
    return 307, {"Location": other.url + handler.path}, b""


def _echo_headers(handler, other):
    echoed = "\n".join(f"{k}: {v}" for k, v in handler.headers.items())
    return 400, {"Content-Type": "text/plain"}, f"<Error><CanonicalRequest>{echoed}</CanonicalRequest></Error>".encode()


@pytest.fixture
def s3_with_session(monkeypatch):
    """An S3 store's environment: static keys and a session token."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")

    def store(endpoint, client):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        return object_stores.open_store("s3://bucket/prefix", client)

    return store


@pytest.mark.parametrize("read", ["whole", "range"])
def test_a_redirect_to_another_host_drops_every_credential_header(s3_with_session, read):
    with _servers(_redirect) as (origin, other), RangeClient(retry=RetryPolicy(attempts=1)) as client:
        store = s3_with_session(origin.url, client)
        if read == "whole":
            assert store.get("config.json") == BODY
        else:
            info = ObjectInfo(store.url("model.safetensors"), len(BODY), None)
            assert client.open(info, store, "model.safetensors").read(0, len(BODY)) == BODY
    signed = origin.seen[0]
    assert "AWS4-HMAC-SHA256" in signed["authorization"] and signed["x-amz-security-token"] == SESSION_TOKEN
    assert len(other.seen) == 1
    leaked = {k: v for k, v in other.seen[0].items() if k in redaction.SECRET_HEADERS}
    assert not leaked, f"sent to another host: {leaked}"


def _store(kind, monkeypatch, s3_with_session, endpoint, client):
    if kind == "s3":
        return s3_with_session(endpoint, client)
    if kind == "gs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        store = object_stores.open_store("gs://bucket/prefix", client)

        class Bearer:  # application-default credentials, already fetched
            valid, token = True, GCS_TOKEN

        store._credentials = Bearer()
        return store
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["s3", "gs", "hf"])
def test_an_error_body_echoing_the_request_shows_no_credential(kind, s3_with_session, monkeypatch):
    secrets = {"s3": (SECRET_KEY, SESSION_TOKEN), "gs": (GCS_TOKEN,), "hf": (HF_TOKEN,)}[kind]
    with _servers(_echo_headers) as (origin, _), RangeClient(retry=RetryPolicy(attempts=1)) as client:
        if kind == "hf":
            monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
            monkeypatch.setenv("HF_ENDPOINT", origin.url)
            with pytest.raises(PresetError) as info:
                object_stores.open_store("hf://owner/name", client)
        else:
            store = _store(kind, monkeypatch, s3_with_session, origin.url, client)
            with pytest.raises(PresetError) as info:
                store.get("config.json")
    message = str(info.value)
    sent = origin.seen[0]
    assert "authorization" in sent and "HTTP 400" in message
    signature = sent["authorization"].rsplit("=", 1)[-1]
    for secret in (*secrets, signature, sent["authorization"]):
        assert secret not in message, (secret, message)
    assert redaction.MASK in message


def test_a_presigned_url_in_a_connection_error_is_redacted(s3_with_session):
    """A redirect to a presigned URL whose host does not answer: urllib3's
    error names the URL, query string and all."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed when the block ends: nothing listens

    def to_presigned(handler, other):
        return 307, {"Location": f"http://127.0.0.1:{dead}/blob?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                                 f"&X-Amz-Credential=AKIA%2F20260101&X-Amz-Signature=deadbeefcafe0123456789"
                                 f"&X-Amz-Security-Token=presignedtoken0123456789"}, b""

    with _servers(to_presigned) as (origin, _), RangeClient(retry=RetryPolicy(attempts=1)) as client:
        store = s3_with_session(origin.url, client)
        with pytest.raises(PresetError) as info:
            store.get("config.json")
    text = str(info.value) + repr(info.value.__cause__) + repr(info.value.__context__)
    assert "deadbeefcafe0123456789" not in text and "presignedtoken0123456789" not in text, text


@pytest.mark.parametrize("text,secret", [
    ("GET https://b.s3.amazonaws.com/k?X-Amz-Signature=abc123def&X-Amz-Date=2026", "abc123def"),
    ("https://storage.googleapis.com/b/o?X-Goog-Signature=0a1b2c3d4e", "0a1b2c3d4e"),
    ("{'Authorization': 'AWS4-HMAC-SHA256 Credential=AKIA/2026/us-east-1/s3/aws4_request, "
     "SignedHeaders=host, Signature=f00dfeed'}", "f00dfeed"),
    ("Authorization: Bearer ya29.tokentokentoken", "tokentokentoken"),
    ("x-amz-security-token:IQoJb3JpZ2luX2VjEXAMPLE\nhost:b", "IQoJb3JpZ2luX2VjEXAMPLE"),
    ("<SignatureProvided>abcdef0123</SignatureProvided>", "abcdef0123"),
    (f"token {HF_TOKEN} refused", HF_TOKEN[3:]),
    ("GET https://user:s3cretpass@models.example.com/x failed", "s3cretpass"),
])
def test_redact_removes_each_kind_of_secret(text, secret):
    assert secret not in redaction.redact(text)
    assert redaction.redact("GET https://b/k?partNumber=3 answered HTTP 500") == (
        "GET https://b/k?partNumber=3 answered HTTP 500")  # the rest is kept
