"""The static site (`make docs`): every notebook has a page, every internal link resolves, nothing is
fetched from another host, and a broken link fails the build. Outputs of notebooks executed on a GPU (docs/gpu-runs/)
show beside the stored ones for unchanged cells, and without such a folder the site is what the stored outputs give."""

import json
import shutil
import subprocess
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


# --- Outputs of a GPU run beside the stored ones (docs/gpu-runs/, docs/_ext/gpu_outputs.py) ---------------------------

H200 = {"machine": "16 CPU cores", "gpus": ["NVIDIA H200"], "torch": "2.11.0+cu130", "cuda": "13.0",
        "driver": "580.159.04", "python": "3.12.3", "date": "2026-12-04", "commit": "a7c4c7c", "note": "test run"}
RED_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
BLUE_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYPgPAAEDAQAIicLsAAAAAElFTkSuQmCC"
CPU_TAB, GPU_TAB = "CPU（保存済み）", "NVIDIA H200, torch 2.11"


def stdout(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def error(name, value):
    return {"output_type": "error", "ename": name, "evalue": value, "traceback": [f"{name}: {value}"]}


def figure(png):
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": png, "text/plain": "<Figure size 100x100 with 1 Axes>"}}


def code(source, outputs, tags=()):
    return {"cell_type": "code", "execution_count": 1, "metadata": {"tags": list(tags)}, "outputs": outputs,
            "source": source}


def write_notebook(path: Path, cells: list[dict]) -> None:
    cells = [{"id": f"c{i}", **cell} for i, cell in enumerate(cells)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cells": cells, "metadata": {"language_info": {"name": "python"}},
                                "nbformat": 4, "nbformat_minor": 5}, ensure_ascii=False), encoding="utf-8")


TITLE = {"cell_type": "markdown", "metadata": {}, "source": "# 00 デモ\n*Demo.*"}
STORED = [  # the committed notebook: (source, stored outputs, tags)
    ("print(device)", [stdout("device cpu\n")], ()),
    ("print('edited since')", [stdout("edited cpu\n")], ()),
    ("import MeCab", [stdout("dictionary ok\n")], ()),
    ("raise ValueError(device)", [error("ValueError", "cpu")], ("raises-exception",)),
    ("plot(device)", [figure(RED_PNG)], ()),
    ("print('same')", [stdout("same everywhere\n")], ()),
    ("plot('loss')", [figure(RED_PNG)], ()),
]
RUN = [  # what the GPU printed, one cell more at the top (deleted since) so that no cell keeps its index
    ("import extra", [stdout("extra\n")]),
    ("print(device)", [stdout("device cuda\n")]),
    ("print('before the edit')", [stdout("GPU output of the old code\n")]),
    ("import MeCab", [error("ModuleNotFoundError", "no dictionary on that machine")]),
    ("raise ValueError(device)", [error("ValueError", "cuda")]),
    ("plot(device)", [figure(BLUE_PNG)]),
    ("print('same')", [stdout("same "), stdout("everywhere\n")]),  # split into chunks, as a live run prints
    ("plot('loss')", []),  # that machine saved no figures
]


def demo_root(tmp_path: Path, run_cells=RUN) -> tuple[Path, Path]:
    """A repository with one notebook and one GPU run of it (not in docs/gpu-runs/: passed explicitly)."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("gpu-runs"))
    write_notebook(root / "notebooks/00_demo.ipynb", [TITLE] + [code(*cell) for cell in STORED])
    run = tmp_path / "gpu-run"
    write_notebook(run / "notebooks/00_demo.ipynb", [TITLE] + [code(*cell) for cell in run_cells])
    (run / "run.json").write_text(json.dumps(H200), encoding="utf-8")
    return root, run


def cell_with(soup: BeautifulSoup, source: str):
    cells = [cell for cell in soup.select("div.cell") if cell.select_one(".cell_input").get_text().strip() == source]
    assert len(cells) == 1, f"{len(cells)} cells with source {source!r}"
    return cells[0]


def tabs_of(cell) -> dict[str, str]:
    """label -> panel text of a cell's tabs ({} without tabs)."""
    group = cell.select_one(".gpu-tabs")
    if group is None:
        return {}
    labels = [label.get_text() for label in group.find_all("label")]
    panels = group.select(".gpu-tab-panel")
    assert len(labels) == len(panels) and [i["id"] for i in group.find_all("input")] == [
        label["for"] for label in group.find_all("label")]
    return {label: panel for label, panel in zip(labels, panels)}


@pytest.fixture(scope="module")
def demo_site(docs_build, tmp_path_factory):
    root, run = demo_root(tmp_path_factory.mktemp("demo"))
    docs_build.build(root / "build/site", root=root, gpu_run_folders=[run])
    page = root / "build/site/notebooks/00_demo.html"
    return page, BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")


def test_an_unchanged_cell_shows_the_gpu_output_beside_the_stored_one(demo_site):
    _, soup = demo_site
    tabs = tabs_of(cell_with(soup, "print(device)"))
    assert list(tabs) == [CPU_TAB, GPU_TAB]
    assert tabs[CPU_TAB].get_text().strip() == "device cpu" and tabs[GPU_TAB].get_text().strip() == "device cuda"
    assert tabs_of(cell_with(soup, "raise ValueError(device)"))[GPU_TAB].get_text().count("ValueError: cuda") == 1


def test_a_cell_edited_since_the_run_shows_only_its_stored_output_and_says_why(demo_site):
    _, soup = demo_site
    cell = cell_with(soup, "print('edited since')")
    assert not tabs_of(cell) and "edited cpu" in cell.get_text()
    assert "GPU output of the old code" not in soup.get_text()
    assert "NVIDIA H200, torch 2.11（2026-12-04）で実行したものと異なる" in cell.select_one(".gpu-outputs-note").get_text()
    assert len(soup.select(".gpu-outputs-note")) == 1  # only where the run printed something else


def test_an_error_in_a_cell_not_meant_to_raise_is_not_shown(demo_site):
    _, soup = demo_site
    cell = cell_with(soup, "import MeCab")
    assert not tabs_of(cell) and not cell.select(".gpu-outputs-note")
    assert "ModuleNotFoundError" not in soup.get_text()


def test_a_gpu_picture_is_shown_as_a_file_of_the_site(demo_site):
    page, soup = demo_site
    tabs = tabs_of(cell_with(soup, "plot(device)"))
    pictures = [tabs[label].find("img")["src"] for label in (CPU_TAB, GPU_TAB)]
    files = [(page.parent / src).resolve() for src in pictures]
    assert all(file.is_file() for file in files) and files[0].read_bytes() != files[1].read_bytes()


def test_same_output_or_a_run_without_figures_gives_no_tabs(demo_site):
    _, soup = demo_site
    assert not tabs_of(cell_with(soup, "print('same')")) and not tabs_of(cell_with(soup, "plot('loss')"))
    assert len(soup.select(".gpu-tabs")) == 3


def test_a_page_with_gpu_outputs_says_where_they_come_from_and_links_its_css(demo_site):
    page, soup = demo_site
    note = soup.select_one(".admonition").get_text()
    for fact in ("NVIDIA H200 1 基", "CUDA 13.0", "ドライバー 580.159.04", "torch 2.11.0+cu130", "Python 3.12.3",
                 "2026-12-04", "a7c4c7c", "バージョンによって変わります", "make gpu-check"):
        assert fact in note, fact
    css = [link["href"] for link in soup.find_all("link", href=True) if "gpu_outputs" in link["href"]]
    assert len(css) == 1 and (page.parent / css[0].split("?")[0]).resolve().is_file()


def test_without_gpu_runs_or_with_a_run_that_printed_the_same_nothing_changes(docs_build, tmp_path):
    root, _ = demo_root(tmp_path)
    plain = tmp_path / "plain/site"
    docs_build.build(plain, root=root, gpu_run_folders=[])
    staged = tmp_path / "plain/site-src/notebooks/00_demo.ipynb"
    assert staged.read_bytes() == (root / "notebooks/00_demo.ipynb").read_bytes()
    same_root, same_run = demo_root(tmp_path / "same", run_cells=[cell[:2] for cell in STORED])
    docs_build.build(tmp_path / "same/site", root=same_root, gpu_run_folders=[same_run])
    for page in ("notebooks/00_demo.html", "index.html"):
        assert (tmp_path / "same/site" / page).read_text() == (plain / page).read_text()
    assert not (plain / "_static/gpu_outputs.css").exists()


def test_make_docs_takes_every_gpu_run_by_default_and_none_with_an_empty_gpu_runs():
    def command(*args):
        out = subprocess.run(["make", "-n", "docs", "DEV_STAMP=", *args], cwd=ROOT, capture_output=True, text=True)
        return next(line for line in out.stdout.splitlines() if "docs/build.py" in line).split("docs/build.py")[1]

    assert command().split() == ["build/site"]
    assert command("GPU_RUNS=").split() == ["build/site", "--gpu-runs"]
    assert command("GPU_RUNS=a b").split() == ["build/site", "--gpu-runs", "a", "b"]


def test_cells_are_paired_by_source_even_when_moved_repeated_or_edited(docs_build):
    pair = docs_build.gpu_outputs.pair
    assert pair(["a", "b", "c"], ["x", "a", "b", "c"]) == {0: (1, True), 1: (2, True), 2: (3, True)}
    assert pair(["b", "a"], ["a", "b"]) == {0: (1, True), 1: (0, True)}
    assert pair(["n", "n"], ["n", "n"]) == {0: (0, True), 1: (1, True)}
    assert pair(["a", "B", "c"], ["a", "b", "c"]) == {0: (0, True), 1: (1, False), 2: (2, True)}
    assert pair(["a", "new", "c"], ["a", "c"]) == {0: (0, True), 2: (1, True)}


OWN_DATA_RUN = '"--train-file", str(files / "train.csv")'  # solutions 07, exercise 3: unchanged since the H200 run


def test_the_site_shows_the_committed_h200_run_for_unchanged_cells(site):
    """Drift: the committed H200 folder against today's notebooks. Solutions 07's own-data training (exercise 3) is
    unchanged since that run and printed NCCL and CUDA there; 05's table of predictions is unchanged too, but its
    H200 output was made by an older memory model and was removed from the folder, so it shows none."""
    solutions_07 = BeautifulSoup((site / "notebooks/solutions/07_solutions.html").read_text(encoding="utf-8"),
                                 "html.parser")
    training = [tabs_of(cell) for cell in solutions_07.select("div.cell") if OWN_DATA_RUN in cell.get_text()]
    assert "backend nccl, device cuda" in training[0][GPU_TAB].get_text()
    assert "backend gloo, device cpu" in training[0][CPU_TAB].get_text()
    memory = BeautifulSoup((site / "notebooks/05_gpu_memory.html").read_text(encoding="utf-8"), "html.parser")
    memo = [cell for cell in memory.select("div.cell") if 'memo = {"GPU0": 39057' in cell.get_text()]
    assert memo and not tabs_of(memo[0])
    setup = BeautifulSoup((site / "notebooks/00_setup.html").read_text(encoding="utf-8"), "html.parser")
    assert "PackageNotFoundError" not in setup.get_text()  # that machine's dictionary install, not the series
    assert "NVIDIA H200" in setup.select_one(".admonition").get_text()
    solutions = BeautifulSoup((site / "notebooks/solutions/01_solutions.html").read_text(encoding="utf-8"), "html.parser")
    assert not solutions.select(".gpu-tabs, .admonition, .gpu-outputs-note")  # not run there: nothing added


def test_without_gpu_runs_every_notebook_is_staged_as_committed(docs_build, tmp_path):
    docs_build.stage(tmp_path / "stage", gpu_run_folders=[])
    for notebook in docs_build.notebooks():
        assert (tmp_path / "stage" / notebook.relative_to(ROOT)).read_bytes() == notebook.read_bytes()
    assert not (tmp_path / "stage/gpu-runs").exists()
