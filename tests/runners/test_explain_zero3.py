"""`manualdp explain zero3`: the printed step is the step Zero3 ran, its bytes are its schedules', and it is drawn."""
import re

import pytest

from manualdp.cost import traffic
from manualdp.runners.explain import main
from manualdp.runners.explain_zero3 import demo_step, explain_zero3, plot_zero3
from manualdp.schedule import get_collective

ROW = re.compile(r"^  (\d+)\s+(all-gather|reduce-scatter)\s+(\w+)\s+(\S+)\s+(\d+)\s+([\d-]+)\s+([\d-]+)  ([\d ]+)$")


def _span(values):
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


@pytest.mark.parametrize("n", [2, 3])
def test_explain_zero3_prints_every_collective_of_the_step_with_its_bytes(n):
    text = explain_zero3(n)
    steps = demo_step(n).collectives
    rows = [m for line in text.splitlines() if (m := ROW.match(line))]
    # 3 units: 3 + 2 all-gathers (the first layer's backward needs none), 3 reduce-scatters
    assert len(rows) == len(steps) == 8
    for row, c in zip(rows, steps):
        t = traffic(get_collective(c.kind, "ring", n), c.numel * 4, 4)
        assert (row[2].replace("-", "_"), row[3], row[4]) == (c.kind, c.phase, c.unit)
        assert (int(row[5]), row[6], row[7]) == (c.numel * 4, _span(t["sent"]), _span(t["received"]))
        assert [int(x) for x in row[8].split()] == list(c.held)
    model = 4 * sum(c.numel for c in steps if c.phase == "forward")
    assert f"3(n-1)/n * {model} = {3 * (n - 1) * model / n:.0f}" in text
    assert f"2(n-1)/n * {model} = {2 * (n - 1) * model / n:.0f}" in text
    assert "unit 0's backward all-gather" in text


def test_the_picture_of_a_step_has_a_bar_per_collective_and_a_line_per_device(tmp_path):
    path = tmp_path / "zero3.png"
    fig = plot_zero3(3, str(path))
    wire, memory = fig.axes
    assert len(wire.patches) == len(demo_step(3).collectives)
    assert len(memory.lines) == 3 + 2  # each device's bytes, the whole model, 1/n of it
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["zero3", "--devices", "2", "--plot", "x.jpg"], "must end in .png"),
    (["zero3", "--alpha", "1e-6"], "--alpha"),
    (["zero3", "--devices", "0"], "num_devices"),
])
def test_main_zero3_refuses_bad_arguments_and_writes_nothing(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_main_zero3_prints_and_draws(capsys, tmp_path):
    assert main(["zero3", "--devices", "2", "--plot", str(tmp_path / "z.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ZeRO-3 on 2 devices") and out.rstrip().endswith(f"wrote {tmp_path / 'z.png'}")
    assert (tmp_path / "z.png").stat().st_size > 0
