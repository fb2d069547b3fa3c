"""The benchmark: every decoding method on the same prompts, in one run, timed alike."""
