"""The safetensors writer: one streaming pass that hashes as it writes."""

from __future__ import annotations

import hashlib
import itertools
import struct
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import torch

from ..errors import CmhsaError
from ..text import json_text
from .paths import MAX_JSON_BYTES

# A safetensors header is JSON, read by the one JSON reader (io/paths.parse_json): its bound is the
# bound of every reader (io/checkpoint.py) and of this writer, so cmhsa never writes a file it
# would refuse to read back.
HEADER_BYTES = MAX_JSON_BYTES

# safetensors' dtype names (https://github.com/huggingface/safetensors, format section)
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_CHUNK_BYTES = 1 << 24


def _tensor_chunks(t: torch.Tensor) -> Iterator[memoryview]:
    """Row-major bytes of ``t`` in pieces of at most ~16 MB. Non-contiguous tensors (such as the
    broadcast zero W_Q / W_K the conversion returns) are made contiguous one piece at a time."""
    if t.numel() == 0:
        return
    if t.dim() == 0:
        t = t.reshape(1)
    rows = max(1, _CHUNK_BYTES // max(1, t[0].numel() * t.element_size()))
    for i in range(0, t.shape[0], rows):
        piece = t[i : i + rows].contiguous()
        yield memoryview(piece.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(
    file: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], path: object = None
) -> str:
    """Write ``tensors`` to ``file`` in the safetensors format, in one streaming pass, and return
    the sha256 of the bytes written; a header over HEADER_BYTES is refused (naming ``path``, the
    file it becomes) before a byte is written.

    The layout is safetensors' own (8-byte little-endian header length, JSON header padded with
    spaces to 8 bytes, then the tensors back to back in header order), read back by
    ``safetensors.safe_open`` in the tests. Why not ``safetensors.torch.save_file``: it copies
    every tensor into a bytes object before writing (twice the output's size in memory) and cannot
    hash while it writes, which costs a second read of a 600 MB file.
    """
    if sys.byteorder != "little":
        raise RuntimeError(
            "safetensors files are little-endian; writing them on this machine is not supported"
        )
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json_text(header, compact=True).encode()
    head += b" " * (-len(head) % 8)
    if len(head) > HEADER_BYTES:
        raise CmhsaError(
            f"its safetensors header (names, shapes and metadata) would be {len(head):,} bytes, more "
            f"than cmhsa reads ({HEADER_BYTES:,}); shorten the metadata",
            path,
        )
    digest = hashlib.sha256()
    blocks = itertools.chain(
        (struct.pack("<Q", len(head)), head), *(_tensor_chunks(tensors[n]) for n in names)
    )
    # each block hashed in a thread while the next is written (hashlib and the write both release
    # the GIL): the hash costs no time of its own beside a write of the same bytes
    with ThreadPoolExecutor(1) as hasher:
        hashed = None
        for block in blocks:
            file.write(block)
            if hashed is not None:
                hashed.result()
            hashed = hasher.submit(digest.update, block)
        if hashed is not None:
            hashed.result()
    return digest.hexdigest()
