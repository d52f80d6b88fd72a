"""The grader: `manualdp check EXERCISE FILE.py` holds a student's answer to the properties that hold manualdp's own.

Its files, in the order a reader meets them:

- `check.py`: the command; loads the file in a sandboxed child, draws the inputs with hypothesis, prints PASS or
  FAIL in one paragraph;
- `properties.py`: what a right answer does, per exercise (the same properties hold manualdp's own code in tests/);
- `check_ft.py`: chapter 8's exercise, DiLoCo's outer step: the formula, its property and what hypothesis draws;
- `sandbox.py`: the child process the file runs in, which cannot hang, fool or outlive the grader (`Child`);
- `sandbox_child.py`: that child's side: loads the file, calls its functions, starts the ranks of the ddp and hook
  checks;
- `jobs.py`: what the child runs with the file's functions (the checkpoint exercise's run).
"""
