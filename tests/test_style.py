"""The line length that pyproject.toml configures ([tool.ruff] line-length), held in every Python file."""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent
while not (ROOT / "pyproject.toml").is_file():
    ROOT = ROOT.parent
FOLDERS = ("manualdp", "bench", "tests", "book")
NOT_YET: tuple[str, ...] = ()  # folders not yet held to the limit: none (tests/ was rewrapped in issue 41)


def line_length() -> int:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["ruff"]["line-length"]


def python_files(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_line_is_longer_than_the_configured_length():
    limit = line_length()
    long = []
    for folder in FOLDERS:
        if folder in NOT_YET:
            continue
        for path in python_files(folder):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if len(line) > limit:
                    long.append(f"{path.relative_to(ROOT)}:{number} ({len(line)})")
    assert not long, f"{len(long)} line(s) longer than {limit} characters:\n" + "\n".join(long)


def test_the_walk_finds_python_files_in_every_folder():
    assert 80 <= line_length() <= 200
    for folder in FOLDERS:
        assert python_files(folder), f"no .py file found under {folder}/"
