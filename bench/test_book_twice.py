"""Every chapter of the book run as a student runs it, twice in a row in one folder (tests/test_book.py runs each
once, and chapter 7, which writes checkpoints, twice): a chapter leaves nothing behind that stops it running again.

    python -m pytest -q bench/test_book_twice.py      (in bench/soak_tests.sh)
"""
import pytest

from tests.test_book import CHAPTERS, run_as_a_student


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_a_chapter_runs_twice_in_one_folder(chapter, tmp_path):
    run_as_a_student(chapter, tmp_path, 2)
