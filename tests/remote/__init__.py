"""Remote-checkpoint tests, and the loopback servers every remote test uses
(`servers`: the logging, fault-injecting `RangeServer`; `stores`: S3 and GCS
emulators behind it; `hub`: the Hugging Face Hub's routes; `http_blobs`:
what they share). A package, so that its conftest.py is imported as
`remote.conftest` and does not replace `conftest` (tests/conftest.py), which
test modules import from (`from conftest import MESH_SHAPES`); other test
folders import the servers as `from remote.servers import RangeServer`."""
