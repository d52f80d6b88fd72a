"""Chapter 5's text (issue 45): terms defined where first used, calls a reader can decode, exercises that ask a
student something (not the grader's internals), and the sections the issue asked for. Its code runs in
tests/test_book.py."""
import re

from mktestdocs import grab_code_blocks

from manualdp.runners.grader.check import EXERCISES
from tests.book.test_chapter_text import chapter, positional_calls


def _exercise(text: str, number: int) -> str:
    exercises = text[text.index("## Exercises"):]
    start = exercises.index(f"\n{number}. **")
    following = re.search(rf"\n{number + 1}\. \*\*", exercises)
    return exercises[start:following.start() if following else len(exercises)]


def test_chapter_5_defines_peer_error_and_the_groups_worker_before_it_uses_them():
    text = chapter("05")
    for term, definition in (("PeerError", "**`PeerError`**"), ("worker", "**group's worker**")):
        assert definition in text, term
        assert text.index(definition) <= min(m.start() for m in re.finditer(re.escape(term), text)) + 4, term


def test_chapter_5_passes_keywords_where_a_position_says_nothing():
    assert positional_calls("\n\n".join(grab_code_blocks(chapter("05"), lang="python"))) == []


def test_chapter_5_exercise_2_is_a_task_not_the_graders_internals():
    task = _exercise(chapter("05"), 2)
    assert "manualdp check hook my_hook.py" in task and "Then answer" in task
    for internal in ("1e-6", "global batch of 8 rows", "3, 3 and 2", "200\n   bytes", "cross-entropy"):
        assert internal not in task, internal


def test_chapter_5_says_what_the_call_check_catches_and_what_only_a_deadline_ends():
    text = " ".join(chapter("05").split())  # as read, whatever the line breaks
    assert "rank 0 alone calls an allreduce before a training step" in text
    assert "What no check can catch" in text and "only the deadline ends the wait" in text
    assert "dist.new_group(ranks=[0, 1])" in _exercise(chapter("05"), 4)


def test_chapter_5_has_accumulation_a_bucket_sweep_and_a_graded_rung_4():
    text = chapter("05")
    assert "## Gradient accumulation and the global batch" in text and "model.no_sync()" in text
    assert "micro-batch × accumulation steps (k) × data-parallel ranks (dp)" in text
    assert "## How big a bucket?" in text and "def exposed(" in text
    task = _exercise(text, 5)
    assert "manualdp check buckets my_buckets.py" in task and "buckets" in EXERCISES
