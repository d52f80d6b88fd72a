"""The book (book/) does not go stale: every chapter's code runs as a student runs it (its blocks pasted in order into
one script, in a folder of its own), and every figure it shows is made by book/figures.py."""
import importlib.util
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest
from mktestdocs import grab_code_blocks
from PIL import Image

from manualdp.runners.explain_zero3 import demo_step
from manualdp.schedule import ring

BOOK = pathlib.Path(__file__).resolve().parents[1] / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]-*.md"))
PAGES = CHAPTERS + [BOOK / "README.md", BOOK / "reference.md"]


def figures_module():
    spec = importlib.util.spec_from_file_location("book_figures", BOOK / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script(chapter: pathlib.Path) -> str:
    """A chapter's `python` blocks pasted in order into one file, as a student would."""
    return "\n\n".join(grab_code_blocks(chapter.read_text(), lang="python"))


def run_as_a_student(chapter: pathlib.Path, folder: pathlib.Path, times: int, apart: bool = True) -> None:
    """`python chapter.py` in `folder`, `times` times in a row: each run must end with status 0.

    `apart=False` runs the same file in this interpreter instead (`runpy`, as `__main__`, from `folder`): the ranks
    it launches still import it by its path, and the fork server this process already runs saves each chapter the
    start of a Python and of a fork server (about 4 s)."""
    path = folder / f"{chapter.stem}.py"
    path.write_text(script(chapter))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    for run in range(1, times + 1):
        if apart:
            proc = subprocess.run([sys.executable, path.name], cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"{chapter.name}, run {run} of {times}, as one script:\n{proc.stderr[-3000:]}"
            continue
        here = os.getcwd()
        os.chdir(folder)
        try:
            runpy.run_path(str(path), run_name="__main__")  # by its whole path, which the ranks import
        except BaseException as e:
            raise AssertionError(f"{chapter.name}, run {run} of {times}, as one script: {type(e).__name__}: {e}") from e
        finally:
            os.chdir(here)


# Each chapter once, in this interpreter; chapter 4 (the first to start ranks) in a Python of its own, and chapter
# 7 (it writes checkpoints) twice. Every chapter runs twice, each run a Python of its own: bench/test_book_twice.py.
@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_the_code_of_a_chapter_runs_as_one_script(chapter, tmp_path):
    blocks = grab_code_blocks(chapter.read_text(), lang="python")
    assert blocks and any("assert" in b for b in blocks), f"{chapter.name} has no code that checks what it says"
    run_as_a_student(chapter, tmp_path, 2 if chapter.name.startswith("07-") else 1,
                     apart=chapter.name.startswith("04-"))


def test_a_chapter_whose_code_fails_fails(tmp_path):
    page = tmp_path / "99-wrong.md"
    page.write_text("Text.\n\n```python\nx = 1\n```\n\n```bash\nexit 1\n```\n\n```python\nassert x == 2\n```\n")
    with pytest.raises(AssertionError, match="99-wrong.md, run 1 of 2, as one script"):
        run_as_a_student(page, tmp_path, 2)
    with pytest.raises(AssertionError, match="99-wrong.md, run 1 of 1, as one script: AssertionError"):
        run_as_a_student(page, tmp_path, 1, apart=False)


def test_a_chapter_that_cannot_run_twice_in_one_folder_fails(tmp_path):
    page = tmp_path / "99-once.md"
    page.write_text("```python\nimport os\n\nos.mkdir('out')  # a second run finds it\n```\n")
    with pytest.raises(AssertionError, match="run 2 of 2"):
        run_as_a_student(page, tmp_path, 2)
    (tmp_path / "out").rmdir()
    with pytest.raises(AssertionError, match="run 2 of 2, as one script: FileExistsError"):
        run_as_a_student(page, tmp_path, 2, apart=False)


def stripped(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_the_excerpts_are_the_code():
    # `py` blocks are shown, not run: each must still be lines of a file of the package, in order
    sources = [stripped(path.read_text()) for path in (BOOK.parent / "manualdp").rglob("*.py")]
    for chapter in CHAPTERS:
        for block in grab_code_blocks(chapter.read_text(), lang="py"):
            lines = stripped(block)
            found = any(src[i:i + len(lines)] == lines for src in sources for i in range(len(src)))
            assert found, f"{chapter.name}: this excerpt is no longer in manualdp/:\n{block}"


@pytest.mark.parametrize("out, words", [
    ("{tmp}/a-file", "it exists and is not a folder"),
    ("{tmp}/a-fifo", "it exists and is not a folder"),
    ("/proc/x", "cannot write in /proc"),
    ("/sys/manualdp-figures", "cannot write in /sys"),  # a read-only file system (a read-only folder, even for root)
    ("", "the path is empty"),
])
def test_figures_refuse_an_out_folder_they_cannot_write_in_one_line_before_any_work(out, words, tmp_path, capsys):
    """These were tracebacks naming a .tmp file, after the first figures had been drawn."""
    import os
    (tmp_path / "a-file").write_text("mine")
    os.mkfifo(tmp_path / "a-fifo")
    out = out.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as info:
        figures_module().main(["--fast", "--out", out])
    stdout, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert info.value.code == 2 and stdout == "" and "Traceback" not in err and ".tmp" not in err
    assert last.startswith(f"python book/figures.py: error: --out {out!r}: ") and words in last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-fifo", "a-file"]
    assert (tmp_path / "a-file").read_text() == "mine"


def test_every_figure_builds(tmp_path):
    figures = figures_module()
    paths = figures.build(str(tmp_path), fast=True)
    assert sorted(pathlib.Path(p).name for p in paths) == sorted(figures.FIGURES)
    for path in paths:
        with Image.open(path) as image:
            assert image.format == ("GIF" if path.endswith(".gif") else "PNG") and min(image.size) > 100
            if path.endswith("ring.gif"):  # the start, then one frame per round
                assert image.n_frames == len(ring(4).rounds) + 1
            if path.endswith("zero3.gif"):  # between steps, then one frame per collective of the step
                assert image.n_frames == len(demo_step(4).collectives) + 1


def shown(page: pathlib.Path) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(figures/([^)]+)\)", page.read_text())


def test_every_figure_shown_is_made_by_figures_py_and_every_figure_made_is_shown():
    made = set(figures_module().FIGURES)
    pictures = {name for page in PAGES for name in shown(page)}
    assert pictures <= made, f"shown but not made by book/figures.py: {sorted(pictures - made)}"
    assert made <= pictures, f"made but shown in no chapter: {sorted(made - pictures)}"
    missing = [name for name in pictures if not (BOOK / "figures" / name).is_file()]
    assert not missing, f"run python book/figures.py: book/figures/ lacks {missing}"


def test_the_links_between_pages_lead_somewhere():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
