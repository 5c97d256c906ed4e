"""The commands the README and its companion pages show are commands that work: every `python -m helpers.X ...`
parses with that module's own argument parser (run as `python -m` runs it, stopped right after parsing), every
`torchrun ...` with torchrun's, and every `make TARGET VAR=...` is a target make knows (`make -n`), GPU_CHECK_ARGS
and BENCH_ARGS parsed by their programs. Also: every link between these pages lands on a heading that exists, and
the benchmark table lives where benchmarks/run.py writes it."""

import argparse
import importlib.util
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "CONTRIBUTING.md", "WORKSHOP.md", "docs/training.md", "docs/memo-model.md"]
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def code_spans(markdown: str) -> list[tuple[int, str]]:
    """(line, text) of every shell command candidate: the lines of bash and unlabelled fenced blocks (a line ending
    in a backslash joined to the next) and every inline code span outside fenced blocks."""
    found, fence, lines = [], None, markdown.splitlines()
    number = 0
    while number < len(lines):
        line = lines[number]
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif fence in ("bash", "sh", ""):
            start = number
            while line.endswith("\\") and number + 1 < len(lines):
                number += 1
                line = line[:-1] + " " + lines[number].strip()
            found.append((start + 1, line))
        elif fence is None:
            found += [(number + 1, span) for span in re.findall(r"`([^`\n]+)`", line)]
        number += 1
    return found


def commands() -> list[tuple[str, str, list[str], dict[str, str]]]:
    """(where, kind, words, environment) for each distinct command of PAGES, kind being make, module or torchrun."""
    seen, found = set(), []
    for page in PAGES:
        for line, text in code_spans((ROOT / page).read_text(encoding="utf-8")):
            try:
                words = shlex.split(text, comments=True)
            except ValueError:
                continue
            env = {}
            while words and ENV_ASSIGNMENT.match(words[0]):
                name, value = words.pop(0).split("=", 1)
                env[name] = value
            if not words or (tuple(words), tuple(env.items())) in seen:
                continue
            program = words[0].rsplit("/", 1)[-1]
            if program == "make" and len(words) > 1:
                kind = "make"
            elif program in ("python", "python3") and len(words) > 2 and words[1] == "-m" and words[2].startswith("helpers"):
                kind = "module"
            elif program == "torchrun" and ("-m" in words or any(w.endswith((".py", "...")) for w in words)):
                kind = "torchrun"  # a command: it names what to run (`torchrun` alone, in prose, is a name)
            else:
                continue
            seen.add((tuple(words), tuple(env.items())))
            found.append((f"{page}:{line}: {text[:70]}", kind, words, env))
    return found


class Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args with the namespace, so that nothing after parsing runs."""


def has_parser(module: str) -> bool:
    """Whether the module (for a package: any module in it) builds an argument parser; one that does not takes no
    arguments, and running it would do its whole work."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"no module {module}"
    files = [Path(spec.origin)] if not spec.submodule_search_locations else [
        file for folder in spec.submodule_search_locations for file in Path(folder).rglob("*.py")]
    return any("ArgumentParser" in file.read_text(encoding="utf-8") for file in files)


def parse_module(module: str, args: list[str], monkeypatch, path: Path | None = None) -> argparse.Namespace | None:
    """Run ``module`` (or the script at ``path``) as ``python -m`` would, with ``args``, up to its parse_args."""
    if path is None and not has_parser(module):
        assert not args, f"{module} takes no arguments, but the page gives it {args}"
        return None
    original = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
    monkeypatch.setattr(sys, "argv", [module, *args])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
        try:
            if path:
                monkeypatch.syspath_prepend(str(path.parent))
                runpy.run_path(str(path), run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except Parsed as parsed:
            return parsed.args[0]
        except SystemExit as stop:
            if stop.code in (0, None):  # --help
                return argparse.Namespace()
            raise AssertionError(f"{module} {shlex.join(args)}: refused (exit {stop.code})") from stop
    raise AssertionError(f"{module} {shlex.join(args)}: parse_args was never called")


def cases():
    for where, kind, words, env in commands():
        yield pytest.param(kind, words, env, id=where)


def test_the_pages_show_commands_of_every_kind():
    kinds = [kind for _, kind, _, _ in commands()]
    assert kinds.count("make") >= 10 and kinds.count("module") >= 8 and kinds.count("torchrun") >= 6


@pytest.mark.parametrize(("kind", "words", "env"), list(cases()))
def test_the_command_parses(kind, words, env, monkeypatch):
    if kind == "make":
        if shutil.which("make") is None:
            pytest.skip("make is not installed")
        run = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env=os.environ | env)
        assert run.returncode == 0, run.stderr
        for variable, module, path in (("GPU_CHECK_ARGS", "helpers.checks.gpu_check", None),
                                       ("BENCH_ARGS", "benchmarks/run.py", ROOT / "benchmarks" / "run.py")):
            for word in words[1:]:
                if word.startswith(variable + "="):
                    parse_module(module, shlex.split(word.split("=", 1)[1]), monkeypatch, path)
        return
    if kind == "torchrun":
        from torch.distributed import run as torchrun

        parsed = torchrun.parse_args(words[1:])
        if not (parsed.module and parsed.training_script.startswith("helpers")):
            return
        words = ["python", "-m", parsed.training_script, *parsed.training_script_args]
    parse_module(words[2], words[3:], monkeypatch)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def test_every_link_between_the_pages_lands_on_a_heading():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            destination = (ROOT / page).parent / file if file else ROOT / page
            if not destination.exists() or (anchor and anchor not in anchors(destination)):
                broken.append(f"{page}: ({target})")
    assert not broken


def test_the_benchmark_table_lives_in_contributing_where_make_bench_writes_it():
    for page, count in (("CONTRIBUTING.md", 1), ("README.md", 0)):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert text.count("<!-- bench:start -->") == text.count("<!-- bench:end -->") == count, page
    assert 'TABLE_FILE = HERE.parent / "CONTRIBUTING.md"' in (ROOT / "benchmarks" / "run.py").read_text(encoding="utf-8")


def test_the_readme_starts_with_the_five_machines_and_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    first = "\n".join(lines[:40])
    for machine in ("no GPU", "Windows", "Colab", "Kaggle", "server"):
        assert re.search(rf"^\|[^|]*{machine}", first, re.MULTILINE), machine
    assert "](#日本語)" in first and "Disk and time" in first and "`make test` is the maintainers' command" in first
    assert len(lines) <= 400
