"""Bytes per step of DDP, local SGD and DiLoCo in the cost model, and `manualdp explain diloco`.

The bytes the replicas' allreduces really send are measured against `bytes_per_step` in
test_ft_local_sgd.py and test_ft_stop.py (replica processes, soak: bench/soak_tests.sh).
"""
import pytest

from manualdp.cost import bytes_per_step, traffic
from manualdp.runners.explain import explain_sync, main
from manualdp.schedule import get_schedule


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("h", [1, 5, 100])
def test_local_sgd_and_diloco_send_one_hth_of_ddps_bytes_per_step(n, h):
    S = 4 * 420  # whole chunks for every n here
    ddp = bytes_per_step("ddp", S, n)
    assert ddp == [2 * (n - 1) / n * S] * n  # ring: the textbook's, from the schedule
    for method in ("local_sgd", "diloco"):
        assert bytes_per_step(method, S, n, h) == [x / h for x in ddp]
    naive = traffic(get_schedule("naive", n), S, 4)["sent"]
    assert bytes_per_step("diloco", S, n, h, "naive") == [x / h for x in naive]


@pytest.mark.parametrize("args, match", [
    (("sgd", 8, 2), "method"), (("ddp", 8, 0), "num_devices"), (("diloco", 8, 2, 0), "sync_every"),
    (("ddp", 8, 2, 4), "sync_every must be 1 for ddp"), (("diloco", 8, 2, 2, "bogus"), "bogus"),
])
def test_bytes_per_step_refuses_bad_input_naming_it(args, match):
    with pytest.raises(ValueError, match=match):
        bytes_per_step(*args)


def test_explain_diloco_prints_the_three_side_by_side(capsys):
    assert main(["diloco", "--devices", "4", "--size", "4000", "--sync-every", "10"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip().startswith(("ddp", "local"))}
    assert float(rows["ddp"][-4]) == 6000.0 and float(rows["local_sgd"][-4]) == 600.0  # max sent per device
    assert rows["local_sgd"][-1] == "1/10"
    diloco = next(line for line in explain_sync(4, 4000, 10).splitlines() if line.strip().startswith("diloco"))
    assert diloco.split()[-1] == "1/10" and float(diloco.split()[-4]) == 600.0


@pytest.mark.parametrize("argv, words", [
    (["diloco", "--sync-every", "0"], ["--sync-every", "'0'"]),
    (["local_sgd", "--duplex", "1"], ["--duplex"]),
    (["ring", "--sync-every", "3"], ["--sync-every", "local_sgd"]),
])
def test_explain_diloco_refuses_what_does_not_fit_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and all(w in last for w in words), last
