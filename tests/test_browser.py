"""JupyterLab in a real browser: `make lab` serves the notebooks, Debian's Chromium runs them.

The server gets a free loopback port and a token from the test; Playwright drives the system Chromium
(no browser download). Notebooks run as a learner runs them, without TQDM_DISABLE, so tqdm draws its
live widget. Autosave is off and the notebook files are checked unchanged: the test never writes them.
Screenshots go to build/screenshots/ for a person to look at.
"""

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = ROOT / "build" / "screenshots"
# As Debian's Chromium runs here as root, on a machine with no network beyond its package registries.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LAB_SETTINGS = {  # a learner's defaults, except that nothing is saved and no news is fetched
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}
ERROR_LINE = re.compile(r"^([A-Za-z_.]*(Error|Exception|Interrupt):|Traceback \(most recent call last\))", re.MULTILINE)

if not os.path.exists(CHROMIUM):
    if os.environ.get("CI"):
        raise RuntimeError("chromium is missing in CI: .ci/run installs it with apt-get (package chromium)")
    pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does this)",
                allow_module_level=True)

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in requirements-dev.txt")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """End make, the Jupyter server under it and the kernels it started (they run in their own sessions)."""
    try:
        family = [psutil.Process(process.pid)] + psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for member in reversed(family):
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=15)
    for member in alive:
        member.kill()
    process.wait(timeout=15)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`make lab` on a free loopback port with the test's token; yields the base URL with the token."""
    port, token = free_port(), secrets.token_hex(16)
    home = tmp_path_factory.mktemp("lab")
    for name, value in LAB_SETTINGS.items():
        path = home / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env.update(JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"))
    lab_args = (f"--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port={port} --ServerApp.port_retries=0 "
                f"--IdentityProvider.token={token} --LabApp.expose_app_in_browser=True "
                f"--FileCheckpoints.root_dir={home / 'checkpoints'}")  # JupyterLab's copies, not beside the notebooks
    log = (home / "lab.log").open("w")
    process = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_ARGS={lab_args}"], cwd=ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    before = {nb: hashlib.sha256(nb.read_bytes()).hexdigest() for nb in (ROOT / "notebooks").glob("*.ipynb")}
    files_before = set((ROOT / "notebooks").rglob("*"))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"make lab did not serve {base}:\n{(home / 'lab.log').read_text()}")
                time.sleep(0.5)
        yield base, token
    finally:
        stop(process)
        log.close()
    after = {nb: hashlib.sha256(nb.read_bytes()).hexdigest() for nb in before}
    assert after == before, "the browser test changed a committed notebook"
    left = sorted(str(path.relative_to(ROOT)) for path in set((ROOT / "notebooks").rglob("*")) - files_before)
    assert not left, f"the browser test left files beside the notebooks: {left}"


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, request):
    """A fresh browser tab; its last state is saved as a screenshot whether the test passed or failed."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    try:
        yield tab
    finally:
        try:
            screenshot(tab, f"{request.node.name}-end.png")
        finally:
            context.close()


def screenshot(page, name: str, **options) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name), **options)


def open_notebook(page, lab, name: str) -> None:
    base, token = lab
    page.goto(f"{base}/lab/tree/{name}?token={token}&reset")  # reset: no tabs left from an earlier test
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    # Wait for this notebook's own kernel, not that of another tab that was current a moment ago.
    page.wait_for_function("name => { const panel = window.jupyterapp?.shell.currentWidget;"
                           " return panel?.context?.path === name"
                           " && panel.sessionContext?.session?.kernel?.status === 'idle'; }",
                           arg=name, timeout=120_000, polling=500)


def menu(page, top: str, item: str) -> None:
    """Click a menu entry as a person would: the menu bar's ``top``, then ``item``."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{top}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).first.click()


def notebook_cells(page) -> list[dict]:
    """The open notebook's code cells as JupyterLab holds them: tags, execution count, outputs."""
    return page.evaluate("""() => {
        const panel = window.jupyterapp.shell.currentWidget;
        const cells = panel.content.model.cells;
        const rows = [];
        for (let i = 0; i < cells.length; i++) {
            const cell = cells.get(i);
            if (cell.type !== 'code') continue;
            const outputs = [];
            for (let j = 0; j < cell.outputs.length; j++) {
                const json = cell.outputs.get(j).toJSON();
                outputs.push({type: json.output_type, ename: json.ename || null, evalue: json.evalue || null,
                              text: [].concat(json.text || []).join(''), data: Object.keys(json.data || {})});
            }
            rows.push({index: i, tags: cell.getMetadata('tags') || [], count: cell.executionCount, outputs});
        }
        return rows;
    }""")


def wait_until_done(page, timeout_s: float, quiet_s: float = 5) -> None:
    """Until every code cell has run and the kernel is idle, or nothing has run or been queued for ``quiet_s``
    (Run All stopped early). Run All sends cells one at a time, so the kernel is briefly idle in between."""
    deadline, quiet_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        state = page.evaluate("""() => {
            const panel = window.jupyterapp.shell.currentWidget;
            const cells = [...Array(panel.content.model.cells.length).keys()].map(i => panel.content.model.cells.get(i));
            return {idle: panel.sessionContext.session?.kernel?.status === 'idle',
                    pending: [...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*')),
                    all_ran: cells.every(c => c.type !== 'code' || c.executionCount !== null)};
        }""")
        if state["idle"] and not state["pending"]:
            if state["all_ran"]:
                return
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= quiet_s:
                return
        else:
            quiet_since = None
        time.sleep(0.25)
    raise TimeoutError(f"the notebook was still running after {timeout_s} s")


def test_notebook_03_run_all_shows_the_real_attributeerror_and_nothing_else_fails(page, lab):
    open_notebook(page, lab, "03_dataparallel_attributeerror.ipynb")
    menu(page, "Edit", "Clear Outputs of All Cells")
    cleared = notebook_cells(page)
    assert all(not cell["outputs"] and cell["count"] is None for cell in cleared)

    menu(page, "Run", "Run All Cells")
    wait_until_done(page, timeout_s=240)
    cells = notebook_cells(page)
    screenshot(page, "03_run_all.png")

    # This run numbered every code cell once, in order, in a fresh kernel: nothing is left over or skipped.
    assert [cell["count"] for cell in cells] == list(range(1, len(cells) + 1))
    errors = [(i, out) for i, cell in enumerate(cells) for out in cell["outputs"] if out["type"] == "error"]
    assert ("AttributeError", "'DataParallel' object has no attribute 'bert'") in [
        (out["ename"], out["evalue"]) for _, out in errors]
    unexpected = [(i, out["ename"]) for i, out in errors if "raises-exception" not in cells[i]["tags"]]
    assert not unexpected, f"cells failed that should not: {unexpected}"
    printed_errors = [(i, out["text"]) for i, cell in enumerate(cells) for out in cell["outputs"]
                      if out["type"] == "stream" and ERROR_LINE.search(out["text"])]
    assert not printed_errors
    failed = next(cell for cell in cells if any(out["ename"] == "AttributeError" for out in cell["outputs"]))
    page.evaluate("i => window.jupyterapp.shell.currentWidget.content.scrollToItem(i, 'center')", failed["index"])
    page.get_by_text("'DataParallel' object has no attribute 'bert'").first.wait_for(state="visible")
    screenshot(page, "03_attributeerror.png")


def test_notebook_02_training_draws_a_live_tqdm_widget(page, lab):
    open_notebook(page, lab, "02_two_learning_rates.ipynb")
    menu(page, "Run", "Run All Cells")
    # tqdm.auto picks its notebook widget in JupyterLab (model loading draws one too: take the training bar).
    progress = page.locator(".jp-OutputArea-output .widget-hbox", has_text=re.compile(r"^train")).first
    progress.wait_for(state="visible", timeout=240_000)
    assert progress.locator(".widget-hprogress").is_visible()
    page.wait_for_function("el => /\\b[1-9]\\d*\\/\\d+\\b/.test(el.textContent)", arg=progress.element_handle(),
                           timeout=120_000, polling=250)
    label = progress.text_content()
    progress.scroll_into_view_if_needed()
    screenshot(page, "02_tqdm_widget.png")
    menu(page, "Kernel", "Interrupt Kernel")
    wait_until_done(page, timeout_s=60)

    assert re.search(r"train:\s+\d+%", label), label
    cells = notebook_cells(page)
    # Run All stopped in the training cell, which holds the widget: the bar was live when it was interrupted.
    stopped = [cell for cell in cells for out in cell["outputs"] if out["ename"] == "KeyboardInterrupt"]
    assert len(stopped) == 1
    assert any("application/vnd.jupyter.widget-view+json" in out["data"] for out in stopped[0]["outputs"])


def test_a_docs_page_reads_offline_on_a_phone(browser, site):
    context = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True)
    requested = []
    context.route(re.compile(r"^https?://"), lambda route: (requested.append(route.request.url), route.abort()))
    try:
        page = context.new_page()
        for name, html in (("docs_index_phone.png", "index.html"),
                           ("docs_03_phone.png", "notebooks/03_dataparallel_attributeerror.html")):
            page.goto((site / html).as_uri())
            page.wait_for_load_state("load")
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), f"{html} scrolls sideways"
            screenshot(page, name)
        assert page.locator("button.copybtn").count() > 0  # every code cell has a copy button
    finally:
        context.close()
    assert not requested, f"the site fetched from other hosts: {requested}"


@pytest.mark.parametrize("width", [1400, 390])
def test_a_docs_page_switches_between_cpu_and_gpu_outputs_without_script(browser, site, width):
    """Notebook 07's first training run: the stored CPU output first, the H200's after a tap on its tab; CSS only
    (scripts off), nothing fetched from another host, no sideways scrolling on a phone."""
    context = browser.new_context(viewport={"width": width, "height": 900}, is_mobile=width < 500,
                                  device_scale_factor=2 if width < 500 else 1, java_script_enabled=False)
    requested = []
    context.route(re.compile(r"^https?://"), lambda route: (requested.append(route.request.url), route.abort()))
    try:
        page = context.new_page()
        page.goto((site / "notebooks/solutions/07_solutions.html").as_uri())  # exercise 3: unchanged since the H200 run
        cell = page.locator("div.cell").filter(has=page.locator(".cell_input", has_text='"--train-file"')).first
        cpu, gpu = cell.locator(".gpu-tab-panel").nth(0), cell.locator(".gpu-tab-panel").nth(1)
        cell.scroll_into_view_if_needed()
        assert cpu.is_visible() and not gpu.is_visible()
        assert "backend gloo, device cpu" in cpu.inner_text()
        screenshot(page, f"docs_07_tab_cpu_{width}.png")

        cell.locator("label", has_text="NVIDIA H200, torch 2.11").click()
        assert gpu.is_visible() and not cpu.is_visible()
        assert "backend nccl, device cuda" in gpu.inner_text()
        screenshot(page, f"docs_07_tab_gpu_{width}.png")
        cell.locator("label", has_text="CPU（保存済み）").click()
        assert cpu.is_visible() and not gpu.is_visible()
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "the page scrolls sideways"
    finally:
        context.close()
    assert not requested, f"the site fetched from other hosts: {requested}"
