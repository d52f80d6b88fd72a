"""Runners: the full training loops, the command line and `explain`. They may use every layer."""
