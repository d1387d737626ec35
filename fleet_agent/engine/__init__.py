"""Inference engines on an agent host: the trtllm-serve command line, its supervisor, a stand-in."""
