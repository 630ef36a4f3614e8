"""`pagefleet-lab kv-waste`: paged against contiguous KV reservation."""

from __future__ import annotations

from pagefleet_lab.bench.kv_waste import paged, paged_concurrency


def test_kv_waste_matches_the_seed_article() -> None:
    lengths = [45, 128, 23, 256, 67]
    slots, blocks = paged(lengths, 16)
    assert blocks == 34 and slots == 544
    assert round(100 * sum(lengths) / slots, 1) == 95.4
    assert round(100 * sum(lengths) / (512 * 5), 1) == 20.3
    assert paged_concurrency(lengths, 16, 8192) == 75
