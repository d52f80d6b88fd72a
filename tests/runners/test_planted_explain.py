"""`manualdp explain`: numbers that planted bugs slipped past (issue 20); each test fails with one of them."""
import re

import pytest

from manualdp.cost import traffic
from manualdp.runners.explain import _us, explain, explain_auto
from manualdp.schedule import ALGORITHMS, get_collective
from manualdp.spmd.auto.tune import Link, predict


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("n", [2, 4])
def test_the_textbook_bytes_of_reduce_scatter_and_all_gather_are_what_the_schedule_sends(collective, n):
    size = 4096  # n divides it: every device sends exactly (n-1)/n * S
    text = explain(collective, n, size_bytes=size)
    printed = int(re.search(r"textbook: every device sends and receives \(n-1\)/n \* S = (\d+) bytes", text)[1])
    sent = traffic(get_collective(collective, "ring", n), size, 4)["sent"]
    assert printed == (n - 1) * size // n == max(sent)


def test_explain_auto_predicts_with_the_element_size_it_is_given():
    link = Link(1e-6, 1e-6, 1e-6, 0.5)
    size = 56  # 7 elements of 8 bytes cut in 3 chunks (24, 16, 16 bytes); 14 of 4 bytes would be 20, 20, 16
    text = explain_auto(3, size, link, element_size=8)
    predicted = {a: predict(a, 3, size, link, 8) for a in ALGORITHMS}
    assert predicted != {a: predict(a, 3, size, link, 4) for a in ALGORITHMS}, "the test would see nothing"
    for a in ALGORITHMS:
        line = next(x for x in text.splitlines() if x.strip().startswith(a + " "))
        assert _us(predicted[a]) in line, line
