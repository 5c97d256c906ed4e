"""``--train-file F --validation-file G [--test-file H]`` for ``helpers.finetune``: train on your own files.

Kept apart from the training loop: this module adds the options, reads the files (or the bundled data
when none is given) and says what was read; ``helpers.data`` does the reading and checking.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from helpers.data import (LABELS, MAX_LENGTH, DataFileError, DataFiles, count_truncated, load_data_files,
                          load_split)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "your own data", "CSV, TSV (.tsv/.txt) or JSON Lines with a text and a label per example; the label names "
                         "are those of the training file and are saved with the model (see README: Use your own data)")
    group.add_argument("--train-file", type=Path, help="training examples (default: the bundled sentiment data)")
    group.add_argument("--validation-file", type=Path, help="validation examples, evaluated after each epoch")
    group.add_argument("--test-file", type=Path, help="test examples, evaluated once after training")
    group.add_argument("--encoding", help="the files' encoding, e.g. cp932 (default: a byte-order mark decides, "
                                          "UTF-8 or UTF-16; else UTF-8)")


def load(args: argparse.Namespace) -> tuple[DataFiles | None, str | None]:
    """The data to train on and None, or None and why it cannot be read (one line naming file and line)."""
    if args.train_file is None:
        others = [option for option, value in (("--validation-file", args.validation_file),
                                               ("--test-file", args.test_file), ("--encoding", args.encoding)) if value]
        if others:
            return None, f"{others[0]} needs --train-file (without it, the bundled data is used)"
        return DataFiles(LABELS, load_split("train"), load_split("validation")), None
    if args.validation_file is None:
        return None, "--train-file needs --validation-file: examples to evaluate on after each epoch"
    try:
        data = load_data_files(args.train_file, args.validation_file, args.test_file, encoding=args.encoding)
    except DataFileError as error:
        return None, error.command_line  # --encoding cp932, not Python's encoding='cp932
    if getattr(args, "check_equivalence", False) and len(data.labels) != 2:
        return None, (f"--check-equivalence compares a two-label network; {args.train_file} has "
                      f"{len(data.labels)} labels")
    return data, None


def describe(data: DataFiles, tokenizer, max_length: int = MAX_LENGTH) -> str:
    """What was read: labels, sizes, and how many examples the tokenizer truncates at ``max_length`` tokens."""
    splits = [("train", data.train), ("validation", data.validation), ("test", data.test or [])]
    sizes = ", ".join(f"{name} {len(examples)}" for name, examples in splits if examples)
    truncated = sum(count_truncated(examples, tokenizer, max_length) for _, examples in splits if examples)
    return (f"labels {list(data.labels)}; examples: {sizes}; {truncated} longer than {max_length} tokens "
            f"(truncated to {max_length})")
