"""The package's shape: no import cycles, no module over 600 lines, private
Keras/JAX names only in `_compat.py`."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_hub_dist"
MAX_LINES = 600


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(name, path):
    """Modules of this package imported at module level (not in functions)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("keras_hub_dist"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists() else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("keras_hub_dist."))
    return {m for m in found if m != name}


def test_no_module_over_600_lines():
    long = {name: n for name, path in _modules() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_import_cycles():
    graph = {name: _imports(name, path) for name, path in _modules()}
    # The package root re-exports everything; cycles through it are imports
    # of submodules by name, not design cycles.
    graph = {n: {m for m in deps if m != "keras_hub_dist"} for n, deps in graph.items()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph.get(node, ()):
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
    assert not offenders, offenders
