"""Every ```python block of README.md and docs/*.md runs, so the examples
cannot rot.

Each block runs in this process (the 8 simulated CPU devices of
tests/conftest.py), compiled under its page's name with the page's line
numbers, so a failure names the page and line (the test id is
`docs/save.md:42`). The blocks of one page run in order in one working
directory, as a reader would run them: a later block may read what an
earlier one wrote (`./gemma_7b_tuned`).

What the examples name is served by tiny stand-ins this module writes:

- named architectures (`"gemma_7b_en"`, `"llama3_8b_en"`, ...) resolve to
  shrunk configs (`TINY`: 1-2 blocks, hidden 64, vocab 512);
- KerasHub preset names (`load_sharded_preset("gemma_7b_en")`) resolve to a
  local tiny preset instead of Kaggle (KerasHub's `BUILTIN_PRESETS` entry is
  pointed at it);
- local directories (`"./my_gemma_preset"`, `"./Qwen3-30B-A3B"`) are tiny
  checkpoints in the page's directory (`LOCAL`);
- remote locations (`REMOTE`) are served on loopback by the servers of
  tests/remote/: S3 by moto, GCS by gcp-storage-emulator, the Hub and plain
  HTTP by `RangeServer`; `https://models.example.com` is the one URL
  rewritten (to the loopback HTTP server) before the block runs.

A block that cannot run here carries a marker on the line right above its
fence, `<!-- not run: <reason> -->`; every other block runs, and at least
`MIN_RUN_SHARE` of all blocks must.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import pathlib
import re

import keras
import pytest

import keras_hub_dist
from keras_hub_dist import PresetError
from keras_hub_dist.plan import build as plan_build
from keras_hub_dist.plan import presets as plan_presets

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- not run: (?P<reason>\S.*?) -->")
MIN_RUN_SHARE = 0.8

# Named architectures the examples build or load, shrunk (1-2 blocks, hidden
# 64, vocab 512 with the family's tiny tokenizer); 8 heads so that every
# mesh of 8 devices divides them.
_HEADS = dict(hidden_dim=64, intermediate_dim=128, num_query_heads=8, num_key_value_heads=8,
              vocabulary_size=512, num_layers=1)
TINY = {
    "gemma_7b_en": dict(_HEADS, head_dim=8),
    "gemma2_9b_en": dict(_HEADS, head_dim=8),
    "gemma3_4b_text": dict(_HEADS, head_dim=8),
    "llama3_8b_en": dict(_HEADS),
    "qwen3_8b_en": dict(_HEADS, head_dim=8, sliding_window_size=None),
    "qwen3_moe_30b_a3b_en": dict(_HEADS, head_dim=8, num_key_value_heads=2, moe_intermediate_dim=32,
                                 num_experts=8, top_k=2),
}
# KerasHub preset names served by the tiny preset of the same name.
BUILTIN = ("gemma_7b_en", "llama3_8b_en")
# Checkpoints, by the named architecture they are written from and format.
CHECKPOINTS = {
    "gemma": ("gemma_7b_en", "keras"),
    "gemma2": ("gemma2_9b_en", "keras"),
    "llama3": ("llama3_8b_en", "keras"),
    "qwen3_hf": ("qwen3_8b_en", "huggingface"),
    "qwen3_moe_hf": ("qwen3_moe_30b_a3b_en", "huggingface"),
    "gemma3_hf": ("gemma3_4b_text", "huggingface"),
}
# Hugging Face checkpoints with a tokenizer: the causal LM written around the
# backbone (the tiny Gemma 3 KerasHub preset has no image converter, which
# KerasHub's Gemma 3 task loader asks for).
HF_TASKS = {"gemma3_hf": ("Gemma3CausalLM", "Gemma3CausalLMPreprocessor", "Gemma3Tokenizer")}
# Directories the examples read from the working directory.
LOCAL = {
    "my_gemma_preset": "gemma",
    "Qwen3-30B-A3B": "qwen3_moe_hf",
    "Qwen3-8B": "qwen3_hf",
}
# Remote locations the examples read.
REMOTE = {
    "s3://my-bucket/presets/gemma2_9b_en": "gemma2",
    "gs://my-bucket/Qwen3-30B-A3B": "qwen3_moe_hf",
    "gs://my-bucket/gemma2_9b_en": "gemma2",
    "hf://google/gemma-3-4b-it": "gemma3_hf",
    "https://models.example.com/llama3_8b_en": "llama3",
}
# Buckets the examples write into (created empty, the environment set).
TARGETS = {"s3://my-bucket/gemma_7b_tuned", "s3://my-bucket/tuned/gemma_7b", "gs://my-bucket/gemma2_9b_tuned",
           "gs://my-bucket/gemma_7b_hf", "gs://my-bucket/tuned/gemma_7b_hf", "gs://my-bucket/gemma_7b_tune",
           "gs://my-bucket/gemma_adapter"}
_URL = re.compile(r"\b(?:s3|gs|hf|https?)://[A-Za-z0-9._/-]+")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    code: str
    not_run: str | None  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of a page, each with the marker above it, if any."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    blocks, i = [], 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith("```") and fence != "```python" and len(fence) > 3:
            # Another language's block: skip to its end.
            i += 1
            while lines[i].strip() != "```":
                i += 1
        elif fence == "```python":
            indent = len(lines[i]) - len(lines[i].lstrip())
            end = i + 1
            while lines[end].strip() != "```":
                end += 1
            code = "\n".join(line[indent:] for line in lines[i + 1:end])
            above = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            marker = MARKER.fullmatch(above)
            blocks.append(Block(page, i + 1, code, marker["reason"] if marker else None))
            i = end
        i += 1
    return blocks


ALL_BLOCKS = [block for path in PAGES for block in _blocks(path)]
RUN_BLOCKS = [block for block in ALL_BLOCKS if block.not_run is None]


def test_every_block_is_run_or_marked_with_a_reason():
    assert len(ALL_BLOCKS) >= 20, [b.id for b in ALL_BLOCKS]
    for block in ALL_BLOCKS:
        compile(block.code, block.id, "exec")  # marked ones are at least Python
    share = len(RUN_BLOCKS) / len(ALL_BLOCKS)
    marked = {b.id: b.not_run for b in ALL_BLOCKS if b.not_run}
    assert share >= MIN_RUN_SHARE, (share, marked)
    # Every marker sits right above a block (none left dangling).
    markers = sum(len(MARKER.findall(path.read_text())) for path in PAGES)
    assert markers == len(marked), (markers, marked)


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    anchors, seen = set(), {}
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_page_is_linked_both_ways_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    for path in [*PAGES, ROOT / "BENCHMARKS.md"]:
        text = path.read_text()
        if path.parent.name == "docs":
            assert f"(docs/{path.name})" in readme, f"README.md does not link {path.name}"
            assert "(../README.md)" in text, f"{path.name} does not link back to README.md"
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if "://" in target:
                continue
            linked = (path.parent / target).resolve() if target else path
            assert linked.exists(), f"{path.name}: broken link {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{path.name}: no heading #{anchor} in {target or path.name}"



# The README's front page is read in five minutes, and BENCHMARKS.md holds the
# present per capability, not a lab notebook: superseded runs live in git
# history and in one line each under its "Decisions" (issue 58).
MAX_LINES = {"README.md": 250, "BENCHMARKS.md": 800}


def test_the_front_page_and_the_benchmarks_stay_short():
    for name, most in MAX_LINES.items():
        lines = len((ROOT / name).read_text().splitlines())
        assert lines <= most, (
            f"{name}: expected at most {most} lines, received {lines}. Move detail into the docs/ page "
            "the README links, or a superseded run into git history and one line under BENCHMARKS.md's Decisions")


# -- the stand-ins ------------------------------------------------------------


def _tiny_named_architectures(patch):
    """Every `TINY` name resolves to its shrunk config (cached specs dropped)."""
    by_name, keys = plan_presets._load()
    by_name = dict(by_name)
    for name, overrides in TINY.items():
        config = by_name[name].config_json()
        config["config"].update(overrides)
        by_name[name] = dataclasses.replace(by_name[name], _config_json=json.dumps(config, sort_keys=True))
    patch.setattr(plan_presets, "_load", lambda: (by_name, keys))
    plan_build._cached_specs.cache_clear()


def _write_checkpoint(root: pathlib.Path, key: str) -> str:
    import keras_hub

    name, fmt = CHECKPOINTS[key]
    keras_dir = str(root / f"{key}_keras")
    task = HF_TASKS.get(key)
    tokenizer = fmt == "keras" or task is not None
    keras_hub_dist.write_synthetic_preset(keras_dir, name, dtype="float32", tokenizer=tokenizer, seed=1)
    if fmt == "keras":
        return keras_dir
    model = keras_hub_dist.load_sharded_preset(keras_dir, mesh=(1, 8), progress=False)
    if task is not None:  # a causal LM around it, with the preset's tokenizer
        lm_cls, preprocessor_cls, tokenizer_cls = (getattr(keras_hub.models, n) for n in task)
        model = lm_cls(backbone=model, preprocessor=preprocessor_cls(tokenizer=tokenizer_cls.from_preset(keras_dir)))
    keras_hub_dist.save_sharded_preset(model, str(root / key), format="huggingface")
    keras.distribution.set_distribution(None)
    return str(root / key)


@dataclasses.dataclass
class World:
    """The tiny checkpoints, the servers serving them, one directory per page."""

    root: pathlib.Path
    checkpoints: dict[str, str]
    stack: contextlib.ExitStack
    patch: pytest.MonkeyPatch
    servers: dict = dataclasses.field(default_factory=dict)
    served: dict = dataclasses.field(default_factory=dict)
    rewrites: dict = dataclasses.field(default_factory=dict)
    page_dirs: dict = dataclasses.field(default_factory=dict)

    def page_dir(self, page: str) -> pathlib.Path:
        if page not in self.page_dirs:
            where = self.root / "pages" / page.replace("/", "_")
            where.mkdir(parents=True)
            for name, key in LOCAL.items():
                (where / name).symlink_to(self.checkpoints[key])
            self.page_dirs[page] = where
        return self.page_dirs[page]

    def serve(self, url: str) -> None:
        """Uploads the stand-in of a remote location to its loopback server."""
        if url in self.served:
            return
        from remote import hub, servers, stores

        if url in TARGETS:
            self._target(url)
            self.served[url] = True
            return
        if url not in REMOTE:
            raise AssertionError(f"{url}: no stand-in; add it to REMOTE in tests/test_docs.py")
        local = self.checkpoints[REMOTE[url]]
        scheme, rest = url.split("://", 1)
        if scheme in ("s3", "gs"):
            bucket, prefix = rest.split("/", 1)
            if scheme == "s3":
                s3 = self._server("moto", stores.MotoS3)
                remotes = self.stack.enter_context(stores.checkpoint_everywhere(
                    local, s3=s3, gcs=None, schemes=("s3",), bucket=bucket, prefix=prefix))
            else:
                gcs = self._server("gcs", stores.GcsEmulator)
                remotes = self.stack.enter_context(stores.checkpoint_everywhere(
                    local, s3=None, gcs=gcs, schemes=("gs",), bucket=bucket, prefix=prefix))
            for name, value in remotes[scheme].env.items():
                if value is None:
                    self.patch.delenv(name, raising=False)
                else:
                    self.patch.setenv(name, value)
        elif scheme == "hf":
            server = self._server("hub", servers.RangeServer)
            if "hub_patched" not in self.servers:
                hub.patch_huggingface_hub(self.patch, server.url, str(self.root / "hf-cache"))
                self.servers["hub_patched"] = True
            server.add_hub_repo(rest, {rel: path for path, rel in servers.walk_files(local)})
        else:
            server = self._server("http", servers.RangeServer)
            host, prefix = rest.split("/", 1)
            server.put_dir(local, prefix)
            self.rewrites[f"{scheme}://{host}"] = server.url
        self.served[url] = True

    def _target(self, url: str) -> None:
        """An empty bucket for a save to write into."""
        from remote import stores

        scheme, rest = url.split("://", 1)
        bucket = rest.split("/", 1)[0]
        if scheme == "s3":
            s3 = self._server("moto", stores.MotoS3)
            if bucket not in {b["Name"] for b in s3.client().list_buckets().get("Buckets", [])}:
                s3.client().create_bucket(Bucket=bucket)
            env = stores.s3_env(s3.endpoint)
        else:
            gcs = self._server("gcs", stores.GcsEmulator)
            gcs.create_bucket(bucket)
            env = stores.gcs_env(gcs.endpoint)
        for name, value in env.items():
            if value is None:
                self.patch.delenv(name, raising=False)
            else:
                self.patch.setenv(name, value)

    def _server(self, name, factory):
        if name not in self.servers:
            self.servers[name] = self.stack.enter_context(factory())
        return self.servers[name]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from keras_hub.src.utils import preset_utils

    root = tmp_path_factory.mktemp("docs")
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        _tiny_named_architectures(patch)
        checkpoints = {key: _write_checkpoint(root, key) for key in CHECKPOINTS}
        for key, (name, fmt) in CHECKPOINTS.items():
            if name in BUILTIN:
                patch.setitem(preset_utils.BUILTIN_PRESETS[name], "kaggle_handle", checkpoints[key])
        try:
            yield World(root, checkpoints, stack, patch)
        finally:
            gc.unfreeze()  # what `_run` froze: collected at the module's end (conftest.py)
    plan_build._cached_specs.cache_clear()


def _run(block: Block, world: World) -> None:
    code = block.code
    for url in sorted(set(_URL.findall(code))):
        world.serve(url.split("@")[0].rstrip("/"))
    for old, new in world.rewrites.items():
        code = code.replace(old, new)
    compiled = compile("\n" * block.line + code, str(ROOT / block.page), "exec")
    # Out of reach of the block's own collections: the world, the servers and
    # the modules the earlier blocks imported (moto, Orbax, ...). Keras's
    # `Layer.__delattr__` runs `gc.collect()` per variable a stock
    # `quantize` replaces (docs/quantization.md): 8 walks of all of it, ~1 s
    # each. (Freezing walks nothing; the world's teardown unfreezes.)
    gc.freeze()
    cwd = os.getcwd()
    os.chdir(world.page_dir(block.page))
    try:
        exec(compiled, {"__name__": "__docs__"})
    finally:
        os.chdir(cwd)
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_example_runs(block, world):
    _run(block, world)


def test_a_broken_example_fails(world):
    """The runner is not a no-op: an example that fails fails the test."""
    broken = Block("docs/load.md", 1, 'keras_hub_dist.load_sharded_preset("./my_gemma_presett")', None)
    with pytest.raises(NameError):
        _run(broken, world)
    broken = dataclasses.replace(broken, code="import keras_hub_dist\n" + broken.code)
    with pytest.raises(PresetError, match="does not exist"):
        _run(broken, world)
    with pytest.raises(AssertionError, match="no stand-in"):
        _run(dataclasses.replace(broken, code='"s3://elsewhere/x"'), world)


def test_the_stand_ins_are_tiny(world):
    assert plan_presets.resolve("gemma_7b_en").config["hidden_dim"] == 64
    assert all(
        sum(f.stat().st_size for f in pathlib.Path(p).rglob("*") if f.is_file()) < 10 << 20
        for p in world.checkpoints.values())
