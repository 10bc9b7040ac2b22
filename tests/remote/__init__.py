"""Remote-checkpoint tests. A package, so that its conftest.py is imported as
`remote.conftest` and does not replace `conftest` (tests/conftest.py), which
test modules import from (`from conftest import MESH_SHAPES`)."""
