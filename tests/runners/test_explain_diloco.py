"""`manualdp explain diloco` on any number of devices: its bytes in closed form, its time from the loads, no schedule.

The closed forms are held to the schedules' own traffic on small numbers of devices.
"""
import pytest

from manualdp.cost import cost, traffic
from manualdp.runners import explain
from manualdp.runners.explain import MAX_DEVICES, main, max_sent
from manualdp.schedule import ALGORITHMS, get_schedule
from manualdp.spmd.auto.tune import Link, predict

CLOSED = [a for a in ALGORITHMS if a != "halving_doubling"]


@pytest.mark.parametrize("algorithm", CLOSED)
def test_the_closed_form_is_the_schedules_most_bytes_sent(algorithm):
    for n in range(1, 34):
        for nbytes, element_size in ((1 << 20, 4), (100, 4), (4, 4), (0, 4), (1001, 1), (36, 4), (4 * n - 4, 4)):
            sent = traffic(get_schedule(algorithm, n), nbytes, element_size)["sent"]
            assert max_sent(algorithm, n, nbytes, element_size) == max(sent), (n, nbytes, element_size)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_time_from_the_loads_is_the_schedules(algorithm):
    link = Link(5e-6, 1 / 20e9, 1 / 200e9)
    for n in (2, 5, 17, 40):
        assert predict(algorithm, n, 4000, link, 4, None) == pytest.approx(
            cost(get_schedule(algorithm, n), 4000, link.alpha, link.beta, link.gamma, 4), rel=1e-12)


def test_a_trillion_devices_are_explained_without_a_schedule(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a schedule was built")
    monkeypatch.setattr(explain, "get_schedule", refuse)
    monkeypatch.setattr(explain, "get_collective", refuse)
    assert main(["diloco", "--devices", str(10 ** 12), "--sync-every", "100"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith(("ddp", "local", "diloco"))}
    S = 1 << 20  # fewer elements than devices: every device sends its one-element chunks, twice
    assert float(rows["ddp"][-4]) == 2 * S and float(rows["diloco"][-4]) == round(2 * S / 100, 1)
    assert main(["diloco", "--devices", str(10 ** 12), "--schedule", "tree"]) == 0
    assert f"{40 * S:.1f}" in capsys.readouterr().out  # ceil(log2 1e12) = 40 levels


@pytest.mark.parametrize("argv, words", [
    (["diloco", "--devices", str(10 ** 12), "--size", str(10 ** 400)], ["overflow", "--devices 1000000000000"]),
    (["diloco", "--devices", str(10 ** 300), "--size", "4" + "0" * 20, "--schedule", "naive"], ["overflow"]),
    (["diloco", "--devices", str(MAX_DEVICES + 1), "--schedule", "halving_doubling"],
     ["halving_doubling", f"at most {MAX_DEVICES}", f"got {MAX_DEVICES + 1}"]),
])
def test_what_cannot_be_worked_out_is_refused_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "Traceback" not in err
    assert all(w in err.splitlines()[-1] for w in words), err
