"""Runners: the full training loops, the command line, `explain` and the grader (`grader/`); they may use any layer."""
