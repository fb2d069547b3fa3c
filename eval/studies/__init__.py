"""Studies: scripted series of training and evaluation runs, with the reports they render.

Each study drives train.py and evaluate.py as subprocesses (the same commands a user types),
keeps its points resumable, and merges results point by point so invocations may run side by
side. recipes.py: variants x training CPU budgets x seeds (docs/recipes.md).
"""
