"""The bundled Japanese sentiment data, a loader for your own labelled text files, and padded batches."""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch
from torch.utils.data import DataLoader

LABELS = ("negative", "positive")
"""Label names; a label's id is its index (negative=0, positive=1)."""

SPLITS = ("train", "validation", "test")
DATASET = "sentiment_ja"
EXAMPLE_DATASET = "helpdesk_ja"  # train.csv, validation.csv, test.csv: three help-desk classes
MAX_EXAMPLES = "HELPERS_MAX_EXAMPLES"  # environment variable: use only the first N examples of each split
MAX_LENGTH = 128
"""Tokens per example at most, [CLS] and [SEP] included: the training batches cut longer sentences there."""

_DELIMITERS = {".tsv": "\t", ".txt": "\t", ".csv": ","}  # .txt: Excel's "Unicode text" is tab-separated
_JSON_LINES = (".jsonl", ".ndjson")
_BOMS = (  # byte-order mark, codec, its name, the encodings a caller may name for it
    (codecs.BOM_UTF8, "utf-8-sig", "UTF-8", {"utf8", "utf8sig"}),
    (codecs.BOM_UTF16_LE, "utf-16", "UTF-16 LE", {"utf16", "utf16le"}),
    (codecs.BOM_UTF16_BE, "utf-16", "UTF-16 BE", {"utf16", "utf16be"}),
)


@dataclass(frozen=True)
class Example:
    text: str
    label: int


class DataFileError(ValueError):
    """A labelled text file that cannot be loaded; the message names the file and the line.

    Where the fix is the encoding, the message names it as Python's keyword (``encoding='cp932'``) and
    ``command_line`` as the option of ``python -m helpers.finetune`` (``--encoding cp932``).
    """

    def __init__(self, message: str, command_line: str | None = None):
        super().__init__(message)
        self.command_line = command_line or message


def _encoding_error(message: str, value: str | None = None) -> DataFileError:
    """A DataFileError from ``message``, whose ``{option}`` is the encoding setting and ``{given}`` its ``value``,
    said in Python's words (``encoding``, ``encoding='cp932'``) and the command line's (``--encoding cp932``)."""
    def say(option: str, given: str) -> str:
        return message.replace("{option}", option).replace("{given}", given)

    return DataFileError(say("encoding", f"encoding={value!r}"), say("--encoding", f"--encoding {value}"))


@dataclass(frozen=True)
class DataFiles:
    """Your own training, validation and (optional) test files, read with one set of label names.

    ``labels`` are the names found in the training file, sorted (numbers by value); a label's id is its
    index, and the same tuple is saved with the model so that predictions come back as names.
    """

    labels: tuple[str, ...]
    train: list[Example]
    validation: list[Example]
    test: list[Example] | None = None


def bundled_data_dir(name: str = DATASET) -> Path:
    """Directory holding a bundled data set's splits and its DATA_CARD.md: the sentiment data (train.tsv,
    validation.tsv, test.tsv), or with ``name=EXAMPLE_DATASET`` the three-class example of your own files."""
    return Path(str(files("helpers") / "data" / name))


def load_split(split: str) -> list[Example]:
    """One split of the bundled data set: "train", "validation" or "test".

    With the environment variable HELPERS_MAX_EXAMPLES=N, only the split's first N examples: a quick dry run
    of the series (the memo's BERT-base on a CPU, say), whose accuracies then mean nothing.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return load_examples(bundled_data_dir() / f"{split}.tsv")[:max_examples()]


def max_examples() -> int | None:
    """HELPERS_MAX_EXAMPLES as a number, or None when it is not set."""
    value = os.environ.get(MAX_EXAMPLES, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{MAX_EXAMPLES}={value!r}: expected a whole number of examples, at least 1 (or unset it)")
    return int(value)


def load_examples(path: str | Path, *, encoding: str | None = None,
                  labels: tuple[str, ...] = LABELS) -> list[Example]:
    """Read one labelled file (see ``read_records`` for the formats) whose labels are names from ``labels``
    or their indices ("0", "1").

    The whole file is checked before anything is returned, so a bad line never leaves you with half a
    data set; every problem is a DataFileError naming the file, the line and the cause.
    """
    label_ids = {name: i for i, name in enumerate(labels)} | {str(i): i for i in range(len(labels))}
    examples = []
    for line, text, label in read_records(path, encoding):
        if label not in label_ids:
            raise DataFileError(f"{path}, line {line}: unknown label {label!r}; expected one of {sorted(label_ids)}")
        examples.append(Example(text, label_ids[label]))
    return examples


def load_data_files(train: str | Path, validation: str | Path, test: str | Path | None = None, *,
                    encoding: str | None = None) -> DataFiles:
    """Read your own files: the label names are those of the training file (two or more), and a label in
    validation or test that training never saw is an error naming its file and line.

    Every file is read and checked before anything is returned.
    """
    train_records = read_records(train, encoding)
    found = {label for _, _, label in train_records}
    if len(found) < 2:
        raise DataFileError(f"{train}: every example has the label {found.pop()!r}; a classifier needs at least "
                            f"two labels in the training file")
    labels = tuple(sorted(found, key=_label_order))
    label_ids = {name: i for i, name in enumerate(labels)}

    def examples(path, records):
        for line, _, label in records:
            if label not in label_ids:
                raise DataFileError(f"{path}, line {line}: label {label!r} does not occur in the training file "
                                    f"{train}, whose labels are {list(labels)}")
        return [Example(text, label_ids[label]) for _, text, label in records]

    return DataFiles(labels, examples(train, train_records), examples(validation, read_records(validation, encoding)),
                     None if test is None else examples(test, read_records(test, encoding)))


def _label_order(name: str):
    """Numbers by value ("2" before "10"), then names alphabetically."""
    return (0, int(name), "") if name.lstrip("-").isdecimal() else (1, 0, name)


def read_records(path: str | Path, encoding: str | None = None) -> list[tuple[int, str, str]]:
    """``(line, text, label)`` for each example of a labelled text file, after checking all of it.

    Formats, by extension: ``.csv`` (comma-separated), ``.tsv`` and ``.txt`` (tab-separated, as Excel's
    "Unicode text" is), ``.jsonl`` (one JSON object with "text" and "label" per line). A CSV/TSV file either
    starts with a header row naming the columns ``text`` and ``label`` (other columns are ignored) or has
    none, and then every row is exactly: text, label. Fields may be any length (a whole document in a cell).
    With ``encoding`` None the file's byte-order mark decides (UTF-8 or UTF-16, as Excel writes them), and a
    file without one must be UTF-8; pass ``encoding="cp932"`` for Shift_JIS files from Excel in Japan.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _DELIMITERS and suffix not in _JSON_LINES:
        hint = "; in Excel, save it as \"CSV UTF-8\"" if suffix in (".xlsx", ".xls") else ""
        raise DataFileError(f"{path}: unsupported file type {suffix!r}; use .csv, .tsv, .txt or .jsonl{hint}")
    text = _decode(path, encoding)
    if not text.strip():
        raise DataFileError(f"{path}: the file is empty; expected a header line with 'text' and 'label'")
    records = _json_records(path, text) if suffix in _JSON_LINES else _table_records(path, text, _DELIMITERS[suffix])
    if not records:
        raise DataFileError(f"{path}: a header but no examples")
    return records


def _table_records(path: Path, text: str, delimiter: str) -> list[tuple[int, str, str]]:
    rows = _rows(path, text, delimiter)
    names = [field.strip().lower() for field in rows[0][1]]
    if "text" in names or "label" in names:  # a header row
        missing = [column for column in ("text", "label") if column not in names]
        if missing:
            raise DataFileError(f"{path}, line {rows[0][0]}: missing column(s) {missing}; the header has "
                                f"{[field.strip() for field in rows[0][1]]}")
        header, text_at, label_at, rows = True, names.index("text"), names.index("label"), rows[1:]
    else:
        header, text_at, label_at = False, 0, 1
    records = []
    for line, row in rows:
        where = f"{path}, line {line}"
        if header and len(row) <= max(text_at, label_at):
            raise DataFileError(f"{where}: {len(row)} field(s), but the header has {len(names)}")
        if not header and len(row) != 2:
            raise DataFileError(
                f"{where}: {len(row)} field(s); without a header row every row is exactly two fields, text then "
                f"label{_delimiter_hint(row, delimiter)}, or else the first row names the columns 'text' and 'label'")
        records.append((line, *_checked(where, row[text_at], row[label_at])))
    return records


def _rows(path: Path, text: str, delimiter: str) -> list[tuple[int, list[str]]]:
    """Every non-blank row with the line it starts on (a quoted field may span lines and be any length)."""
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text) + 1))  # the default, 131,072 characters, refuses long documents
    try:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
        rows, start = [], 1
        for row in reader:
            if any(field.strip() for field in row):
                rows.append((start, row))
            start = reader.line_num + 1
    except csv.Error as error:
        raise DataFileError(f"{path}, line {start}: {error}") from error
    finally:
        csv.field_size_limit(limit)
    return rows


def _delimiter_hint(row: list[str], delimiter: str) -> str:
    """Why a row may have the wrong number of fields: it is separated by the other delimiter."""
    other = {"\t": ",", ",": "\t"}[delimiter]
    if len(row) == 1 and other in row[0]:
        kind = "commas (name the file .csv)" if other == "," else "tabs (name the file .tsv)"
        return f" (this row is separated by {kind})"
    return ""


def _json_records(path: Path, text: str) -> list[tuple[int, str, str]]:
    records = []
    for line, content in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if not content.strip():
            continue
        where = f"{path}, line {line}"
        try:
            record = json.loads(content)
        except json.JSONDecodeError as error:
            raise DataFileError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from error
        if not isinstance(record, dict):
            raise DataFileError(
                f"{where}: expected a JSON object with \"text\" and \"label\", got {type(record).__name__}")
        missing = [key for key in ("text", "label") if key not in record]
        if missing:
            raise DataFileError(f"{where}: missing key(s) {missing}; the object has {list(record)}")
        records.append((line, *_checked(where, record["text"], record["label"])))
    return records


def _checked(where: str, text, label) -> tuple[str, str]:
    """``text`` and ``label`` stripped, or a DataFileError if either is empty or not text."""
    if not isinstance(text, str):
        raise DataFileError(f"{where}: the text must be a string, got {json.dumps(text, ensure_ascii=False)}")
    if not text.strip():
        raise DataFileError(f"{where}: the text is empty")
    if isinstance(label, int) and not isinstance(label, bool):
        label = str(label)
    if not isinstance(label, str):
        raise DataFileError(f"{where}: the label must be a name or a whole number, got "
                            f"{json.dumps(label, ensure_ascii=False)}")
    if not label.strip():
        raise DataFileError(f"{where}: the label is empty")
    return text.strip(), label.strip()


def _decode(path: Path, encoding: str | None) -> str:
    """The file's text; on failure a DataFileError saying what the bytes are, suggesting only encodings that
    read the whole file."""
    raw = path.read_bytes()
    bom = next((bom for bom in _BOMS if raw.startswith(bom[0])), None)
    if bom is not None:
        _, codec, name, accepted = bom
        if encoding is not None and _normalized(encoding) not in accepted:
            raise _encoding_error(f"{path}: starts with a {name} byte-order mark, but {{given}} was given; "
                                  f"leave {{option}} out and the mark decides", encoding)
        try:
            text = raw.decode(codec)
        except UnicodeDecodeError as error:
            raise DataFileError(f"{path}, line {_line_at(raw, error.start, codec)}: starts with a {name} byte-order "
                                f"mark but is not valid {name.split()[0]} ({error.reason} at byte offset "
                                f"{error.start})") from error
    else:
        nul = raw.find(b"\x00")
        if nul >= 0:
            raise DataFileError(
                f"{path}, line {_line_at(raw, nul, 'latin-1')}: a NUL byte (offset {nul}) and no byte-order mark: this "
                f"looks like UTF-16 saved without a mark, or not a text file; save it as UTF-8 (or as Excel's "
                f"\"Unicode text\", which starts with a mark)")
        codec = "utf-8" if encoding is None or _normalized(encoding) == "utf8" else encoding
        try:
            text = raw.decode(codec)
        except LookupError as error:
            raise DataFileError(f"{path}: unknown encoding {encoding!r}") from error
        except UnicodeDecodeError as error:
            where = f"{path}, line {_line_at(raw, error.start, codec)}"
            found = f"not valid {encoding or 'utf-8'} (byte 0x{raw[error.start]:02x} at offset {error.start})"
            if codec != "utf-8":
                hint = " The file is valid UTF-8: leave {option} out." if _decodes(raw, "utf-8") else ""
                raise _encoding_error(f"{where}: {found}.{hint}") from error
            if _decodes(raw, "cp932"):
                raise _encoding_error(f"{where}: {found}. Files saved by Excel in Japan are often CP932 (Shift_JIS): "
                                      f"pass {{given}} or save as UTF-8.", "cp932") from error
            raise DataFileError(f"{where}: {found}, nor valid CP932 (Shift_JIS), and it starts with no byte-order "
                                f"mark (UTF-8 or UTF-16): save it as UTF-8.") from error
    nul = text.find("\x00")
    if nul >= 0:
        line = text.count("\n", 0, nul) + 1
        raise DataFileError(f"{path}, line {line}: a NUL character; is this a text file?")
    return text


def _normalized(encoding: str) -> str:
    return encoding.lower().replace("-", "").replace("_", "")


def _decodes(raw: bytes, codec: str) -> bool:
    try:
        raw.decode(codec)
    except UnicodeDecodeError:
        return False
    return True


def _line_at(raw: bytes, offset: int, codec: str) -> int:
    """The line holding byte ``offset``, counted in the file's own encoding."""
    return raw[:offset].decode(codec, errors="replace").count("\n") + 1


class PadToLongest:
    """Collate examples into a batch padded to its longest sentence (not to 512), with the attention mask."""

    def __init__(self, tokenizer, max_length: int = MAX_LENGTH):
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
                max_length: int = MAX_LENGTH) -> DataLoader:
    """A DataLoader of padded batches; with ``shuffle`` the order is fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(examples, batch_size=batch_size, shuffle=shuffle, generator=generator,
                      collate_fn=PadToLongest(tokenizer, max_length))


def count_truncated(examples: list[Example], tokenizer, max_length: int = MAX_LENGTH) -> int:
    """How many ``examples`` are longer than ``max_length`` tokens ([CLS] and [SEP] included), so that
    ``PadToLongest`` cuts them: the loader keeps every character, the tokenizer truncates."""
    longer = tokenizer([example.text for example in examples], truncation=True, max_length=max_length + 1)
    return sum(len(ids) > max_length for ids in longer["input_ids"])
