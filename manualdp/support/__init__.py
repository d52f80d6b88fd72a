"""Utilities: files, checkpoints, history, data, models, plots.

Leaf modules: they import neither the book nor the engine.
"""
