"""Safetensors files the loader must refuse, and files it must accept.

Each bad case is `(file bytes, rule regex, tensor name or None)`: the
safetensors crate refuses every one of them too (tests assert it), except
the three in `STRICTER` that the crate accepts and we refuse on purpose.
Shared by tests/formats/test_safetensors_header.py (local files) and
tests/remote/test_remote_safetensors_headers.py (the same bytes served on
127.0.0.1 and read by range).
"""

from __future__ import annotations

import json
import struct

__all__ = ["BAD", "GOOD", "STRICTER", "file_bytes"]

_A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
_B = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}


def file_bytes(header, data_len: int = 16, length: int | None = None) -> bytes:
    """A safetensors file: `header` (a dict, JSON text or bytes), then
    `data_len` bytes of data; `length` overrides the 8-byte prefix."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    prefix = struct.pack("<Q", len(header) if length is None else length)
    return prefix + header + bytes(range(256)) * (data_len // 256) + bytes(data_len % 256)


def _two(a=None, b=None, **extra):
    return {"a": {**_A, **(a or {})}, "b": {**_B, **(b or {})}, **extra}


_ENTRY_A = json.dumps(_A)
BAD = {
    # The issue's cases.
    "shared_offsets": (file_bytes(_two(b={"data_offsets": [0, 8]})), "overlaps tensor", "b"),
    "float_shape": (file_bytes(_two(a={"shape": [2.0]})), "a malformed shape", "a"),
    "bool_shape": (file_bytes(_two(a={"dtype": "U8", "shape": [True, 8], "data_offsets": [0, 8]})),
                   "a malformed shape", "a"),
    "duplicate_name": (file_bytes('{"a":%s,"a":%s}' % (_ENTRY_A, json.dumps(_B))),
                       "a name appears twice", None),
    "trailing_bytes": (file_bytes(_two(), data_len=20), "4 bytes after the last tensor", None),
    # The others.
    "gap": (file_bytes(_two(b={"data_offsets": [12, 20]}), data_len=20), "a gap of 4 bytes", "b"),
    "first_not_at_0": (file_bytes({"a": {**_A, "data_offsets": [4, 12]}}, data_len=12), "a gap of 4 bytes", "a"),
    "string_shape": (file_bytes(_two(a={"shape": ["2"]})), "a malformed shape", "a"),
    "negative_shape": (file_bytes(_two(a={"shape": [-2]})), "a malformed shape", "a"),
    "shape_past_u64": (file_bytes(_two(a={"shape": [2**64, 0], "data_offsets": [0, 0]}, b={"data_offsets": [0, 16], "shape": [4]})),
                       "a malformed shape", "a"),
    "size_overflow": (file_bytes(_two(a={"shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}, b={"data_offsets": [0, 16], "shape": [4]})),
                      "overflows 64 bits", "a"),
    "float_offsets": (file_bytes(_two(a={"data_offsets": [0.0, 8.0]})), "malformed data_offsets", "a"),
    "minus_zero_offset": (file_bytes('{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]},"b":%s}' % json.dumps(_B)),
                          "malformed data_offsets", "a"),
    "three_offsets": (file_bytes(_two(b={"data_offsets": [8, 16, 16]})), "malformed data_offsets", "b"),
    "offsets_reversed": (file_bytes(_two(b={"data_offsets": [16, 8]})), "end before they begin", "b"),
    "size_mismatch": (file_bytes(_two(b={"data_offsets": [8, 14]}), data_len=14), "is 8 bytes", "b"),
    "misaligned_sub_byte": (file_bytes({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, data_len=2),
                            "not whole bytes", "a"),
    "unknown_dtype": (file_bytes(_two(a={"dtype": "Q8"})), "an unknown dtype", "a"),
    "missing_key": (file_bytes({"a": {"dtype": "F32", "shape": [2]}}, data_len=8), "a malformed entry", "a"),
    "entry_not_object": (file_bytes({"a": "F32"}, data_len=0), "a malformed entry", "a"),
    "metadata_not_strings": (file_bytes(_two(__metadata__={"format": 1})), "malformed __metadata__", None),
    "metadata_list": (file_bytes(_two(__metadata__=["pt"])), "malformed __metadata__", None),
    "metadata_nan": (file_bytes('{"__metadata__":{"x":NaN},"a":%s}' % _ENTRY_A, data_len=8),
                     "a constant that is not JSON", None),
    "duplicate_metadata": (file_bytes('{"__metadata__":{},"__metadata__":{},"a":%s}' % _ENTRY_A, data_len=8),
                           "a name appears twice", None),
    "lone_surrogate_name": (file_bytes('{"\\ud800":%s}' % _ENTRY_A, data_len=8), "not valid UTF-8", None),
    "past_end": (file_bytes(_two(), data_len=12), "ends past the end of the file", None),
    "not_utf8": (file_bytes(b'{"a":\xff}', data_len=0), "not UTF-8", None),
    "utf8_bom": (file_bytes(b"\xef\xbb\xbf" + json.dumps(_two()).encode()), "not valid JSON", None),
    "not_json": (file_bytes(b"{\"a\": [", data_len=0), "not valid JSON", None),
    "json_array": (file_bytes(b"[]", data_len=0), "not a JSON object", None),
    "deep_nesting": (file_bytes(b"[" * 100_000 + b"]" * 100_000, data_len=0), "nests too deeply|not valid JSON", None),
    "header_too_large": (file_bytes(b"{}", data_len=0, length=100_000_001), "the header is too large", None),
    "header_2_63": (file_bytes(b"{}", data_len=0, length=2**63), "the header is too large", None),
    "header_past_file": (file_bytes(b"{}", data_len=0, length=3), "longer than the file", None),
    "short_file": (b"\x02\x00\x00", "no 8-byte header length", None),
}

# The crate accepts these (serde ignores unknown keys, reads a struct from
# an array, and keeps the last of two equal entries); we refuse them.
STRICTER = {
    "extra_key": (file_bytes(_two(a={"quantization": "int4"})), "a malformed entry", "a"),
    "entry_as_array": (file_bytes({"a": ["F32", [2], [0, 8]]}, data_len=8), "a malformed entry", "a"),
    "duplicate_equal_entries": (file_bytes('{"a":%s,"a":%s}' % (_ENTRY_A, _ENTRY_A), data_len=8),
                                "a name appears twice", None),
}

# Files both accept: name -> (file bytes, {name: (dtype, shape, begin, end)}).
GOOD = {
    "two": (file_bytes(_two()), {"a": ("F32", (2,), 0, 8), "b": ("F32", (2,), 8, 16)}),
    "out_of_order": (file_bytes({"b": _B, "a": _A}), {"a": ("F32", (2,), 0, 8), "b": ("F32", (2,), 8, 16)}),
    "padded": (file_bytes(" \n\t" + json.dumps(_two()) + "    \r\n"), {"a": ("F32", (2,), 0, 8), "b": ("F32", (2,), 8, 16)}),
    "empty": (file_bytes("{}", data_len=0), {}),
    "metadata_null": (file_bytes({"__metadata__": None, "a": _A}, data_len=8), {"a": ("F32", (2,), 0, 8)}),
    "zero_sized_share": (file_bytes({"z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
                                     "y": {"dtype": "BF16", "shape": [0], "data_offsets": [8, 8]}, "a": _A}, data_len=8),
                         {"z": ("F32", (0, 3), 8, 8), "y": ("BF16", (0,), 8, 8), "a": ("F32", (2,), 0, 8)}),
    "scalar_and_zero_dim_overflow_late": (
        file_bytes({"s": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]},
                    "z": {"dtype": "U8", "shape": [0, 2**40, 2**40], "data_offsets": [8, 8]}}, data_len=8),
        {"s": ("I64", (), 0, 8), "z": ("U8", (0, 2**40, 2**40), 8, 8)}),
    "fp8_and_sub_byte": (file_bytes({"e": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]},
                                     "f": {"dtype": "F4", "shape": [8], "data_offsets": [4, 8]}}, data_len=8),
                         {"e": ("F8_E4M3", (4,), 0, 4), "f": ("F4", (8,), 4, 8)}),
}
