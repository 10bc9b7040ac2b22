"""Safetensors headers, checked as strictly as the safetensors crate checks them.

Every safetensors file the package reads (a checkpoint's shards, a PEFT
adapter, a remote file read by range) and every file its writer lays out
goes through `validate_header`, so one function holds every rule. The rules
are those of the crate's `SafeTensors::read_metadata` and
`Metadata::validate` (`safetensors/src/tensor.rs`; the crate's error in
brackets), plus three stricter ones:

- the file has the 8-byte length [HeaderTooSmall]; the header is at most
  100,000,000 bytes [HeaderTooLarge] and fits in the file
  [InvalidHeaderLength];
- it is UTF-8 [InvalidHeader] and one JSON object, padded with JSON
  whitespace at most (the crate accepts it on either side)
  [InvalidHeaderDeserialization];
- `__metadata__` is absent, `null` or a string -> string map;
- each tensor entry is an object of exactly `dtype`, `shape` and
  `data_offsets` (the crate ignores other keys and also takes a 3-item
  array: we refuse both, as a key we do not know may change what the bytes
  mean); `dtype` one of the crate's; `shape` a list of JSON integers in
  [0, 2**64) (no bool, no `128.0`, no string); `data_offsets` two such
  integers, begin <= end [TensorInfo, InvalidOffset];
- product(shape) x bits fits 64 bits [ValidationOverflow], is whole bytes
  [MisalignedSlice] and equals end - begin [TensorInvalidInfo];
- sorted by offset, the tensors start at 0 and tile the data region: no gap,
  no overlap [InvalidOffset], no byte after the last one
  [MetadataIncompleteBuffer];
- no name appears twice, at any level (JSON keeps the last one: the crate
  accepts a tensor named twice when the copies agree; we refuse it).

Example:

```python
n = header_length(first_bytes, size, "model.safetensors")
header = validate_header(first_bytes_and_more, size, "model.safetensors")
header.tensors["model.norm.weight"].begin
```
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keras_hub_dist.errors import PresetError

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "HeaderEntry",
    "ValidHeader",
    "header_length",
    "validate_header",
]

# The crate's MAX_HEADER_SIZE (decimal, not MiB).
MAX_HEADER_BYTES = 100_000_000
# `usize` on the 64-bit hosts the crate runs on.
_USIZE_MAX = 2**64 - 1

# The crate's `Dtype` enum and `Dtype::bitsize`.
DTYPE_BITS: Mapping[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

_ENTRY_KEYS = ("data_offsets", "dtype", "shape")
_FIX = (
    "Download the file again, or re-save the tensors with the safetensors "
    "library (`safetensors.torch.save_file` / `safetensors.numpy.save_file`), "
    "which writes a valid header."
)


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a header: dtype name, shape and byte range, the range
    relative to the end of the header (`ValidHeader.data_start`)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class ValidHeader:
    """A validated header.

    Attributes:
        length: The JSON's byte length (the 8-byte prefix's value).
        data_start: File offset of the data region (`8 + length`).
        tensors: Name -> entry, in the header's order.
        metadata: `__metadata__` (`None` when absent or null).
    """

    length: int
    data_start: int
    tensors: Mapping[str, HeaderEntry]
    metadata: Mapping[str, str] | None


def _refuse(label: str, rule: str, expected: str, received: str) -> PresetError:
    return PresetError(
        f"The safetensors file {label!r} is truncated or corrupt: {rule}. "
        f"Expected {expected}. Received: {received}. {_FIX}"
    )


def header_length(data: bytes, file_size: int, label: str) -> int:
    """The header's length from a file's first (8 or more) bytes, checked
    against the crate's bound and the file's size.

    Raises:
        PresetError: Fewer than 8 bytes, a header over 100,000,000 bytes, or
            longer than the file.
    """
    if file_size < 8 or len(data) < 8:
        raise _refuse(label, "no 8-byte header length", "a file of at least 8 bytes",
                      f"a file of {file_size} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise _refuse(label, "the header is too large",
                      f"a header of at most {MAX_HEADER_BYTES} bytes (the safetensors limit)",
                      f"a header length of {n} bytes")
    if 8 + n > file_size:
        raise _refuse(label, "the header is longer than the file",
                      f"a header of at most {file_size - 8} bytes in a file of {file_size} bytes",
                      f"a header length of {n} bytes")
    return n


class _Refused(ValueError):
    """A JSON value the header may not hold (raised inside the decoder)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Refused("a name appears twice in one JSON object (JSON keeps the last)",
                           f"{key!r} twice")
        seen[key] = value
    return seen


def _constant(name: str) -> Any:
    raise _Refused("a constant that is not JSON", name)


def _integer(text: str) -> Any:
    # serde reads "-0" as a float, so the crate refuses it where a count goes.
    return -0.0 if text == "-0" else int(text)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")  # a lone surrogate escape ("\\ud800") fails
    except UnicodeEncodeError:
        return False
    return True


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _USIZE_MAX


def _entry(label: str, name: str, entry: Any) -> HeaderEntry:
    def bad(rule: str, expected: str, received: Any) -> PresetError:
        return _refuse(label, f"tensor {name!r}: {rule}", expected, repr(received)[:200])

    if not _utf8(name):
        raise bad("the name is not valid UTF-8", "a UTF-8 tensor name", name)
    if not isinstance(entry, dict) or sorted(entry) != list(_ENTRY_KEYS):
        raise bad("a malformed entry", 'an object of exactly "dtype", "shape" and "data_offsets"', entry)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise bad("an unknown dtype", f"one of {sorted(DTYPE_BITS)}", dtype)
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad("a malformed shape", "a list of non-negative JSON integers", shape)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise bad("malformed data_offsets", "[begin, end], two non-negative JSON integers", offsets)
    begin, end = offsets
    if begin > end:
        raise bad("data_offsets end before they begin", "begin <= end", offsets)
    elements = 1
    for d in shape:  # as the crate counts, so the same shapes overflow
        elements *= d
        if elements > _USIZE_MAX:
            break
    bits = elements * DTYPE_BITS[dtype]
    if bits > _USIZE_MAX:
        raise bad(f"the size of a {dtype} tensor of this shape overflows 64 bits",
                  "a shape whose size in bits fits 64 bits", shape)
    if bits % 8:
        raise bad(f"{bits} bits, not whole bytes", "a sub-byte dtype filling whole bytes", shape)
    if end - begin != bits // 8:
        raise bad(f"a {dtype} tensor of shape {shape} is {bits // 8} bytes",
                  f"data_offsets [begin, begin + {bits // 8}]", offsets)
    return HeaderEntry(dtype, tuple(shape), begin, end)


def _metadata(label: str, value: Any) -> Mapping[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(v, str) and _utf8(k) and _utf8(v) for k, v in value.items()
    ):
        raise _refuse(label, "a malformed __metadata__", "a map of strings to strings",
                      repr(value)[:200])
    return value


def _bytes(n: int) -> str:
    return "1 byte" if n == 1 else f"{n} bytes"


def _tile(label: str, tensors: Mapping[str, HeaderEntry], data_bytes: int) -> None:
    position, previous = 0, None
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end, item[0])):
        if entry.begin > position:
            raise _refuse(label, f"a gap of {_bytes(entry.begin - position)} before tensor {name!r}",
                          f"the tensors, sorted by offset, to tile the data from 0: tensor {name!r} "
                          f"to begin at {position}", f"data_offsets [{entry.begin}, {entry.end}]")
        if entry.begin < position:
            raise _refuse(label, f"tensor {name!r} overlaps tensor {previous!r}",
                          f"tensor {name!r} to begin at {position}, where {previous!r} ends",
                          f"data_offsets [{entry.begin}, {entry.end}]")
        position, previous = entry.end, name
    if position < data_bytes:
        raise _refuse(label, f"{_bytes(data_bytes - position)} after the last tensor",
                      f"the data to end with the last tensor, at data offset {position}",
                      f"a data region of {data_bytes} bytes")
    if position > data_bytes:
        raise _refuse(label, f"tensor {previous!r} ends past the end of the file",
                      f"a data region of at least {position} bytes",
                      f"a data region of {data_bytes} bytes")


def validate_header(data: bytes, file_size: int, label: str) -> ValidHeader:
    """Parses and checks a safetensors header against every rule above.

    Args:
        data: The file's first bytes: the 8-byte length and the whole
            header (more is ignored).
        file_size: The file's size in bytes (the data region must fill it).
        label: The file's path or URL, for the message.

    Raises:
        PresetError: A rule is broken. The message names the file, the
            tensor, the rule, what was expected and received, and the fix.
    """
    n = header_length(data, file_size, label)
    if len(data) < 8 + n:
        raise _refuse(label, "the header was cut short while reading", f"{n} header bytes",
                      f"{len(data) - 8} bytes")
    try:
        text = data[8 : 8 + n].decode("utf-8")
        parsed = json.loads(text, object_pairs_hook=_unique, parse_constant=_constant,
                            parse_int=_integer)
    except UnicodeDecodeError as e:
        raise _refuse(label, "the header is not UTF-8", "UTF-8 JSON", str(e)) from None
    except _Refused as e:
        raise _refuse(label, e.args[0], "each name once in each object, and plain JSON",
                      e.args[1]) from None
    except RecursionError:
        raise _refuse(label, "the header nests too deeply", "a JSON object of tensor entries",
                      "JSON nested deeper than Python's recursion limit") from None
    except ValueError as e:
        raise _refuse(label, "the header is not valid JSON", "one JSON object", str(e)[:200]) from None
    if not isinstance(parsed, dict):
        raise _refuse(label, "the header is not a JSON object", "a JSON object",
                      f"a JSON {type(parsed).__name__}")
    metadata = _metadata(label, parsed.pop("__metadata__", None))
    tensors = {name: _entry(label, name, entry) for name, entry in parsed.items()}
    _tile(label, tensors, file_size - 8 - n)
    return ValidHeader(n, 8 + n, tensors, metadata)
