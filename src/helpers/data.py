"""The bundled Japanese sentiment data, a loader for your own CSV/TSV files, and padded batches."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch
from torch.utils.data import DataLoader

LABELS = ("negative", "positive")
"""Label names; a label's id is its index (negative=0, positive=1)."""

SPLITS = ("train", "validation", "test")
DATASET = "sentiment_ja"

_DELIMITERS = {".tsv": "\t", ".csv": ","}


@dataclass(frozen=True)
class Example:
    text: str
    label: int


class DataFileError(ValueError):
    """A labelled text file that cannot be loaded; the message names the file and the line."""


def bundled_data_dir() -> Path:
    """Directory holding the bundled splits (train.tsv, validation.tsv, test.tsv) and DATA_CARD.md."""
    return Path(str(files("helpers") / "data" / DATASET))


def load_split(split: str) -> list[Example]:
    """One split of the bundled data set: "train", "validation" or "test"."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return load_examples(bundled_data_dir() / f"{split}.tsv")


def load_examples(path: str | Path, *, encoding: str = "utf-8", labels: tuple[str, ...] = LABELS) -> list[Example]:
    """Read a .tsv or .csv file with a header row holding the columns ``text`` and ``label``.

    A label is a name from ``labels`` or its index ("0", "1"). The whole file is checked before
    anything is returned, so a bad line never leaves you with half a data set.
    Raises DataFileError naming the file and line for: an unknown extension, an empty file, a text that
    is not in ``encoding`` (Excel in Japan often saves CP932: pass encoding="cp932"), a missing
    column, a row with too few fields, an empty text or an unknown label.
    """
    path = Path(path)
    delimiter = _DELIMITERS.get(path.suffix.lower())
    if delimiter is None:
        raise DataFileError(f"{path}: unsupported file type {path.suffix!r}; use .tsv or .csv")
    text = _decode(path, encoding)
    if not text.strip():
        raise DataFileError(f"{path}: the file is empty; expected a header line with 'text' and 'label'")

    rows = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = [name.strip() for name in next(rows)]
    missing = [column for column in ("text", "label") if column not in header]
    if missing:
        raise DataFileError(f"{path}, line 1: missing column(s) {missing}; the header has {header}")
    text_at, label_at = header.index("text"), header.index("label")
    label_ids = {name: i for i, name in enumerate(labels)} | {str(i): i for i in range(len(labels))}

    examples = []
    for row in rows:
        where = f"{path}, line {rows.line_num}"
        if not any(field.strip() for field in row):
            continue  # blank line
        if len(row) <= max(text_at, label_at):
            raise DataFileError(f"{where}: {len(row)} field(s), but the header has {len(header)}")
        sentence, label = row[text_at].strip(), row[label_at].strip()
        if not sentence:
            raise DataFileError(f"{where}: the text is empty")
        if label not in label_ids:
            raise DataFileError(f"{where}: unknown label {label!r}; expected one of {sorted(label_ids)}")
        examples.append(Example(sentence, label_ids[label]))
    if not examples:
        raise DataFileError(f"{path}: a header but no examples")
    return examples


def _decode(path: Path, encoding: str) -> str:
    raw = path.read_bytes()
    is_utf8 = encoding.lower().replace("-", "").replace("_", "") == "utf8"
    try:
        return raw.decode("utf-8-sig" if is_utf8 else encoding)  # Excel's "CSV UTF-8" starts with a BOM
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise DataFileError(
            f"{path}, line {line}: not valid {encoding} (byte 0x{raw[error.start]:02x} at offset {error.start}). "
            f"Files saved by Excel in Japan are often CP932 (Shift_JIS): pass encoding='cp932' or save as UTF-8."
        ) from None


class PadToLongest:
    """Collate examples into a batch padded to its longest sentence (not to 512), with the attention mask."""

    def __init__(self, tokenizer, max_length: int = 128):
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        batch = self.tokenizer(
            [example.text for example in examples],
            padding="longest",
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        batch["labels"] = torch.tensor([example.label for example in examples])
        return dict(batch)


def make_loader(examples: list[Example], tokenizer, batch_size: int = 32, *, shuffle: bool = False, seed: int = 0,
                max_length: int = 128) -> DataLoader:
    """A DataLoader of padded batches; with ``shuffle`` the order is fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(examples, batch_size=batch_size, shuffle=shuffle, generator=generator,
                      collate_fn=PadToLongest(tokenizer, max_length))
