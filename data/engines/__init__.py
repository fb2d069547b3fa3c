"""Inference engines draftsmith drives as separate processes (llama.cpp's `llama-server`): for
serving and benchmarking drafts where users run them, and for fast data generation."""
