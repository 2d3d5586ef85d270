"""SGLang's NGRAM speculative decoding under the loops: each step planned (`worker.py`), verified losslessly
(`verification.py`), drafts from each request's own trie or a corpus (`drafts.py`), widths priced by a cost
table kept per machine (`step_costs.py`)."""

from __future__ import annotations

from sgl_entropic.config import EntropicConfig
from sgl_entropic.plugin.hooks import Hook


def hooks(config: EntropicConfig) -> list[Hook]:
    if not config.speculative_on:
        return []
    from sgl_entropic.plugin.speculation import verification, worker

    S, W = "sglang.srt.", "sglang.srt.speculative.ngram_worker.NGRAMWorker."
    # fmt: off
    return [
        Hook(W + "alloc_memory_pool", "after", worker.after_alloc_memory_pool, "scheduler"),
        Hook(W + "_prepare_for_speculative_decoding", "around", worker.around_prepare_for_speculative_decoding,
             "scheduler"),
        Hook(W + "forward_batch_generation", "around", worker.around_forward_batch_generation, "scheduler"),
        Hook(W + "_update_ngram_corpus", "around", worker.around_update_ngram_corpus, "scheduler"),
        Hook(S + "speculative.eagle_utils.eagle_sample", "around", verification.around_eagle_sample, "scheduler"),
        # SGLang's draft-slot allocation picks a Triton kernel unless the backend is named torch_native
        Hook(S + "mem_cache.allocation.get_last_loc", "around", worker.around_get_last_loc, "scheduler"),
    ]
    # fmt: on
