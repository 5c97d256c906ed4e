"""The static site (`make docs`): every notebook has a page, every internal link resolves, nothing is
fetched from another host, and a broken link fails the build."""

import json
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from bs4 import BeautifulSoup

from conftest import ROOT

# Attributes through which a page loads something (as opposed to <a href>, which the reader follows).
ASSET_ATTRIBUTES = {"script": "src", "link": "href", "img": "src", "source": "src", "iframe": "src",
                    "video": "src", "audio": "src", "embed": "src", "object": "data"}


def pages(site: Path) -> dict[Path, BeautifulSoup]:
    return {page: BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser") for page in site.rglob("*.html")}


def is_external(url: str) -> bool:
    return urlsplit(url).scheme in ("http", "https") or url.startswith("//")


def test_every_notebook_and_solution_has_a_page_linked_from_the_index(site, docs_build):
    index = BeautifulSoup((site / "index.html").read_text(encoding="utf-8"), "html.parser")
    linked = {a["href"].split("#")[0] for a in index.select("article a[href]")}
    notebooks = docs_build.notebooks()
    assert len(notebooks) >= 9
    for notebook in notebooks:
        html = notebook.relative_to(ROOT).with_suffix(".html")
        assert (site / html).is_file(), f"no page for {notebook.name}"
        assert str(html) in linked, f"index does not link {html}"


def test_index_describes_each_notebook_with_its_own_title_and_summary(site, docs_build):
    text = BeautifulSoup((site / "index.html").read_text(encoding="utf-8"), "html.parser").get_text()
    assert text.index("学習の道筋") < text.index("English")  # Japanese first
    for notebook in docs_build.notebooks():
        page = docs_build.describe(notebook)
        assert page.title in text and page.summary in text


def test_every_internal_link_and_anchor_resolves(site):
    parsed = pages(site)
    broken = []
    for page, soup in parsed.items():
        for tag in soup.find_all(href=True) + soup.find_all(src=True):
            url = tag.get("href") or tag.get("src")
            parts = urlsplit(url)
            if parts.scheme or url.startswith("//"):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {url}")
            elif parts.fragment and target.suffix == ".html":
                anchors = parsed[target]
                if not (anchors.find(id=unquote(parts.fragment)) or anchors.find(attrs={"name": parts.fragment})):
                    broken.append(f"{page.relative_to(site)}: {url} (no such anchor)")
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def test_pages_load_nothing_from_other_hosts(site):
    fetched = []
    for page, soup in pages(site).items():
        for tag, attribute in ASSET_ATTRIBUTES.items():
            fetched += [f"{page.relative_to(site)}: <{tag}> {el[attribute]}"
                        for el in soup.find_all(tag) if el.get(attribute) and is_external(el[attribute])]
        fetched += [f"{page.relative_to(site)}: inline style" for style in soup.find_all("style")
                    if "url(http" in style.get_text() or "@import" in style.get_text()]
    for css in site.rglob("*.css"):
        text = css.read_text(encoding="utf-8")
        if "url(http" in text.replace(" ", "") or "@import url(http" in text or "@import \"http" in text:
            fetched.append(str(css.relative_to(site)))
    assert not fetched, "assets from other hosts:\n" + "\n".join(fetched)


def test_plots_are_embedded_as_files_of_the_site(site):
    soup = BeautifulSoup((site / "notebooks/02_two_learning_rates.html").read_text(encoding="utf-8"), "html.parser")
    images = [img["src"] for img in soup.select("article img")]
    assert images, "notebook 02 stores figures; its page shows none"
    for src in images:
        assert (site / "notebooks" / src).resolve().is_file()


def test_math_is_rendered_without_a_script(site):
    soup = BeautifulSoup((site / "notebooks/solutions/01_solutions.html").read_text(encoding="utf-8"), "html.parser")
    assert soup.find("math") is not None
    assert not [s for s in soup.find_all("script", src=True) if "mathjax" in s["src"].lower()]


def notebook_with_markdown(path: Path, title: str, markdown: str):
    cell = {"cell_type": "markdown", "metadata": {}, "source": [markdown]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


def test_a_broken_link_in_a_notebook_fails_the_build(docs_build, tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    notebook_with_markdown(tmp_path / "notebooks/00_intro.ipynb", "x",
                           "# 00 はじめに\n*Intro.*\n\nSee [the next one](01_missing.ipynb).")
    with pytest.raises(SystemExit, match="sphinx-build failed"):
        docs_build.build(tmp_path / "site", root=tmp_path)


def test_a_notebook_without_a_summary_line_is_named(docs_build, tmp_path):
    notebook = tmp_path / "notebooks/00_intro.ipynb"
    notebook_with_markdown(notebook, "x", "# 00 はじめに\n\n本文だけ。")
    with pytest.raises(ValueError, match="00_intro.ipynb.*English summary"):
        docs_build.describe(notebook, root=tmp_path)
