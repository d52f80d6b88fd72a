"""The grader: `manualdp check EXERCISE FILE.py` holds a student's answer to the properties that hold manualdp's own.

Its files, in the order a reader meets them:

- `check.py`: the command; loads the file in a sandboxed child, draws the inputs with hypothesis, prints PASS or
  FAIL in one paragraph;
- `properties/`: what a right answer does, one file per exercise in the book's order (`split_batch.py` to
  `diloco.py`), each with what hypothesis draws for it, and what they share in `common.py`; the same properties hold
  manualdp's own code in tests/;
- `sandbox.py`: the child process the file runs in, which cannot hang, fool or outlive the grader (`Child`);
- `processes.py`: the operating system's side of the sandbox: user, mount and pid namespaces, the grader not
  dumpable, the child's session found and killed, its folder removed, the bytes it wrote counted;
- `walls.py`: the child's walls on disk: a read-only mount namespace, Landlock, an audit hook that names what it
  refused; what it may read and write; `tried.py`: the path outside that an answer's error says the kernel refused;
- `intact.py`: what a file patched in a rank of the grader's (its functions, torch's, manualdp's), found after the
  run;
- `own.py`: the library's own function an exercise asks for, made to raise "write it yourself" while the file runs;
- `sandbox_child.py`: that child's side: loads the file, calls its functions, starts the ranks of the ddp and hook
  checks;
- `jobs.py`: what the child runs with the file's functions (the checkpoint exercise's run).
"""
