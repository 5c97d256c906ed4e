"""load_examples: a user's own CSV/TSV, and clear errors that name the file and line (more in test_own_data.py)."""

import pytest

from helpers.data import DataFileError, Example, load_examples


def write(tmp_path, name, content, encoding="utf-8"):
    path = tmp_path / name
    path.write_bytes(content.encode(encoding))
    return path


def test_tsv_with_names_and_ids_and_extra_columns(tmp_path):
    path = write(tmp_path, "mine.tsv", "id\tlabel\ttext\n1\tpositive\t美味しい\n2\t0\t安いけど美味しくない\n\n")
    assert load_examples(path) == [Example("美味しい", 1), Example("安いけど美味しくない", 0)]


def test_csv_with_quotes_and_excel_bom(tmp_path):
    path = write(tmp_path, "mine.csv", '\ufefftext,label\n"良い、とても良い",positive\n')
    assert load_examples(path) == [Example("良い、とても良い", 1)]


def test_cp932_file_is_read_when_asked(tmp_path):
    path = write(tmp_path, "excel.csv", "text,label\n最高のラーメン,positive\n", encoding="cp932")
    assert load_examples(path, encoding="cp932") == [Example("最高のラーメン", 1)]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.tsv", "", r"empty\.tsv: the file is empty"),
        ("blank.tsv", "\n \n", r"blank\.tsv: the file is empty"),
        ("header_only.tsv", "text\tlabel\n", r"header_only\.tsv: a header but no examples"),
        ("nolabel.tsv", "text\tsentiment\n良い\tpositive\n", r"nolabel\.tsv, line 1: missing column\(s\) \['label'\]"),
        ("unknown.tsv", "text\tlabel\n良い\tpositive\n悪い\tneutral\n", r"unknown\.tsv, line 3: unknown label 'neutral'"),
        ("short.tsv", "text\tlabel\n良い\tpositive\n悪い\n", r"short\.tsv, line 3: 1 field\(s\), but the header has 2"),
        ("notext.csv", "text,label\n,positive\n", r"notext\.csv, line 2: the text is empty"),
        ("data.xlsx", "text\tlabel\n", r"data\.xlsx: unsupported file type '\.xlsx'; use \.csv, \.tsv, \.txt or \.jsonl; "
                                        r"in Excel, save it as \"CSV UTF-8\""),
    ],
)
def test_bad_files_name_the_file_and_line(tmp_path, name, content, message):
    with pytest.raises(DataFileError, match=message):
        load_examples(write(tmp_path, name, content))


def test_cp932_read_as_utf8_names_the_line_and_the_fix(tmp_path):
    path = write(tmp_path, "excel.csv", "text,label\ngood,positive\n最高,positive\n", encoding="cp932")
    with pytest.raises(DataFileError, match=r"excel\.csv, line 3: not valid utf-8 .*encoding='cp932'"):
        load_examples(path)


def test_custom_label_names(tmp_path):
    path = write(tmp_path, "three.tsv", "text\tlabel\n普通\tneutral\n")
    assert load_examples(path, labels=("negative", "neutral", "positive")) == [Example("普通", 1)]


@pytest.mark.parametrize(
    ("name", "content", "encoding", "cause"),
    [
        ("bad.jsonl", '{"text": "良い", "label": 1\n', {}, "JSONDecodeError"),
        ("bad.tsv", "text\tlabel\n良い\tpositive\n", {"encoding": "no-such-codec"}, "LookupError"),
        ("sjis.csv", "text,label\n最高,positive\n".encode("cp932").decode("latin-1"), {}, "UnicodeDecodeError"),
    ],
)
def test_a_refused_file_keeps_the_parsers_error_as_its_cause(tmp_path, name, content, encoding, cause):
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1") if name == "sjis.csv" else content.encode("utf-8"))
    with pytest.raises(DataFileError) as refused:
        load_examples(path, **encoding)
    assert type(refused.value.__cause__).__name__ == cause
