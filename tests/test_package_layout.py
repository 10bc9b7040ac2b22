"""The package's shape: imports run one way (no two modules import each other,
and every import goes down the order of rooms below), no room uses another
room's private names, no module over 600 lines and no room over a fifth of
the package's lines, private Keras/JAX names only in `_compat.py`, which
keeps no state.

Every import counts: at module level, inside a function, under
`TYPE_CHECKING`, absolute or relative.
"""

import ast
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_hub_dist"
MAX_LINES = 600

# The order of the rooms, bottom to top: a module imports modules of its own
# room or of rooms ranked lower, never higher. A room is a subpackage
# (`plan`, ...) or a module at the package root.
RANKS = {
    # Private helpers: exceptions and warnings, then the private Keras/JAX
    # names and progress bars, then what the processes of a job agree on
    # (which detaches JAX's distributed client through _compat when a
    # process is lost).
    "errors": 0,
    "_compat": 1,
    "_progress": 1,
    # A lost process (its error, the beats that notice it, the test hook
    # that kills one), then what the processes agree on.
    "_lost": 1.5,
    "_processes": 2,
    # Where bytes live and how they move (files, HTTP ranges, object stores,
    # host buffers): nothing of what the bytes mean.
    "storage": 3,
    # Memory measurement, which the loader (memory_report) and validate use.
    "measure": 4,
    # The phases: plan (where each weight lives) -> shaping (how fit and
    # generate run on the mesh: the batch axis, the gathers, the
    # weight-stationary layouts, remat, the chunked prompt pass and the KV
    # cache's layout, the task around a backbone), applied by the builders
    # above it -> formats (what the bytes mean) -> quantize (int8 / int4
    # from float blocks) -> init / load / save.
    "plan": 5,
    "shaping": 6,
    "formats": 7,
    "quantize": 8,
    "init": 9,
    "load": 9,
    "save": 9,
    "adapters": 10,
    # A checkpoint turned into the other format file to file: it reads as
    # `load` does and writes as `save` does.
    "convert": 10,
    # The job around the checkpoint (fit / generate planned per device): it
    # builds tasks as the loader does and LoRA as `adapters` does.
    "jobs": 11,
    # The validation worker, runner and report, which plan jobs too.
    "validate": 12,
    # The command line: `keras-hub-dist validate | convert | plan`.
    "cli": 13,
    # Public names re-exported from their homes, then the package itself.
    "initializers": 14,
    "memory": 14,
    "presets": 14,
    "registry": 14,
    "": 15,
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _is_module(dotted):
    base = PACKAGE.parent / dotted.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _from_module(name, node, is_package):
    """The module a `from ... import` node of module `name` names, a relative
    one resolved against `name`'s package."""
    module = node.module or ""
    if not node.level:
        return module
    package = name.split(".") if is_package else name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([module] if module else []))


def _imports_in(name, source, is_package=False):
    """Modules of this package that `source` (module `name`) imports, in any
    form: every `import` / `from` node of the tree, wherever it is."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "keras_hub_dist")
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(name, node, is_package)
            if module.split(".")[0] != "keras_hub_dist":
                continue
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                found.add(candidate if _is_module(candidate) else module)
    return found - {name}


def _graph():
    return {
        name: _imports_in(name, path.read_text(), path.name == "__init__.py")
        for name, path in _modules()
    }


def _room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_import_walk_sees_every_form():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import keras_hub_dist.errors\n"
        "from keras_hub_dist.plan import mesh\n"
        "from keras_hub_dist.plan.specs import shard_shape\n"
        "from . import checksums\n"
        "from .base import ByteRuns\n"
        "from .. import _progress\n"
        "if TYPE_CHECKING:\n"
        "    from keras_hub_dist.load.loader import LoadReport\n"
        "def f():\n"
        "    import keras_hub_dist\n"
        "    from keras_hub_dist.validate import memory_not_a_module\n"
        "class C:\n"
        "    def g(self):\n"
        "        from keras_hub_dist.init import initializers\n"
    )
    assert _imports_in("keras_hub_dist.formats.keras_h5", source) == {
        "keras_hub_dist.errors",
        "keras_hub_dist.plan.mesh",
        "keras_hub_dist.plan.specs",
        "keras_hub_dist.formats.checksums",
        "keras_hub_dist.formats.base",
        "keras_hub_dist._progress",
        "keras_hub_dist.load.loader",
        "keras_hub_dist",
        "keras_hub_dist.validate",
        "keras_hub_dist.init.initializers",
    }


def _private_uses(name, source, is_package=False):
    """Private names (`_x`, not dunders) of another room that `source`
    (module `name`) takes: imported (`from keras_hub_dist.save.saver import
    _prepare`) or used as an attribute of a module it imported
    (`saver._prepare`, `keras_hub_dist.save.saver._prepare`)."""
    tree = ast.parse(source)
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "keras_hub_dist":
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(name, node, is_package)
            if module.split(".")[0] != "keras_hub_dist":
                continue
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                if _is_module(candidate):
                    modules[alias.asname or alias.name] = candidate
                elif _is_private(alias.name) and _room(module) != _room(name):
                    found.append(f"from {module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = ast.unparse(node.value)
            module = modules.get(owner, owner if owner.startswith("keras_hub_dist.") else None)
            if module is not None and _room(module) != _room(name):
                found.append(f"{owner}.{node.attr}")
    return found


def _is_private(attr):
    return attr.startswith("_") and not attr.startswith("__")


def test_private_name_walk_sees_imports_and_attributes():
    source = (
        "import keras_hub_dist.save.saver\n"
        "from keras_hub_dist.save import hf_export, saver as s\n"
        "from keras_hub_dist.save.staging import _report, publish\n"
        "from keras_hub_dist.convert import file_to_file\n"
        "def f():\n"
        "    s._prepare()\n"
        "    hf_export._finish()\n"
        "    keras_hub_dist.save.saver._claim_target()\n"
        "    file_to_file._to_keras()\n"
        "    hf_export.__name__, publish._x\n"
    )
    assert _private_uses("keras_hub_dist.convert.into_bucket", source) == [
        "from keras_hub_dist.save.staging import _report",
        "s._prepare",
        "hf_export._finish",
        "keras_hub_dist.save.saver._claim_target",
    ]


def test_no_room_uses_another_rooms_private_names():
    offenders = [
        f"{name}: {use}"
        for name, path in _modules()
        for use in _private_uses(name, path.read_text(), path.name == "__init__.py")
    ]
    assert not offenders, (
        "promote what is shared to a public name of the room it belongs to:\n" + "\n".join(offenders)
    )


def test_no_room_holds_over_a_fifth_of_the_lines():
    lines = {}
    for name, path in _modules():
        room = _room(name)
        lines[room] = lines.get(room, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    large = {room: n for room, n in lines.items() if room and n > total / 5}
    assert not large, f"rooms over a fifth of the package's {total} lines: {large}"


def test_no_module_over_600_lines():
    long = {name: n for name, path in _modules() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_room_has_a_rank():
    rooms = {_room(name) for name, _ in _modules()}
    assert rooms == set(RANKS), (
        f"rooms without a rank: {sorted(rooms - set(RANKS))}; "
        f"ranks of rooms that are gone: {sorted(set(RANKS) - rooms)}"
    )


def _subpackages():
    return {path.parent.name for path in PACKAGE.glob("*/__init__.py")}


def test_architecture_page_and_pyproject_name_every_room():
    """docs/architecture.md's table of rooms and its order of imports, and
    pyproject's packages, agree with the tree and with `RANKS`."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = set(re.findall(r"^\| `keras_hub_dist/(\w+)/` \|", page, flags=re.M))
    assert table == _subpackages(), (
        f"rooms missing from the table: {sorted(_subpackages() - table)}; "
        f"rows of rooms that are gone: {sorted(table - _subpackages())}"
    )
    order = page.split("## Import ranks", 1)[1].split("\n\n")[2]
    segments = [re.findall(r"`(\w+)/`", segment) for segment in order.split("→")]
    named = [rooms for rooms in segments if rooms]
    assert sorted(r for rooms in named for r in rooms) == sorted(_subpackages()), order
    ranks = [{RANKS[r] for r in rooms} for rooms in named]
    assert all(len(rank) == 1 for rank in ranks), (order, ranks)
    assert [r.pop() for r in ranks] == sorted({RANKS[r] for r in _subpackages()}), order
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    listed = {p.split(".", 1)[1] for p in packages if p.count(".") == 1 and p != "keras_hub_dist._preset_data"}
    assert listed == _subpackages(), f"pyproject's packages: add {sorted(_subpackages() - listed)}, drop {sorted(listed - _subpackages())}"


def test_imports_only_go_down_the_order_of_rooms():
    upward = [
        f"{name} (rank {RANKS[_room(name)]}) imports {dep} (rank {RANKS[_room(dep)]})"
        for name, deps in _graph().items()
        for dep in sorted(deps)
        if _room(dep) != _room(name) and RANKS[_room(dep)] >= RANKS[_room(name)]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = _graph()
    mutual = sorted(
        f"{a} <-> {b}" for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, ())
    )
    assert not mutual, mutual
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack + [node, dep]))
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_private_keras_and_jax_names_only_in_compat():
    offenders = []
    for name, path in _modules():
        if name == "keras_hub_dist._compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith(("keras.src", "jax._src", "keras_hub.src"))
            ):
                offenders.append(f"{name}: from {node.module}")
            elif isinstance(node, ast.Import):
                offenders.extend(
                    f"{name}: import {a.name}" for a in node.names
                    if a.name.startswith(("keras.src", "jax._src", "keras_hub.src"))
                )
    assert not offenders, offenders


def test_compat_keeps_no_state():
    """`_compat.py` holds private imports and thin wrappers: no module-level
    bookkeeping (`global` rebinding, locks); that lives with its users."""
    tree = ast.parse((PACKAGE / "_compat.py").read_text())
    globals_ = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Global)]
    threads = [
        n.lineno for n in ast.walk(tree)
        if (isinstance(n, ast.Import) and any(a.name == "threading" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and n.module == "threading")
    ]
    assert not globals_ and not threads, (globals_, threads)
