"""KVCACHED_MAX_CACHED_TOKENS -> the blocks vLLM's prefix cache may keep (issue 35, item 5).

A positive bound below one block used to give 0 blocks, which is what 0 ("no prefix
cache") gives: the whole prefix cache went without a word. It is one block now, with a
warning saying so. No vLLM needed: the rule lives in the integration's settings.
"""

from __future__ import annotations

import logging

import pytest

from kvcached.integration.vllm import settings


@pytest.mark.parametrize("tokens,blocks", [("-1", -1), ("-500", -1), ("0", 0), ("1", 1), ("15", 1), ("16", 1),
                                           ("40", 2), ("16000", 1000)])
def test_tokens_to_blocks(monkeypatch: pytest.MonkeyPatch, tokens: str, blocks: int) -> None:
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", tokens)
    assert settings.max_cached_blocks(16) == blocks


def test_a_bound_below_one_block_says_it_keeps_one(monkeypatch: pytest.MonkeyPatch) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    settings.logger.addHandler(handler)
    try:
        monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "8")
        assert settings.max_cached_blocks(16) == 1
        monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "32")
        assert settings.max_cached_blocks(16) == 2
    finally:
        settings.logger.removeHandler(handler)
    assert len(records) == 1 and "KVCACHED_MAX_CACHED_TOKENS=8" in records[0].getMessage()
