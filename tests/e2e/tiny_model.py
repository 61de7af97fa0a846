"""Prompts for the end-to-end tests, and the tiny model they run (made offline, no downloads)."""

from __future__ import annotations

from tools.tiny_model import CORPUS, make_tiny_mamba_hybrid
from tools.tiny_model import make_tiny_llama as make_tiny_model

__all__ = ["BURST_PROMPTS", "CORPUS", "LONG_PROMPTS", "PROMPTS", "make_tiny_mamba_hybrid", "make_tiny_model"]

PROMPTS = [
    "The quick brown fox",
    "Elastic KV caches map",
    "Once upon a time",
    "Paged attention reads keys",
]

# Distinct prompts longer than one 128-token block: each leaves one full, hashed block
# for the prefix cache.
LONG_PROMPTS = [f"{i} " + " ".join(CORPUS[i % 6 + j] for j in range(6)) for i in range(8)]

# Distinct prompts (no shared prefix blocks), enough to need several 2 MiB pages at once.
BURST_PROMPTS = [f"{i} {CORPUS[i % 6]} {i * 7 % 13}" for i in range(48)]


