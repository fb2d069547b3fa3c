"""Decoding with a draft, measuring it, and publishing it: three sub-packages, one job each.

- eval.engine: speculative decoding (draft trees, proposers, verifiers, KV-cache surgery, the
  decoding loop) and the acceptance length of a head on a few prompts.
- eval.bench: the benchmark (every method on the same prompts, timed alike; the report).
- eval.publish: export a draft to a serving format, prove the export, upload it.

bench and publish both build on engine and never on each other; engine imports neither
(tests/test_architecture.py).
"""
