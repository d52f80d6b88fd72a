"""Runners: the full training loops, the command line, `explain`, and the grader (`grader/`). They may use every layer."""
