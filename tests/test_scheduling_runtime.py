"""The macro loop on the real server (mode full): a mixed burst all completes with valid output."""

import concurrent.futures as cf

import pytest

pytestmark = pytest.mark.server


def test_mixed_burst_completes(server):
    filler = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    jobs = []
    for i in range(12):
        prompt = (filler if i % 3 == 0 else "") + f"\nQuestion {i}: name a planet."
        params = {"max_new_tokens": 12, "ignore_eos": True}
        if i % 2:
            params["custom_params"] = {"entropic": {"target_entropy": 0.5 + i / 4}}
        elif i % 4 == 0:
            params["temperature"] = 0
        jobs.append({"text": prompt, "sampling_params": params, "return_entropy": True})
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(server.generate, jobs))
    for out in outs:
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 12 and len(meta["entropy"]) == 12
        assert meta["finish_reason"]["type"] == "length"
    assert server.get("/health").status_code == 200
