"""The Hugging Face Hub of `RangeServer` (tests/remote/hub.py) as
huggingface_hub 2.4 sees it: downloads, repo info, trees, paths-info,
HfFileSystem ranges and the Hub's errors."""

import hashlib
import json
import pathlib

import pytest
import urllib3

huggingface_hub = pytest.importorskip("huggingface_hub")

from huggingface_hub import HfApi, HfFileSystem, hf_hub_download  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
)

WEIGHTS = bytes(range(256)) * 64  # 16 KiB: LFS by its suffix
FILES = {"config.json": b'{"name": "tiny"}', "model.safetensors": WEIGHTS,
         "tokenizer/vocab.txt": b"a\nb\n"}
REPO = "khd-tests/tiny"


@pytest.fixture
def repo(hub_server, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(WEIGHTS)  # served from disk
    files = {**FILES, "model.safetensors": str(tmp_path / "model.safetensors")}
    return hub_server, hub_server.add_hub_repo(REPO, files)


@pytest.mark.parametrize("lfs_redirect", [False, True], ids=["direct", "redirect"])
@pytest.mark.parametrize("by_sha", [False, True], ids=["main", "sha"])
def test_hf_hub_download(repo, tmp_path, lfs_redirect, by_sha):
    server, sha = repo
    server.lfs_redirect = lfs_redirect
    revision = sha if by_sha else None
    for name, data in FILES.items():
        path = hf_hub_download(REPO, name, revision=revision, cache_dir=tmp_path / "cache")
        assert pathlib.Path(path).read_bytes() == data
        assert f"/snapshots/{sha}/" in path
    lfs = [r for r in server.log if r.key == "model.safetensors"]
    if lfs_redirect:  # the 302 carries the metadata; the GET goes to its Location
        assert [(r.method, r.status, r.path.split("/")[1]) for r in lfs] == [
            ("HEAD", 302, "khd-tests"), ("GET", 200, "lfs-objects")]
    else:
        assert [(r.method, r.status) for r in lfs] == [("HEAD", 200), ("GET", 200)]
    assert server.bytes_sent(key="model.safetensors") == len(WEIGHTS)


def test_resolve_headers(repo):
    server, sha = repo
    pool = urllib3.PoolManager(retries=False)
    head = pool.request("HEAD", f"{server.url}/{REPO}/resolve/main/model.safetensors")
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    assert head.headers["X-Repo-Commit"] == sha
    assert head.headers["ETag"] == head.headers["X-Linked-Etag"] == f'"{sha256}"'
    assert head.headers["X-Linked-Size"] == head.headers["Content-Length"] == str(len(WEIGHTS))
    small = pool.request("GET", f"{server.url}/{REPO}/resolve/{sha}/config.json",
                         headers={"Range": "bytes=1-6"})
    git_oid = hashlib.sha1(b"blob 16\0" + FILES["config.json"]).hexdigest()
    assert (small.status, small.data) == (206, FILES["config.json"][1:7])
    assert small.headers["ETag"] == f'"{git_oid}"' and "X-Linked-Etag" not in small.headers
    stale = pool.request("GET", f"{server.url}/{REPO}/resolve/main/config.json",
                         headers={"If-Match": f'"{sha256}"'})
    assert stale.status == 412


def test_api_routes(repo):
    server, sha = repo
    api = HfApi()  # the endpoint patched by the hub_server fixture
    info = api.model_info(REPO)
    assert (info.id, info.sha) == (REPO, sha)
    assert sorted(s.rfilename for s in info.siblings) == sorted(FILES)
    detailed = api.model_info(REPO, revision=sha, files_metadata=True)
    sizes = {s.rfilename: (s.size, s.lfs.sha256 if s.lfs else None) for s in detailed.siblings}
    assert sizes["model.safetensors"] == (len(WEIGHTS), hashlib.sha256(WEIGHTS).hexdigest())
    assert sizes["config.json"] == (16, None)
    assert huggingface_hub.model_info(REPO).sha == sha  # the module-level HfApi too
    assert sorted(api.list_repo_files(REPO)) == sorted(FILES)
    top = {(type(e).__name__, e.path) for e in api.list_repo_tree(REPO)}
    assert top == {("RepoFile", "config.json"), ("RepoFile", "model.safetensors"),
                   ("RepoFolder", "tokenizer")}
    assert [e.path for e in api.list_repo_tree(REPO, "tokenizer")] == ["tokenizer/vocab.txt"]
    found = api.get_paths_info(REPO, ["config.json", "tokenizer", "missing.bin"], revision=sha)
    assert [(type(e).__name__, e.path) for e in found] == [
        ("RepoFile", "config.json"), ("RepoFolder", "tokenizer")]


def test_hf_file_system_reads_a_range(repo):
    server, _ = repo
    fs = HfFileSystem(skip_instance_cache=True)
    assert fs.cat_file(f"{REPO}/model.safetensors", start=100, end=164) == WEIGHTS[100:164]
    assert fs.info(f"{REPO}/model.safetensors")["size"] == len(WEIGHTS)
    ranged = [r for r in server.log if r.key == "model.safetensors" and r.method == "GET"]
    # fsspec reads ahead to the end of its block (the whole file here).
    assert [(r.start, r.end, r.bytes_sent) for r in ranged] == [
        (100, len(WEIGHTS), len(WEIGHTS) - 100)]


def test_errors_as_the_hub_words_them(repo, tmp_path):
    server, _ = repo
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("khd-tests/missing")
    with pytest.raises(RevisionNotFoundError):
        HfApi().model_info(REPO, revision="v9")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.bin", cache_dir=tmp_path)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("khd-tests/missing", "config.json", cache_dir=tmp_path)
    r = urllib3.PoolManager().request("GET", f"{server.url}/{REPO}/resolve/main/missing.bin")
    assert (r.status, r.headers["X-Error-Code"], json.loads(r.data)) == (
        404, "EntryNotFound", {"error": "Entry not found"})


def test_a_second_revision(repo, tmp_path):
    server, first = repo
    second = server.add_hub_repo(REPO, {"config.json": b'{"name": "v2"}'}, revision="v2",
                                 commit_sha="b" * 40)
    assert second == "b" * 40
    assert HfApi().model_info(REPO).sha == first  # main did not move
    path = hf_hub_download(REPO, "config.json", revision="v2", cache_dir=tmp_path)
    assert pathlib.Path(path).read_bytes() == b'{"name": "v2"}'
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "model.safetensors", revision=second, cache_dir=tmp_path)
