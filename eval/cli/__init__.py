"""The command lines: `draftsmith-train` (eval.cli.train) and `draftsmith-evaluate`
(eval.cli.evaluate), which the root train.py and evaluate.py also run.

They sit in eval because they stand on top of every step: training ends with an export
(eval.publish), which train/ may not import. Nothing in the packages imports them.
"""
