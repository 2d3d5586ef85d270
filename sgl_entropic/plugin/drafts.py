"""Where a decode step's drafts come from: SGLang's n-gram trie (`speculative/cpp_ngram/ngram_corpus.py`), either
one per request or SGLang's own, shared by the server (`speculative.drafts`).

- ``request`` (the default): each request drafts from its own trie, over its prompt (inserted whole at its first
  decode step: earlier turns, documents and tool output in the prompt are what agents quote) and its output (each
  step's last `max_trie_depth` tokens, as SGLang feeds its trie, inserted after the step's drafts are read, so that
  the insert runs beside the forward). Its drafts, hence the widths the rule picks and
  the forwards its steps run, depend on the request alone: served alone, it gets the same output on every run and
  after a restart, in bf16 too.
- ``server``: SGLang's trie, fed with every request's recent tokens and never with a prompt. A request drafts from
  what the server served before it, so in bf16 (where a verify forward's rounding follows its shape) its output
  can change with the server's history.
Both return SGLang's layout: [bs, W] tokens (node 0 each row's last token) and [bs, W, W] tree masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# A request's trie holds this many n-gram nodes at most (about 60 MB); past it SGLang's trie drops the least
# recently matched ones.
MAX_NODES = 1 << 18


@dataclass
class RequestTries:
    """The running requests' own tries, by request id; a request's goes when it leaves the decode batch."""

    tries: dict = field(default_factory=dict)

    def drafts(self, worker, batch) -> tuple[np.ndarray, np.ndarray]:
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

        args, depth, width = worker.server_args, worker.max_trie_depth, worker.speculative_num_draft_tokens
        contexts = contexts_of(worker, batch)
        current = {req.rid for req in batch.reqs}
        for rid in self.tries.keys() - current:
            del self.tries[rid]
        drafts, masks = [], []
        for req, tokens in zip(batch.reqs, contexts):
            trie = self.tries.get(req.rid)
            if trie is None:
                trie = self.tries[req.rid] = NgramCorpus(
                    max_trie_depth=depth, min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
                    max_bfs_breadth=args.speculative_ngram_max_bfs_breadth, draft_token_num=width,
                    match_type=args.speculative_ngram_match_type,
                    capacity=min(MAX_NODES, depth * (len(tokens) + 1024)))
                trie.batch_put([tokens])
                fed = True
            else:
                fed = False
            trie.synchronize()  # the trie as of every insert before: the same drafts on every run
            d, m = trie.batch_get([req.rid], [tokens[-depth:]], [len(tokens)])
            if not fed:  # this step's tail, inserted by SGLang's insert thread while the step runs
                trie.batch_put([tokens[-depth:]])
            drafts.append(d)
            masks.append(m)
        return np.stack(drafts).reshape(len(contexts), width), np.stack(masks).reshape(len(contexts), width, width)


def contexts_of(worker, batch) -> list[list[int]]:
    """Each row's tokens so far, prompt and output; under SGLang's overlap scheduler the last step's accepted tokens
    are not in output_ids yet and come from the draft input, as in `NGRAMWorker._prepare_draft_tokens`."""
    tokens = [list(r.origin_input_ids_unpadded) + list(r.output_ids) for r in batch.reqs]
    if worker.enable_overlap and not batch.grammar_needs_sync():
        info, stride = batch.spec_info, worker.speculative_num_draft_tokens
        ids, lens = info.accept_tokens.cpu().tolist(), info.accept_lens.cpu().tolist()
        tokens = [t + ids[i * stride: i * stride + lens[i]] for i, t in enumerate(tokens)]
    return tokens
