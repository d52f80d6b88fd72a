"""What the chapters of book/ state in words (a ratio, a numbering), held to the code they describe."""
import pathlib
import re

import pytest

from manualdp.cost import cost
from manualdp.schedule import naive, ring

BOOK = pathlib.Path(__file__).resolve().parents[2] / "book"


def chapter(prefix: str) -> str:
    return next(BOOK.glob(f"{prefix}-*.md")).read_text()


def stated_ratio(text: str) -> str:
    """The expression in n of chapter 3's sentence "naive's beta term is ... times the ring's"."""
    found = re.findall(r"naive's beta term is\s+(\S+)\s+times\s+the\s+ring's", text)
    assert len(found) == 1, f"chapter 3 should state naive's beta term against the ring's once, found {found}"
    return found[0]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16])
def test_chapter_3_states_naives_beta_term_against_the_rings_as_cost_computes_it(n):
    S, beta = n * 3 * 1024, 1e-9  # a multiple of n: chunks of equal size
    computed = cost(naive(n), S, 0, beta, 0) / cost(ring(n), S, 0, beta, 0)
    stated = eval(stated_ratio(chapter("03")), {}, {"n": n})  # noqa: S307 (the book's own text)
    assert stated == pytest.approx(computed, rel=1e-12), f"at n = {n} the chapter says {stated}, cost() says {computed}"


def test_the_check_of_the_stated_ratio_refuses_the_old_statement():
    assert eval(stated_ratio("so naive's beta term is n/2 times the ring's."), {}, {"n": 4}) == 2  # noqa: S307
    assert cost(naive(4), 4096, 0, 1e-9, 0) / cost(ring(4), 4096, 0, 1e-9, 0) == pytest.approx(4)


def test_chapter_3_measures_on_the_devices_it_names_and_keeps_the_exercise_in_step():
    text = chapter("03")
    block = text.split("## Measure on your own machine")[1].split("## Where the model is wrong")[0]
    code = "".join(re.findall(r"```python\n(.*?)```", block, re.S))
    assert "devices_here = 4" in code
    assert not re.search(r"range\(4\)|ring\(4\)|get_schedule\(algorithm, 4\)|, 4\)|, 4,", code), code
    assert "Set `devices_here = 8`" in text.split("## Exercises")[1]


# ---------------------------------------------------------------- rounds are counted from 1 everywhere (case 2)
def two_rounds_the_second_bad():
    from manualdp.transfers import Schedule, Transfer

    fine = (Transfer(1, 0, 0, True),)
    clash = (Transfer(0, 1, 0, False), Transfer(1, 0, 0, True))  # device 1 sends chunk 0 and overwrites it
    return Schedule("bad", num_devices=2, num_chunks=1, rounds=(fine, clash), phases=("fine", "clash"))


def test_check_schedule_the_grader_and_explain_count_the_same_round_from_1():
    from manualdp.cost import check_schedule
    from manualdp.runners.explain import trace
    from manualdp.runners.grader.properties.common import Mismatch
    from manualdp.runners.grader.properties.schedule import schedule_property

    bad = two_rounds_the_second_bad()
    with pytest.raises(ValueError, match=r"^round 2: a device sends a chunk that it overwrites in the same round: "
                                         r"device 1's chunk 0$"):
        check_schedule(bad)
    with pytest.raises(Mismatch, match=r"schedule\(2\): round 2: a device sends a chunk"):
        schedule_property(lambda n: bad.rounds, 2)
    with pytest.raises(Mismatch, match=r"schedule\(2\): round 2 holds Transfer\(src=0, dst=1, chunk=0, reduce=1\)"):
        schedule_property(lambda n: [[(1, 0, 0, True)], [(0, 1, 0, 1)]], 2)
    # explain's "round r" is rounds[r - 1], and the pictures' state after it is trace(...)[r]
    from manualdp.runners.explain import explain
    text = explain("ring", 3, 12, show_state=False)
    assert "\nround 1 (reduce-scatter)" in text and "round 0" not in text
    assert len(trace(bad)) == len(bad.rounds) + 1


def test_chapter_2_says_rounds_count_from_1_and_builds_its_bad_schedule_with_keywords():
    text = chapter("02")
    assert "Rounds are counted from 1" in text and "round 1 is\n`schedule.rounds[0]`" in text
    assert 'Schedule("bad", num_devices=2, num_chunks=1, rounds=' in text and 'Schedule("bad", 2' not in text


# ---------------------------------------------------------------- calls a reader can decode (case 4)
# the most positional arguments a chapter may pass each call: past these, a reader needs the source to decode them
MOST_POSITIONAL = {"Schedule": 1, "cost": 5, "launch": 1, "train_spmd": 2, "train": 2, "Member": 1, "Quorum": 1}


def positional_calls(source: str) -> list[str]:
    """The calls of `source` that pass more positional arguments than MOST_POSITIONAL allows."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in MOST_POSITIONAL and len(node.args) > MOST_POSITIONAL[name]:
                found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("prefix", ["01", "02", "03", "04"])
def test_chapters_1_to_4_pass_keywords_where_a_position_says_nothing(prefix):
    from mktestdocs import grab_code_blocks

    source = "\n\n".join(grab_code_blocks(chapter(prefix), lang="python"))
    assert positional_calls(source) == []


def test_the_positional_check_finds_the_calls_the_chapters_used_to_make():
    old = ('Schedule("bad", 2, 1, (), ("swap",))\ncost(schedule, size, a, b, g, 4)\n'
           'launch(record_ladder, 2, (3,), timeout=300)\ntrain_spmd(net, loader, [], 1, 0.1, loss_fn=f)\n')
    assert len(positional_calls(old)) == 4


# ---------------------------------------------------------------- chapter 4: the frozen layer, and exercise 3 (3, 5)
def test_chapter_4_says_why_the_graders_model_has_parameters_without_a_gradient():
    text = " ".join(chapter("04").split())
    assert "`frozen.requires_grad_(False)`" in text and "its `.grad` stays `None`" in text
    assert "which gradients go into the buffer?" in text


def test_chapter_4_exercise_3_asks_without_answering():
    exercise = " ".join(chapter("04").split("3. **When backward returns:**")[1].split("A reference rung 1")[0].split())
    assert "(" not in exercise.split("Why the post-accumulate hook")[1].split("print `p.grad`")[0]
    for answer in ("Both fire once", "fires before the sum", "last step's gradient", "fails on `None`"):
        assert answer not in exercise


# ---------------------------------------------------------------- terms defined before use, and the glossary (case 6)
def test_the_glossary_defines_the_terms_chapters_use_early_and_the_books_readme_links_it():
    glossary = (BOOK / "glossary.md").read_text()
    defined = re.findall(r"^\*\*(.+?)\*\*", glossary, re.M)
    for term in ("algbw", "busbw", "PeerError", "per-group worker", "DTensor", "`no_sync()`", "torchft", "quorum",
                 "`StepResult`", "default loss", "frozen layer", "round", "chunk"):
        assert any(term in d for d in defined), f"the glossary does not define {term}"
    assert defined == sorted(defined, key=lambda d: d.strip("`").lower()), "the glossary is not in alphabetical order"
    assert "](glossary.md)" in (BOOK / "README.md").read_text()


def test_chapter_1_defines_stepresult_and_the_default_loss_where_it_first_shows_them():
    text = chapter("01")
    first = text.index("StepResult")
    assert "**`StepResult`**, a named tuple" in text[first - 20:first + 40]
    assert text.index("**default loss**") < text.index("result = train_batch(")


def test_busbw_is_defined_where_the_reader_first_meets_it():
    chapters = sorted(BOOK.glob("[0-9][0-9]-*.md"))
    first = next(c for c in chapters if "busbw" in c.read_text())
    assert first.name.startswith("03-") and "**busbw** (bus bandwidth)" in first.read_text()
