"""What a program's result must satisfy, shared by tests/test_programs.py (against a server) and tests/test_engine.py
(in-process)."""

from __future__ import annotations

import statistics

from programs import fork_join


def assert_join_chose_the_lowest_mean_surprisal(item: dict) -> None:
    candidates = item["candidates"]
    assert [c["target_entropy"] for c in candidates] == list(fork_join.TARGET_ENTROPIES)
    for cand in candidates:
        assert len(cand["entropy"]) == len(cand["surprisal"]) == cand["trace"]["tokens"] > 0
    recomputed = [statistics.fmean(x for x in c["surprisal"] if x is not None) for c in candidates]
    assert item["chosen"] == recomputed.index(min(recomputed))
