"""What the benchmarks share: their `--json` / `--plot` outputs, checked before they run and written after."""
from __future__ import annotations

import os

__all__ = ["check_output_paths", "save_outputs"]


def check_output_paths(parser, args) -> None:
    """Refuse `--json` / `--plot` paths that could only fail after the benchmark has run."""
    for option in ("json", "plot"):
        path = getattr(args, option, None)
        if not path:
            continue
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"--{option}: the directory of {path!r} does not exist")
        if os.path.isdir(path):
            parser.error(f"--{option}: {path!r} is a directory")
        if option == "plot" and not path.lower().endswith(".png"):
            parser.error(f"--plot: {path!r} must end in .png")


def save_outputs(result: dict, json_path: str | None, plot_path: str | None, plot=None) -> None:
    """Write `result` as JSON and draw it with `plot(result, path)`, for each path given."""
    from manualdp.support.files import write_json_atomic

    if json_path:
        write_json_atomic(json_path, result)
        print(f"wrote {json_path}")
    if plot_path:
        plot(result, plot_path)
        print(f"wrote {plot_path}")
