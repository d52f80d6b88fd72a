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
    assert stated == pytest.approx(computed, rel=1e-12), f"at n = {n} the chapter says {stated}, cost() gives {computed}"


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
