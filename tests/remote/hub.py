"""Hugging Face Hub routes for `remote_servers.RangeServer`.

Enough of the Hub for huggingface_hub 2.4 (`hf_hub_download`,
`HfApi.model_info`, `list_repo_files` / `list_repo_tree`, `get_paths_info`,
`HfFileSystem`) and for a client of its plain HTTP routes:

- `GET|HEAD /{repo_id}/resolve/{revision}/{path}` (a branch or the 40-hex
  commit sha), with Range, `X-Repo-Commit`, `ETag` (the git blob sha1, or
  the sha256 for LFS files) and for LFS files `X-Linked-Etag` /
  `X-Linked-Size`; with `lfs_redirect`, LFS files answer 302 to
  `http://localhost:PORT/lfs-objects/<sha256>` (another origin, like the
  Hub's CDN);
- `GET /api/models/{repo_id}[/revision/{revision}]` (`?blobs=1` adds sizes);
- `GET /api/models/{repo_id}/tree/{revision}[/{path}]?recursive=...`;
- `POST /api/models/{repo_id}/paths-info/{revision}` (form or JSON `paths`);
- 404s as the Hub words them: `X-Error-Code: RepoNotFound`,
  `RevisionNotFound` or `EntryNotFound` and a JSON `{"error": ...}`.

Which files are LFS: `*.safetensors`, `*.h5`, `*.bin` ... (the Hub's default
`.gitattributes`) and anything of 10 MiB or more.

Pointing huggingface_hub at it. `HF_ENDPOINT` is read once, when
huggingface_hub is imported (`constants.ENDPOINT` and the URL template of
`hf_hub_url`, and the module-level `HfApi` behind `huggingface_hub.model_info`
keeps its endpoint): set it before the import (a subprocess), or call
`patch_huggingface_hub(monkeypatch, endpoint, cache_dir)`, which patches
those three and the cache. `HfApi(endpoint=...)` and
`hf_hub_download(..., endpoint=...)` work without either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
import urllib.parse
from typing import Mapping

from remote.http_blobs import Blob, make_blob

LFS_SUFFIXES = (".safetensors", ".h5", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".npy",
                ".msgpack", ".onnx", ".gguf", ".keras", ".tflite", ".pkl", ".zip", ".gz")
LFS_MIN_SIZE = 10 * 1024 * 1024
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_API = re.compile(rf"^/api/models/{_REPO}(?:/(?P<op>revision|tree|paths-info)/(?P<rev>[^/]+)(?P<sub>/.*)?)?$")
_RESOLVE = re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_LFS = re.compile(r"^/lfs-objects/(?P<sha>[0-9a-f]{64})$")


@dataclasses.dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    blob_oid: str  # git blob sha1 (of the LFS pointer, for an LFS file)
    sha256: str | None  # LFS files only
    pointer_size: int | None
    blob: Blob  # what `RangeServer` serves

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.blob_oid, "size": self.size, "path": self.name}
        if self.sha256:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return entry


@dataclasses.dataclass
class _Repo:
    refs: dict  # revision name -> commit sha
    commits: dict  # commit sha -> {name: HubFile}
    modified: float


def _hashes(source) -> tuple[int, str, str]:
    """(size, git blob sha1, sha256) of bytes or a file, in one pass."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return len(data), git, hashlib.sha256(data).hexdigest()
    size = os.path.getsize(source)
    git, sha = hashlib.sha1(b"blob %d\0" % size), hashlib.sha256()
    with open(source, "rb") as f:
        while chunk := f.read(1 << 20):
            git.update(chunk)
            sha.update(chunk)
    return size, git.hexdigest(), sha.hexdigest()


def is_lfs(name: str, size: int) -> bool:
    return name.lower().endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE


def _error(status: int, code: str, message: str, **headers) -> tuple:
    return status, {"X-Error-Code": code, "X-Error-Message": message,
                    "Content-Type": "application/json", **headers}, \
        json.dumps({"error": message}).encode()


def _json(payload) -> tuple:
    return 200, {"Content-Type": "application/json"}, json.dumps(payload).encode()


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(seconds))


class HubRepos:
    """The model repos a `RangeServer` serves."""

    def __init__(self):
        self._repos: dict[str, _Repo] = {}
        self._lfs: dict[str, HubFile] = {}

    def add(self, repo_id: str, files: Mapping[str, object], revision: str = "main",
            commit_sha: str | None = None) -> str:
        """Adds (or moves `revision` to) a commit of `files` ({name: bytes |
        file path}); returns its sha (default: derived from the contents)."""
        entries = {}
        for name, source in files.items():
            source = source if isinstance(source, bytes) else os.fspath(source)
            size, git_oid, sha256 = _hashes(source)
            pointer = None
            if is_lfs(name, size):
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
                git_oid = hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
            etag = f'"{sha256}"' if pointer else f'"{git_oid}"'
            entries[name] = HubFile(name, size, git_oid, sha256 if pointer else None,
                                    len(pointer) if pointer else None,
                                    make_blob(source, etag=etag))
        if commit_sha is None:
            listing = sorted((n, f.blob_oid) for n, f in entries.items())
            commit_sha = hashlib.sha1(repr((repo_id, revision, listing)).encode()).hexdigest()
        if not re.fullmatch(r"[0-9a-f]{40}", commit_sha):
            raise ValueError(f"Expected a 40-hex commit sha. Received: {commit_sha!r}")
        repo = self._repos.setdefault(repo_id, _Repo({}, {}, time.time()))
        repo.refs[revision] = commit_sha
        repo.commits[commit_sha] = entries
        repo.modified = time.time()
        self._lfs.update({f.sha256: f for f in entries.values() if f.sha256})
        return commit_sha

    def key(self, raw_path: str) -> str | None:
        """The file name a request path (not decoded) addresses, if a Hub path."""
        if not self._repos:
            return None
        match = _LFS.match(raw_path)
        if match:
            found = self._lfs.get(match["sha"])
            return found.name if found else None
        match = _RESOLVE.match(raw_path)
        if match and match["repo"].split("/")[0] not in ("api", "lfs-objects"):
            return urllib.parse.unquote(match["file"])
        return None

    def route(self, method: str, raw_path: str, query: str, body: bytes | None,
              content_type: str, redirect_base: str | None) -> tuple | None:
        """(status, headers, bytes | blob) for a Hub path, None for another."""
        if not self._repos:
            return None
        unquote = urllib.parse.unquote
        match = _LFS.match(raw_path)
        if match:
            found = self._lfs.get(match["sha"])
            if found is None:
                return _error(404, "EntryNotFound", "Entry not found")
            return 200, {}, found.blob
        match = _API.match(raw_path)
        if match:
            return self._api(method, match["repo"], match["op"], unquote(match["rev"] or ""),
                             unquote(match["sub"] or "")[1:], query, body, content_type)
        match = _RESOLVE.match(raw_path)
        if match and match["repo"].split("/")[0] != "api":
            return self._resolve(method, match["repo"], unquote(match["rev"]),
                                 unquote(match["file"]), redirect_base)
        return None

    def _commit(self, repo_id: str, revision: str | None):
        """(sha, files) or an error reply."""
        repo = self._repos.get(repo_id)
        if repo is None:
            return None, _error(404, "RepoNotFound", "Repository not found")
        revision = revision or ("main" if "main" in repo.refs else next(iter(repo.refs)))
        sha = repo.refs.get(revision) or (revision if revision in repo.commits else None)
        if sha is None:
            return None, _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return (sha, repo.commits[sha]), None

    def _resolve(self, method, repo_id, revision, name, redirect_base):
        if method not in ("GET", "HEAD"):
            return _error(405, "MethodNotAllowed", f"{method} is not allowed on resolve")
        found, error = self._commit(repo_id, revision)
        if error:
            return error
        sha, files = found
        file = files.get(name)
        if file is None:
            return _error(404, "EntryNotFound", "Entry not found", **{"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha}
        if file.sha256:
            headers.update({"X-Linked-Etag": f'"{file.sha256}"', "X-Linked-Size": str(file.size)})
            if redirect_base:
                headers.update({"Location": f"{redirect_base}/lfs-objects/{file.sha256}",
                                "ETag": f'"{file.blob_oid}"'})
                return 302, headers, b""
        return 200, headers, file.blob

    def _api(self, method, repo_id, op, revision, sub, query, body, content_type):
        found, error = self._commit(repo_id, revision if op else None)
        if error:
            return error
        sha, files = found
        params = urllib.parse.parse_qs(query)
        if op in (None, "revision"):
            return self._info(repo_id, sha, files, params.get("blobs", [""])[0].lower() in ("1", "true"))
        if op == "tree":
            recursive = params.get("recursive", [""])[0].lower() in ("1", "true")
            entries = self._tree(files, sha, sub.strip("/"), recursive)
            if entries is None:
                return _error(404, "EntryNotFound", f"{sub} not found at {revision}")
            return _json(entries)
        if method != "POST":
            return _error(405, "MethodNotAllowed", "paths-info takes a POST")
        if "json" in content_type:
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = urllib.parse.parse_qs((body or b"").decode()).get("paths", [])
        paths = [paths] if isinstance(paths, str) else paths
        everything = self._tree(files, sha, "", recursive=True)
        by_path = {entry["path"]: entry for entry in everything}
        return _json([by_path[p.strip("/")] for p in paths if p.strip("/") in by_path])

    def _info(self, repo_id, sha, files, blobs):
        siblings = []
        for file in files.values():
            sibling = {"rfilename": file.name}
            if blobs:
                sibling.update(size=file.size, blobId=file.blob_oid)
                if file.sha256:
                    sibling["lfs"] = {"size": file.size, "sha256": file.sha256,
                                      "pointerSize": file.pointer_size}
            siblings.append(sibling)
        modified = _iso(self._repos[repo_id].modified)
        return _json({
            "_id": sha[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
            "sha": sha, "lastModified": modified, "createdAt": modified, "private": False,
            "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": siblings,
        })

    @staticmethod
    def _tree(files, sha, prefix, recursive) -> list | None:
        """Entries under directory `prefix` ("" = root), or None if none is."""
        dirs = {"/".join(name.split("/")[:i]) for name in files for i in range(1, name.count("/") + 1)}
        if prefix and prefix not in dirs:
            return None
        base = f"{prefix}/" if prefix else ""

        def under(path):
            rest = path[len(base):]
            return path.startswith(base) and rest and (recursive or "/" not in rest)

        entries = [{"type": "directory", "size": 0, "path": d,
                    "oid": hashlib.sha1(f"{sha}:{d}".encode()).hexdigest()}
                   for d in sorted(dirs) if under(d)]
        return entries + [files[n].tree_entry() for n in sorted(files) if under(n)]


def hub_env(endpoint: str, cache_dir: str) -> dict[str, str]:
    """Environment for a process that imports huggingface_hub afterwards."""
    return {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache_dir),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}


def patch_huggingface_hub(monkeypatch, endpoint: str, cache_dir: str) -> None:
    """Points an already imported huggingface_hub at `endpoint` for one test
    (the environment too, for what reads it later or in a subprocess)."""
    import huggingface_hub.constants as constants
    import huggingface_hub.hf_api as hf_api

    for name, value in hub_env(endpoint, cache_dir).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)
