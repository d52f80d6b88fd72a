"""`manualdp explain`: the printed schedule is the schedule, and the printed bytes and time are its accounting."""
import re
from collections import Counter

import pytest

from manualdp.runners.explain import DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_GAMMA, _us, explain, explain_auto, main
from manualdp.cost import cost, traffic
from manualdp.schedule import ALGORITHMS, chunk_sizes, get_collective, get_schedule
from manualdp.spmd.auto.tune import Link, predict

ROUND = re.compile(r"^round (\d+) \((.+)\): (\d+) transfers, estimated ([\d.]+) us$")
TRANSFER = re.compile(r"^  dev(\d+) -> dev(\d+)  chunk (\d+)  (add|copy)  \((\d+) bytes\)$")
BYTES = re.compile(r"^  dev(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$")
STATE = re.compile(r"^    dev(\d+)  (.*)$")


def parse(text):
    rounds, table, states = [], {}, []
    for line in text.splitlines():
        if m := ROUND.match(line):
            rounds.append({"number": int(m[1]), "phase": m[2], "count": int(m[3]), "us": float(m[4]), "transfers": []})
        elif m := TRANSFER.match(line):
            rounds[-1]["transfers"].append((int(m[1]), int(m[2]), int(m[3]), m[4] == "add", int(m[5])))
        elif m := BYTES.match(line):
            table[int(m[1])] = [int(x) for x in m.group(2, 3, 4, 5)]
        elif m := STATE.match(line):
            states.append((int(m[1]), m[2].split()))
    return rounds, table, states


@pytest.mark.parametrize("algorithm, n, size",
                         [("ring", 4, 4000), ("tree", 3, 1200), ("tree", 6, 4096), ("naive", 3, 44)])
def test_explain_prints_the_schedule_and_its_accounting(algorithm, n, size):
    schedule = get_schedule(algorithm, n)
    text = explain(algorithm, n, size_bytes=size)
    rounds, table, states = parse(text)

    assert [r["number"] for r in rounds] == list(range(1, len(schedule.rounds) + 1))
    assert [r["phase"] for r in rounds] == list(schedule.phases)
    sizes = [s * 4 for s in chunk_sizes(size // 4, schedule.num_chunks)]
    for printed, rnd in zip(rounds, schedule.rounds):
        assert printed["count"] == len(rnd)
        assert Counter(printed["transfers"]) == Counter((t.src, t.dst, t.chunk, t.reduce, sizes[t.chunk]) for t in rnd)
        one = type(schedule)(algorithm, n, schedule.num_chunks, (rnd,), ("",))
        assert printed["us"] == pytest.approx(cost(one, size, DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_GAMMA, 4) * 1e6,
                                              abs=0.05)

    t = traffic(schedule, size, 4)
    assert table == {d: [t["sent"][d], t["received"][d], t["reduced"][d], t["messages"][d]] for d in range(n)}
    total = float(re.search(r"^estimated time: ([\d.]+) us$", text, re.M)[1])
    assert total == pytest.approx(cost(schedule, size, DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_GAMMA, 4) * 1e6, abs=0.05)

    # One table at the start and one after each round; the last shows the result everywhere.
    assert len(states) == n * (len(schedule.rounds) + 1)
    assert states[:n] == [(d, [f"{'abcdefgh'[d]}{c}" for c in range(schedule.num_chunks)]) for d in range(n)]
    assert states[-n:] == [(d, [f"sum{c}" for c in range(schedule.num_chunks)]) for d in range(n)]


def test_ring_state_shows_partial_sums():
    text = explain("ring", 3, 12)
    # After round 1 device 1 holds chunk 0 of a plus its own, as the ring passes chunk i-s to i+1.
    after_round_1 = text.split("round 2")[0].split("afterwards:")[1]
    assert re.search(r"dev1\s+a0\+b0\s", after_round_1)


def test_main_prints_what_explain_returns(capsys):
    assert main(["tree", "--devices", "5", "--size", "4000", "--no-state"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == explain("tree", 5, size_bytes=4000, show_state=False)
    assert "afterwards" not in out


@pytest.mark.parametrize("argv, message", [
    (["butterfly"], "invalid choice"),
    (["ring", "--devices", "0"], "num_devices"),
    (["ring", "--size", "7"], "size_bytes"),
    (["ring", "--alpha", "-1"], "alpha"),
])
def test_main_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr()
    assert message in err.err and err.out == ""


@pytest.mark.parametrize("kwargs, match", [
    ({"algorithm": "butterfly", "num_devices": 4}, "algorithm"),
    ({"algorithm": "ring", "num_devices": 2.5}, "num_devices"),
    ({"algorithm": "ring", "num_devices": 4, "size_bytes": -4}, "size_bytes"),
    ({"algorithm": "ring", "num_devices": 4, "element_size": 0}, "element_size"),
    ({"algorithm": "ring", "num_devices": 4, "gamma": float("nan")}, "gamma"),
])
def test_explain_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        explain(**kwargs)


@pytest.mark.parametrize("algorithm, n", [("ring", 4), ("tree", 5), ("reduce_scatter", 3), ("broadcast", 6)])
def test_plot_draws_one_panel_per_round_and_one_arrow_per_transfer(tmp_path, algorithm, n):
    from matplotlib.text import Annotation

    from manualdp.runners.explain import NAMES, plot
    schedule = get_collective(*NAMES[algorithm], n)
    path = tmp_path / "rounds.png"
    fig = plot(algorithm, n, str(path))
    axes = fig.get_axes()
    assert len(axes) == len(schedule.rounds) + 1
    arrows = [sum(isinstance(c, Annotation) for c in ax.get_children()) for ax in axes]
    assert arrows == [0] + [len(r) for r in schedule.rounds]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_refuses_a_path_that_is_not_png_and_writes_nothing(tmp_path):
    with pytest.raises(SystemExit):
        main(["ring", "--devices", "2", "--plot", str(tmp_path / "x.jpg")])
    assert list(tmp_path.iterdir()) == []


def test_explain_auto_shows_every_prediction_and_the_pick(capsys, monkeypatch, tmp_path):
    from manualdp.schedule import ALGORITHMS
    from manualdp.spmd.auto.tune import Link, choose, predict

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MANUALDP_LINK", raising=False)
    size = 1 << 20
    for duplex in ("0", "1"):
        assert main(["auto", "--devices", "2", "--size", str(size), "--alpha", "1e-4", "--beta", "4e-10",
                     "--gamma", "0", "--duplex", duplex]) == 0
        out = capsys.readouterr().out
        link = Link(1e-4, 4e-10, 0.0, float(duplex))
        pick = choose(2, size, link)
        assert f"pick: {pick};" in out
        for a in ALGORITHMS:
            line = next(x for x in out.splitlines() if x.strip().startswith(a + " "))
            assert f"{predict(a, 2, size, link) * 1e6:.1f} us" in line
            assert ("<- pick" in line) == (a == pick)
        # Full duplex: an exchange costs one message, and recursive doubling's one exchange wins. Directions in
        # turn: it costs naive's two messages, and the tie goes to naive (first in ALGORITHMS' order).
        assert pick == ("recursive_doubling" if duplex == "0" else "naive")


def test_explain_auto_with_ranks_sharing_cores_prefers_the_schedules_where_most_ranks_wait(capsys, monkeypatch):
    from manualdp.spmd.auto.tune import Link, choose

    monkeypatch.delenv("MANUALDP_LINK", raising=False)
    size = 1 << 20
    common = ["auto", "--devices", "4", "--size", str(size), "--alpha", "1e-4", "--beta", "5e-10", "--gamma", "4e-11",
              "--duplex", "1"]
    assert main(common + ["--parallel", "2"]) == 0
    out = capsys.readouterr().out
    shared = Link(1e-4, 5e-10, 4e-11, 1.0, 2)
    assert "2 ranks at once" in out and f"pick: {choose(4, size, shared)};" in out
    assert "sharing 2 cores equally" in out
    # Every rank of a ring or halving-doubling round works; in a tree round half of them wait,
    # and no rank does most of a round's work, as naive's root does.
    assert choose(4, size, shared) == "tree"
    assert main(common) == 0
    assert "ranks at once" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["ring", "--devices", "4", "--parallel", "2"])
    assert "--parallel is for explain auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ring", "--devices", "4", "--segment-bytes", "4096"])
    assert "--segment-bytes is for explain auto" in capsys.readouterr().err
    assert main(common + ["--segment-bytes", str(size)]) == 0  # one segment: additions after transfers
    assert f"pick: {choose(4, size, Link(1e-4, 5e-10, 4e-11, 1.0), segment_bytes=size)};" in capsys.readouterr().out


def test_explain_auto_reads_this_hosts_measured_constants_and_refuses_half_given_ones(capsys, monkeypatch, tmp_path):
    import json
    import time

    from manualdp.spmd.auto.tune import CALIBRATION, cache_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MANUALDP_LINK", raising=False)
    path = cache_path("gloo", 3)
    main(["auto", "--devices", "3"])
    assert "defaults: nothing measured yet" in capsys.readouterr().out
    (tmp_path / "manualdp").mkdir()
    with open(path, "w") as f:
        json.dump({"alpha": 2e-4, "beta": 1e-9, "gamma": 1e-10, "duplex": 0.5}, f)  # an older calibration's
    main(["auto", "--devices", "3"])
    assert "defaults: nothing measured yet" in capsys.readouterr().out
    with open(path, "w") as f:
        json.dump({"alpha": 2e-4, "beta": 1e-9, "gamma": 1e-10, "duplex": 0.5, "duplex_spread": 0.0,
                   "measured_at": time.time(), "calibration": CALIBRATION}, f)
    main(["auto", "--devices", "3"])
    out = capsys.readouterr().out
    assert path in out and "alpha 200.0 us" in out and "duplex 0.50" in out
    with pytest.raises(SystemExit):
        main(["auto", "--devices", "3", "--alpha", "1e-4"])
    assert "give --alpha, --beta and --gamma together" in capsys.readouterr().err


def test_explain_auto_at_100000_ranks_answers_with_every_algorithms_rounds(capsys, monkeypatch, deadline):
    from manualdp.spmd.auto.tune import Link, predict

    monkeypatch.delenv("MANUALDP_LINK", raising=False)
    with deadline(60):  # the schedules of 100,000 ranks are billions of transfers: building one must not be how
        assert main(["auto", "--devices", "100000", "--alpha", "1e-5", "--beta", "1e-9", "--gamma", "1e-10"]) == 0
    out = capsys.readouterr().out
    link = Link(1e-5, 1e-9, 1e-10)
    # naive: gather and scatter; ring: 2(n-1); tree: 2 ceil(log2 n);
    # halving-doubling: 2 log2(65536) and the fold in and out.
    for a, rounds in [("naive", 2), ("ring", 199998), ("halving_doubling", 34), ("tree", 34)]:
        line = next(x for x in out.splitlines() if x.strip().startswith(a + " "))
        assert line.split()[1] == str(rounds)
        assert f"{predict(a, 100000, 1 << 20, link) * 1e6:.1f} us" in line
        assert "same transfers" not in line


def test_plot_refuses_more_devices_than_its_tables_hold_and_writes_nothing(tmp_path, capsys):
    from manualdp.runners.explain import STATE_LIMIT

    with pytest.raises(SystemExit):
        main(["ring", "--devices", str(STATE_LIMIT + 1), "--plot", str(tmp_path / "x.png")])
    assert f"at most {STATE_LIMIT} devices, got {STATE_LIMIT + 1}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_explain_gives_recursive_doublings_textbook_bytes_as_its_schedule_counts_them(n):
    size = 1 << 20
    text = explain("recursive_doubling", n, size)
    p = 1 << (n.bit_length() - 1)
    printed = int(re.search(r"send and receive S \* log2 p = (\d+) bytes", text)[1])
    t = traffic(get_schedule("recursive_doubling", n), size)
    assert printed == t["sent"][p - 1] == t["received"][p - 1]  # a device that does not fold: S per swap
    if n > p:
        assert f"plus S = {size} for dev0..dev{n - p - 1}" in text
        assert t["sent"][0] == printed + size and t["sent"][n - 1] == size


# ---------------------------------------------------------------- planted bugs slipped past these (issue 20)

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


@pytest.mark.parametrize("algorithm", ["ring", "zero3"])
@pytest.mark.parametrize("plot, words", [
    ("", "the path is empty"),                      # was: rc 0, no picture, no word
    ("{tmp}/nonexistent/dir/r.png", "does not exist"),  # was: a traceback naming a .tmp file
    ("/sys/manualdp-r.png", "cannot write in /sys"),
    ("{tmp}/folder.png", "is a directory"),
    ("{tmp}/r.jpg", "must end in .png"),
])
def test_a_plot_that_cannot_be_written_is_one_line_before_any_work(algorithm, plot, words, tmp_path, capsys):
    (tmp_path / "folder.png").mkdir()
    plot = plot.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as info:
        main([algorithm, "--devices", "2", "--plot", plot])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"manualdp explain: error: --plot {plot!r}: ") and words in last and ".tmp" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.png"]


def test_explain_auto_refuses_a_plot_it_would_not_draw(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["auto", "--devices", "2", "--plot", str(tmp_path / "a.png")])
    assert "--plot is for the schedules and zero3" in capsys.readouterr().err and not list(tmp_path.iterdir())
