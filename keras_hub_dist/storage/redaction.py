"""No secret in an error, a warning or a log: `redact` is the one place
every URL, header, response body and foreign error text of `storage/` goes
through before it reaches a message.

What it removes (each replaced by `[REDACTED]`):

- the values of the credentials this process holds: those a store
  registered (`remember`: an AWS secret key and session token, a Hugging
  Face token, a GCS bearer token) and those of the environment variables
  that hold them (`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `HF_TOKEN`,
  ...);
- what looks like one wherever it comes from: `Authorization` header
  values, `Bearer` tokens, SigV4 `Signature=` / `Credential=`, presigned
  query parameters (`X-Amz-Signature`, `X-Amz-Security-Token`,
  `X-Goog-Signature`, `Signature`, `token`, GCS's resumable `upload_id`),
  `<SignatureProvided>` in S3 error bodies, Hugging Face tokens (`hf_...`)
  Google OAuth access tokens (`ya29....`) and the password of a URL's
  user info (`https://user:password@host`).

Example:

```python
redact("GET https://b.s3.amazonaws.com/k?X-Amz-Signature=abc123 failed")
# 'GET https://b.s3.amazonaws.com/k?X-Amz-Signature=[REDACTED] failed'
```
"""

from __future__ import annotations

import os
import re
import threading

__all__ = ["MASK", "SECRET_HEADERS", "redact", "remember"]

MASK = "[REDACTED]"

# Headers that carry a credential: never sent on to another host by a
# redirect (see `ranged_http`), never shown.
SECRET_HEADERS = frozenset({
    "authorization", "proxy-authorization", "cookie", "x-amz-security-token",
    "x-goog-iam-authorization-token", "x-api-key",
})

_ENVIRONMENT = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "HF_TOKEN",
                "HUGGING_FACE_HUB_TOKEN", "GOOGLE_OAUTH_ACCESS_TOKEN")
_QUERY = ("x-amz-signature", "x-amz-credential", "x-amz-security-token", "x-goog-signature",
          "x-goog-credential", "signature", "googleaccessid", "awsaccesskeyid", "upload_id",
          "token", "access_token", "sig")
_PATTERNS = (
    # A header as text (`Authorization: ...`, `'Authorization': '...'`),
    # to the end of its value.
    (re.compile(r"(?i)((?:proxy-)?authorization|x-amz-security-token|cookie)(['\"]?\s*[:=]\s*['\"]?)"
                r"[^'\"\r\n<]+"), rf"\1\2{MASK}"),
    (re.compile(r"(?i)\b(bearer)\s+[\w\-.~+/]+=*"), rf"\1 {MASK}"),
    (re.compile(r"(?i)\b(signature|credential)=[^\s,&'\"<]+"), rf"\1={MASK}"),
    (re.compile(r"(?i)([?&;](?:" + "|".join(_QUERY) + r")=)[^&\s'\"#<]*"), rf"\1{MASK}"),
    (re.compile(r"(?i)(<(SignatureProvided|X-Amz-Security-Token|SessionToken|SecretAccessKey)>)[^<]*"),
     rf"\1{MASK}"),
    (re.compile(r"\b(hf|api_org)_[A-Za-z0-9]{20,}"), rf"\1_{MASK}"),
    (re.compile(r"\bya29\.[\w\-.]+"), MASK),
    # A password in a URL's user info (`https://user:password@host/`).
    (re.compile(r"(://[^/\s:@]*):[^/\s@]+@"), rf"\1:{MASK}@"),
)
_known: set[str] = set()
_lock = threading.Lock()


def remember(*secrets: str | None) -> None:
    """Registers credential values this process uses (a store's secret key,
    session token, bearer token), so `redact` removes them wherever they
    appear. Values under 8 characters are ignored (too common to mask)."""
    with _lock:
        _known.update(s for s in secrets if isinstance(s, str) and len(s) >= 8)


def redact(text: object) -> str:
    """`text` (a URL, a header dict, a body, an exception: anything `str`
    turns into text) with every secret in it replaced by `[REDACTED]`."""
    text = str(text)
    with _lock:
        known = set(_known)
    known.update(v for name in _ENVIRONMENT if len(v := os.environ.get(name, "")) >= 8)
    for secret in sorted(known, key=len, reverse=True):
        text = text.replace(secret, MASK)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text
