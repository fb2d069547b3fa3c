"""Inference engines draftsmith drives as separate processes (llama.cpp's `llama-server`, vLLM's
`vllm serve`, both a server.py `ServerProcess`): for serving and benchmarking drafts where users
run them, and for fast data generation."""
