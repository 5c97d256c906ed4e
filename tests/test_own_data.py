"""Your own files: every format and encoding people really save, labels from the training file, the
loader's own error for every bad file, and helpers.finetune trained on them with 1 and 2 processes."""

import codecs
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.checkpoint import read_labels
from helpers.data import (EXAMPLE_DATASET, DataFileError, Example, bundled_data_dir, count_truncated,
                          load_data_files, load_examples)
from helpers.finetune import parse_args
from helpers.models import load_tokenizer
from helpers.own_data import load
from helpers.predict import load_classifier, predict

ROWS = [("パスワードを忘れました", "アカウント"), ("無線が遅い, とても", "ネットワーク"), ("紙が詰まった", "プリンター"),
        ("ロックされた", "アカウント")]
EXPECTED = [Example("パスワードを忘れました", 0), Example("無線が遅い, とても", 1), Example("紙が詰まった", 2),
            Example("ロックされた", 0)]


def table(delimiter, header=True):
    lines = (["text", "label"],) if header else ()
    out = []
    for row in [*lines, *ROWS]:
        out.append(delimiter.join(f'"{field}"' if delimiter in field else field for field in row))
    return "\r\n".join(out) + "\r\n"


def jsonl():
    return "".join(json.dumps({"text": text, "label": label, "id": i}, ensure_ascii=False) + "\n"
                   for i, (text, label) in enumerate(ROWS))


ENCODINGS = {  # how each kind of file is written, byte for byte
    "utf-8": lambda text: text.encode("utf-8"),
    "utf-8 with BOM (Excel's CSV UTF-8)": lambda text: codecs.BOM_UTF8 + text.encode("utf-8"),
    "UTF-16 LE with BOM (Excel's Unicode text)": lambda text: codecs.BOM_UTF16_LE + text.encode("utf-16-le"),
    "UTF-16 BE with BOM": lambda text: codecs.BOM_UTF16_BE + text.encode("utf-16-be"),
}


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize(("name", "content"), [
    ("data.csv", table(",")), ("data.tsv", table("\t")), ("data.txt", table("\t")),
    ("noheader.csv", table(",", header=False)), ("noheader.tsv", table("\t", header=False)), ("data.jsonl", jsonl()),
])
def test_every_format_and_encoding_loads_the_same_examples(tmp_path, name, content, encoding):
    path = tmp_path / name
    path.write_bytes(ENCODINGS[encoding](content))
    data = load_data_files(path, path, path)
    assert data.labels == ("アカウント", "ネットワーク", "プリンター")  # sorted, whatever the file's order
    assert data.train == data.validation == data.test == EXPECTED


def test_cp932_loads_when_named_and_is_named_when_not(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(table(",").encode("cp932"))
    assert load_data_files(path, path, encoding="cp932").train == EXPECTED
    with pytest.raises(DataFileError, match=r"line 2: not valid utf-8 .* pass encoding='cp932' or save as UTF-8"):
        load_data_files(path, path)


def test_a_field_of_500000_characters_is_read_whole(tmp_path):
    document = "長い文書の一行目です、\n" + "あ" * 500_000
    path = tmp_path / "long.csv"
    with open(path, "w", encoding="utf-8", newline="") as file:
        csv.writer(file).writerows([("text", "label"), (document, "a"), ("短い", "b")])
    limit = csv.field_size_limit()
    data = load_data_files(path, path)
    assert data.train[0] == Example(document, 0) and len(data.train[0].text) == 500_012
    assert csv.field_size_limit() == limit  # the global default is put back


def test_the_tokenizer_side_counts_what_it_truncates():
    examples = [Example("短い文です。", 0), Example("とても長い文です。" * 40, 1), Example("あ" * 126, 0)]
    tokenizer = load_tokenizer()
    lengths = [len(tokenizer(example.text)["input_ids"]) for example in examples]
    assert count_truncated(examples, tokenizer, max_length=128) == sum(n > 128 for n in lengths) == 1


def test_labels_sort_numbers_by_value(tmp_path):
    path = tmp_path / "numbers.tsv"
    path.write_text("".join(f"文{i}\t{label}\n" for i, label in enumerate(["10", "2", "1", "2"])), encoding="utf-8")
    assert load_data_files(path, path).labels == ("1", "2", "10")


CP932_ONLY = "text,label\nok,a\n二度と頼まない,b\n".encode("cp932")
UTF8_JAPANESE = "text,label\n最高\n".encode("utf-8")
BAD_FILES = [  # name, bytes, the loader's whole message after "<path>"
    ("book.xlsx", b"PK\x03\x04", ": unsupported file type '.xlsx'; use .csv, .tsv, .txt or .jsonl; in Excel, save it "
                                 "as \"CSV UTF-8\""),
    ("empty.csv", b"", ": the file is empty; expected a header line with 'text' and 'label'"),
    ("bom_only.txt", codecs.BOM_UTF16_LE, ": the file is empty; expected a header line with 'text' and 'label'"),
    ("odd.txt", codecs.BOM_UTF16_LE + "text\tlabel\n".encode("utf-16-le") + b"\x41",
     ", line 2: starts with a UTF-16 LE byte-order mark but is not valid UTF-16 (truncated data at byte offset 24)"),
    ("nobom.txt", "text\tlabel\n良い\ta\n".encode("utf-16-le"),
     ", line 1: a NUL byte (offset 1) and no byte-order mark: this looks like UTF-16 saved without a mark, or not a "
     "text file; save it as UTF-8 (or as Excel's \"Unicode text\", which starts with a mark)"),
    ("latin1.csv", "text,label\ncafé crème,a\n".encode("latin-1"),
     ", line 2: not valid utf-8 (byte 0xe9 at offset 14), nor valid CP932 (Shift_JIS), and it starts with no "
     "byte-order mark (UTF-8 or UTF-16): save it as UTF-8."),
    ("cp932.csv", CP932_ONLY, ", line 3: not valid utf-8 (byte 0x93 at offset 16). Files saved by Excel in Japan are "
                              "often CP932 (Shift_JIS): pass encoding='cp932' or save as UTF-8."),
    ("header.csv", b"text,sentiment\nx,a\n", ", line 1: missing column(s) ['label']; the header has ['text', 'sentiment']"),
    ("short.csv", b"id,text,label\n1,x,a\n2,y\n", ", line 3: 2 field(s), but the header has 3"),
    ("three.csv", "良い,a\n悪い,b,c\n".encode(), ", line 2: 3 field(s); without a header row every row is exactly two "
                                             "fields, text then label, or else the first row names the columns 'text' "
                                             "and 'label'"),
    ("tabs.csv", "良い\ta\n".encode(), ", line 1: 1 field(s); without a header row every row is exactly two fields, "
                                       "text then label (this row is separated by tabs (name the file .tsv)), or else "
                                       "the first row names the columns 'text' and 'label'"),
    ("nolabel.tsv", "良い\t\n".encode(), ", line 1: the label is empty"),
    ("notext.tsv", "text\tlabel\n\ta\n".encode(), ", line 2: the text is empty"),
    ("bad.jsonl", b'{"text": "x", "label": "a"}\n{"text": "y", label: "b"}\n',
     ", line 2: not valid JSON (Expecting property name enclosed in double quotes at column 15)"),
    ("list.jsonl", b'["x", "a"]\n', ", line 1: expected a JSON object with \"text\" and \"label\", got list"),
    ("keys.jsonl", b'{"sentence": "x", "label": "a"}\n', ", line 1: missing key(s) ['text']; the object has "
                                                          "['sentence', 'label']"),
    ("bool.jsonl", b'{"text": "x", "label": true}\n', ", line 1: the label must be a name or a whole number, got true"),
    ("one.csv", b"text,label\nx,a\ny,a\n", ": every example has the label 'a'; a classifier needs at least two labels "
                                          "in the training file"),
    ("nul.csv", codecs.BOM_UTF8 + b"text,label\nx\x00,a\n", ", line 2: a NUL character; is this a text file?"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_FILES, ids=[name for name, _, _ in BAD_FILES])
def test_every_bad_file_gets_the_loaders_own_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataFileError) as error:
        load_data_files(path, path)
    assert str(error.value) == f"{path}{message}"


def test_wrong_encodings_named_by_the_caller(tmp_path):
    utf8, utf16 = tmp_path / "utf8.csv", tmp_path / "utf16.txt"
    utf8.write_bytes(UTF8_JAPANESE)
    utf16.write_bytes(codecs.BOM_UTF16_LE + "text\tlabel\n".encode("utf-16-le"))
    with pytest.raises(DataFileError, match=r"utf8\.csv, line 2: not valid cp932 \(byte 0x98 at offset 16\)\. "
                                            r"The file is valid UTF-8: leave encoding out\.$"):
        load_examples(utf8, encoding="cp932")
    with pytest.raises(DataFileError, match=r"utf16\.txt: starts with a UTF-16 LE byte-order mark, but "
                                            r"encoding='cp932' was given; leave encoding out and the mark decides$"):
        load_examples(utf16, encoding="cp932")


def test_a_label_training_never_saw_names_the_file_and_line(tmp_path):
    train, validation = tmp_path / "train.csv", tmp_path / "validation.csv"
    train.write_text("text,label\nx,a\ny,b\n", encoding="utf-8")
    validation.write_text("text,label\nx,a\n\ny,c\n", encoding="utf-8")
    with pytest.raises(DataFileError) as error:
        load_data_files(train, validation)
    assert str(error.value) == (f"{validation}, line 4: label 'c' does not occur in the training file {train}, whose "
                                f"labels are ['a', 'b']")


@pytest.mark.parametrize(("argv", "message"), [
    (["--validation-file", "v.csv"], "--validation-file needs --train-file (without it, the bundled data is used)"),
    (["--train-file", "t.csv"], "--train-file needs --validation-file: examples to evaluate on after each epoch"),
    (["--train-file", "t.csv", "--validation-file", "t.csv"], "t.csv: the file is empty; expected a header line with "
                                                              "'text' and 'label'"),
])
def test_the_command_line_reports_the_loaders_error(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.csv").write_text("")
    assert load(parse_args(argv)) == (None, message)


@pytest.mark.parametrize(("argv", "message"), [
    (["--train-file", "excel.csv", "--validation-file", "excel.csv"],
     "excel.csv, line 3: not valid utf-8 (byte 0x93 at offset 16). Files saved by Excel in Japan are often CP932 "
     "(Shift_JIS): pass --encoding cp932 or save as UTF-8."),
    (["--train-file", "utf16.txt", "--validation-file", "utf16.txt", "--encoding", "cp932"],
     "utf16.txt: starts with a UTF-16 LE byte-order mark, but --encoding cp932 was given; leave --encoding out and "
     "the mark decides"),
    (["--train-file", "utf8.csv", "--validation-file", "utf8.csv", "--encoding", "cp932"],
     "utf8.csv, line 2: not valid cp932 (byte 0x98 at offset 16). The file is valid UTF-8: leave --encoding out."),
])
def test_the_command_line_names_the_encoding_option_not_the_python_keyword(tmp_path, monkeypatch, argv, message):
    """The same files in Python (test_every_bad_file_gets_the_loaders_own_error) are told encoding='cp932'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "excel.csv").write_bytes(CP932_ONLY)
    (tmp_path / "utf16.txt").write_bytes(codecs.BOM_UTF16_LE + "text\tlabel\n".encode("utf-16-le"))
    (tmp_path / "utf8.csv").write_bytes(UTF8_JAPANESE)
    assert load(parse_args(argv)) == (None, message)


ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
FILES = bundled_data_dir(EXAMPLE_DATASET)
OWN = ["--train-file", str(FILES / "train.csv"), "--validation-file", str(FILES / "validation.csv"),
       "--test-file", str(FILES / "test.csv"), "--train-examples", "32", "--val-examples", "16",
       "--global-batch-size", "16", "--epochs", "1"]


@pytest.mark.parametrize("processes", [1, 2])
def test_finetune_trains_on_three_classes_and_predicts_their_names(tmp_path, processes):
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    command = [sys.executable, *launcher, "-m", "helpers.finetune", *OWN, "--output-dir", str(tmp_path)]
    run = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert ("labels ['アカウント', 'ネットワーク', 'プリンター']; examples: train 180, validation 42, test 42; "
            "0 longer than 128 tokens (truncated to 128)") in run.stdout
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert (result["world_size"], result["steps"], result["labels"]) == (processes, 2, ["アカウント", "ネットワーク",
                                                                                      "プリンター"])
    assert len(set(result["weights_sha256"])) == 1
    assert read_labels(tmp_path / "model") == ("アカウント", "ネットワーク", "プリンター")
    net, labels = load_classifier(tmp_path / "model")
    assert net.linear.out_features == 3
    # the saved model, asked through predict, scores the test file as the training run reported
    test = load_data_files(FILES / "train.csv", FILES / "validation.csv", FILES / "test.csv").test
    predictions = predict(net, load_tokenizer(), [example.text for example in test], labels=labels)
    right = sum(label == labels[example.label] for example, (label, _) in zip(test, predictions))
    assert result["test_accuracy"] == pytest.approx(right / len(test))
    # each name is the checkpoint's label at the head's largest logit, computed here without predict
    tokenizer = load_tokenizer()
    with torch.no_grad():
        encoded = [tokenizer(example.text, return_tensors="pt") for example in test[:5]]
        ids = [net.eval()(one["input_ids"], one["attention_mask"]).argmax().item() for one in encoded]
    assert [label for label, _ in predictions[:5]] == [labels[i] for i in ids]
