"""The one-pass Triton token-stats kernel equals sgl_entropic.signal.token_stats_reference.

On CPU the kernel runs under the Triton interpreter. TRITON_INTERPRET=1 must be set before
triton is imported, and this pytest process may already have imported it, so the CPU test
runs this file as a script in a fresh interpreter process.
"""

import os
import subprocess
import sys

import pytest
import torch

from sgl_entropic.signal import TokenStats, token_stats, token_stats_reference
from tests.logit_cases import NEG_INF, edge_case_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_matches_reference(logits, tokens, inv_temperature, **kernel_options):
    from sgl_entropic.kernels.entropy import token_stats_triton

    got = TokenStats(*token_stats_triton(logits, tokens, inv_temperature, **kernel_options))
    want = token_stats_reference(logits, tokens, inv_temperature, dtype=torch.float64)
    assert torch.equal(got.valid, want.valid)
    for name in ("entropy", "surprisal", "lse"):
        torch.testing.assert_close(
            getattr(got, name),
            getattr(want, name),
            atol=1e-4,
            rtol=1e-5,
            msg=lambda message: f"{name}: {message}",
        )
    return got


def check_under_interpreter() -> None:
    for vocab in (1000, 3001):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            logits, tokens, inv_temperature, valid = edge_case_batch(vocab, dtype)
            # 256 splits the row into several chunks, the last one partial; None is the default.
            for block_v in (256, None):
                got = assert_matches_reference(logits, tokens, inv_temperature, block_v=block_v)
                assert got.valid.tolist() == valid
            # Default temperature, and a strided (non-contiguous) batch view.
            assert_matches_reference(logits[::2], tokens[::2], None, block_v=256)


def test_kernel_matches_reference_under_triton_interpreter():
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }  # the script imports tests.logit_cases
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [49152, 152064])
@pytest.mark.parametrize("batch", [1, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference_on_gpu(vocab, batch, dtype):
    generator = torch.Generator(device="cuda").manual_seed(batch)
    logits = torch.randn(batch, vocab, device="cuda", generator=generator) * 4.0
    logits[:, ::11] = NEG_INF
    tokens = logits.argmax(dim=-1)
    inv_temperature = 0.5 + torch.rand(batch, device="cuda", generator=generator)
    if batch > 1:
        logits[1, 7] = float("nan")
    logits = logits.to(dtype)
    got = assert_matches_reference(logits, tokens, inv_temperature)
    assert got.valid.sum().item() == batch - (batch > 1)
    # The public entry point dispatches to the kernel on CUDA.
    assert torch.equal(token_stats(logits, tokens, inv_temperature).entropy, got.entropy)

    edge_logits, edge_tokens, edge_inv_temperature, valid = edge_case_batch(vocab, dtype, "cuda")
    edge = assert_matches_reference(edge_logits, edge_tokens, edge_inv_temperature)
    assert edge.valid.tolist() == valid


def time_kernel(batch: int, vocab: int, reps: int = 50) -> tuple[float, float, float]:
    """(kernel ms, torch reference ms, GB/s of logits read by the kernel) on CUDA, bf16 logits."""
    import time

    from sgl_entropic.kernels.entropy import token_stats_triton

    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16) * 4.0
    tokens = logits.argmax(dim=-1)
    inv_t = torch.full((batch,), 1.0 / 0.7, device="cuda")
    times = []
    for fn in (token_stats_triton, token_stats_reference):
        for _ in range(3):
            fn(logits, tokens, inv_t)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(logits, tokens, inv_t)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return times[0], times[1], logits.numel() * 2 / (times[0] / 1e3) / 1e9


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--time":
        for batch, vocab in ((1, 49152), (64, 152064), (256, 152064)):
            ms, ref_ms, gbs = time_kernel(batch, vocab)
            print(
                f"token_stats B={batch} V={vocab} bf16: {ms:.3f} ms ({ref_ms / ms:.1f}x the torch reference), "
                f"{gbs:.0f} GB/s of logits"
            )
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run through the pytest test above"
        check_under_interpreter()
