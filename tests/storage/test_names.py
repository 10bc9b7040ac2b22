"""`storage.names`: the one check every name from a checkpoint or a listing
goes through, and the staging writes that never leave their folder."""

import os

import pytest

from keras_hub_dist import PresetError
from keras_hub_dist.storage import names

BAD = {
    "": "is empty", "/etc/passwd": "is an absolute path", "a//b": "empty segment",
    "a/": "empty segment", "../x": "'..' segment", "a/../../x": "'..' segment",
    ".": "'.' segment", "a/./b": "'.' segment", "./a": "'.' segment",
    "a\\b": "backslash", "C:x": "drive letter", "c:/x": "drive letter", "a\x00b": "NUL",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_rule_is_named_with_the_source_and_the_fix(name):
    with pytest.raises(PresetError) as info:
        names.check_name(name, source="the index 'x/model.safetensors.index.json'")
    message = str(info.value)
    assert BAD[name] in message and "the index 'x/model.safetensors.index.json'" in message
    assert repr(name) in message and "Fix the name" in message


@pytest.mark.parametrize("name", ["model.safetensors", "assets/tokenizer/vocabulary.spm", ".hidden", "..x", "x.."])
def test_valid_names_pass_unchanged(name):
    assert names.check_name(name, source="s") == name


def test_remote_keys_stay_under_the_prefix():
    assert names.remote_key("p/q/", "a/b.json", source="s") == "p/q/a/b.json"
    assert names.remote_key("", "a.json", source="s") == "a.json"
    for name in ("../x", "/x", "a//b", "."):
        with pytest.raises(PresetError):
            names.remote_key("p", name, source="s")


def test_staged_files_are_created_inside_only(tmp_path):
    folder = tmp_path / "staging"
    folder.mkdir()
    path = names.create_staged(str(folder), "assets/tokenizer/v.spm", b"abc", source="s3://b/p")
    assert open(path, "rb").read() == b"abc" and path == str(folder / "assets/tokenizer/v.spm")
    with pytest.raises(PresetError, match="exists there already"):  # never replaced
        names.create_staged(str(folder), "assets/tokenizer/v.spm", b"other", source="s3://b/p")
    assert names.create_staged(str(folder), "assets/tokenizer/v.spm", b"abc", source="s3://b/p") == path
    assert sorted(os.listdir(folder / "assets/tokenizer")) == ["v.spm"]  # no temporary left
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, folder / "linked")  # a folder planted as a link
    with pytest.raises(PresetError, match="not a plain folder"):
        names.create_staged(str(folder), "linked/x.json", b"abc", source="s3://b/p")
    os.symlink(outside / "target", folder / "config.json")  # a file planted as a link
    with pytest.raises(PresetError, match="exists there already"):
        names.create_staged(str(folder), "config.json", b"abc", source="s3://b/p")
    assert os.listdir(outside) == [] and open(path, "rb").read() == b"abc"


def test_local_paths_resolve_inside_the_root_or_the_hub_blobs(tmp_path):
    root = tmp_path / "models--o--n" / "snapshots" / "rev"
    root.mkdir(parents=True)
    (tmp_path / "models--o--n" / "blobs").mkdir()
    (tmp_path / "models--o--n" / "blobs" / "h").write_bytes(b"x")
    os.symlink("../../blobs/h", root / "config.json")
    assert names.local_path(str(root), "config.json", source="s") == str(root / "config.json")
    (tmp_path / "elsewhere").write_bytes(b"x")
    os.symlink(tmp_path / "elsewhere", root / "other.json")
    with pytest.raises(PresetError, match="outside the checkpoint"):
        names.local_path(str(root), "other.json", source="s")
    plain = tmp_path / "plain"
    plain.mkdir()
    os.symlink(tmp_path / "models--o--n" / "blobs" / "h", plain / "config.json")
    with pytest.raises(PresetError, match="outside the checkpoint"):  # not a snapshot
        names.local_path(str(plain), "config.json", source="s")


def test_a_hub_cache_whose_blobs_folder_is_a_link_gets_no_exception(tmp_path):
    repo = tmp_path / "models--o--n"
    root = repo / "snapshots" / "rev"
    root.mkdir(parents=True)
    os.symlink("/", repo / "blobs")
    os.symlink("../../blobs/etc/hostname", root / "config.json")
    with pytest.raises(PresetError, match="outside the checkpoint"):
        names.local_path(str(root), "config.json", source="s")
