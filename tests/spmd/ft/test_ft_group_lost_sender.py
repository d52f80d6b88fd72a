"""A replica group whose state sender dies during recovery (soak: 3 one-rank group processes, `group_worker.py`).

Groups A and B train; C joins and is planned to receive from A, which is SIGKILLed as it is about
to send. C's rank names the lost group in one line, asks again, receives from B, and trains on;
B and C end on the same parameters, equal to the one-process reference of the steps' members.
"""
import json
import pathlib
import time

import pytest

from tests.spmd.ft.test_ft_group_train import check_against_reference, groups, log, records, wait  # noqa: F401


@pytest.mark.soak
def test_a_sender_lost_during_recovery_is_named_and_another_holder_sends(groups):  # noqa: F811
    a = groups.start("A", 1, steps=1000, min_groups=2, pace=0.3, die_on_send=2)  # send 1: B's first state
    b = groups.start("B", 1, steps=2, min_groups=2, pace=0.3, with_group=["C", 3])  # waits for C
    deadline = time.monotonic() + 120
    while not records(b[0][1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert records(b[0][1]), log(b[0][1])[-2000:]
    # planned to receive from A, the first holder
    c = groups.start("C", 1, steps=2, min_groups=2, pace=0.3, with_group=["B", 3])
    codes = wait(a + b + c, timeout=240)
    logs = [log(out)[-2000:] for _, out in a + b + c]
    assert codes == [-9, 0, 0], logs
    line = next((x for x in log(c[0][1]).splitlines() if "was lost while sending" in x), None)
    assert line is not None and "replica group 'C', rank 0: replica group 'A' (rank 0) was lost while sending its " \
        "state" in line, logs[2]
    runs = [records(out) for _, out in a + b + c]
    last = max(runs[1])
    assert max(runs[2]) == last and runs[1][last]["params"] == runs[2][last]["params"]
    members = check_against_reference(runs, last + 1, size=1)
    assert members[-3:] == [["B", "C"]] * 3, members
    end = json.loads(pathlib.Path(str(c[0][1]) + ".end").read_text())
    assert [r["source"] for r in end["recoveries"]] == ["B/lane/0"], end
