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
from typing import Callable, Optional

import numpy as np
import torch

from sgl_entropic.drafting import DraftHits, offered_drafts

# A request's trie holds this many n-gram nodes at most (about 60 MB); past it SGLang's trie drops the least
# recently matched ones.
MAX_NODES = 1 << 18


def directly(fn: Callable, *args):
    """SGLang's code run as is (the server passes its timer instead: `HookTimes.sglang_named`)."""
    return fn(*args)


class RowTrie:
    """One request's trie, SGLang's `NgramCorpus`, called through the calls of its C++ object with buffers kept for the
    request's life: SGLang's Python wrapper builds six tensors a call, most of a row's cost a step. The C++ copies
    what it reads before returning (`ngram_corpus_ffi.cpp`), so the buffers are reused at once."""

    def __init__(self, corpus, depth: int, width: int, call: Callable = directly):
        self.corpus, self.obj, self.call = corpus, corpus._obj, call  # call: how SGLang's code is run (timed)
        self.tail = np.zeros(depth, dtype=np.int32)
        self.offsets = np.zeros(2, dtype=np.int64)  # the tail is tail[:offsets[1]]
        self.length = np.zeros(1, dtype=np.int64)
        self.state = torch.zeros(1, dtype=torch.int64)  # one request, one match state: the id 0
        self.tokens = torch.zeros(width, dtype=torch.int32)
        self.mask = torch.zeros(width * width, dtype=torch.uint8)
        self._tail, self._offsets, self._length = (torch.from_numpy(a) for a in (self.tail, self.offsets, self.length))

    def match(self, tail: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        """The drafts after `tail` (the context's last tokens; `length` all of it), as `NgramCorpus.batch_get`
        returns them for one row: [W] tokens, [W * W] mask, int64. The trie is read as of every insert before it
        (`synchronize`): the same drafts on every run."""
        n = len(tail)
        self.tail[:n] = tail
        self.offsets[1], self.length[0] = n, length
        self.call(self.obj.synchronize)
        self.call(
            self.obj.batch_match_stateful, self.state, self._tail, self._offsets, self._length, self.tokens, self.mask
        )
        return self.tokens.numpy().astype(np.int64), self.mask.numpy().astype(np.int64)

    def insert(self) -> None:
        """The tail last matched, inserted by the trie's own thread (`NgramCorpus.batch_put`)."""
        self.call(self.obj.async_insert, self._tail, self._offsets)


@dataclass
class RequestTries:
    """The running requests' own tries, by request id; a request's goes when it leaves the decode batch.

    With external corpora loaded (SGLang's `--speculative-ngram-external-corpus-path`, `/add_external_corpus`) and
    `--speculative-ngram-external-sam-budget` > 0, a row also matches them (SGLang's corpus object, whose own trie
    is never fed in this mode: `around_update_ngram_corpus`). It drafts from its own trie unless that offers nothing
    or the corpus has guessed its next token more often: every step both sources' first drafts are checked against
    the token it commits (`observe`, free, as the rule's shadow trials), each in its own `DraftHits`. What a request
    drafts then depends on it and on the corpora the operator loaded, never on other requests.
    """

    tries: dict = field(default_factory=dict)
    hits: dict = field(default_factory=dict)  # rid -> (its trie's, the corpus's) first-draft record
    call: Callable = directly  # how SGLang's n-gram code is run (the server times it as SGLang's)

    def drafts(
        self, worker, batch, skip: frozenset = frozenset()
    ) -> tuple[np.ndarray, np.ndarray, list[bool], Optional[list]]:
        """[bs, W] tokens, [bs, W, W] masks, whether each row's drafts came from a corpus, and with a corpus each
        row's first draft from each source (-1: none; for `observe`); rows in `skip` (opted out) get a tree of
        their root alone and keep no trie."""
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

        call = self.call

        args, depth, width = worker.server_args, worker.max_trie_depth, worker.speculative_num_draft_tokens
        current = {req.rid for req in batch.reqs}
        departed = self.tries.keys() - current
        for rid in departed:
            del self.tries[rid]
            self.hits.pop(rid, None)
        new = {i for i, req in enumerate(batch.reqs) if i not in skip and req.rid not in self.tries}
        contexts = contexts_of(worker, batch, depth, new)
        corpus = (
            worker.ngram_corpus
            if args.speculative_ngram_external_sam_budget > 0 and worker.list_external_corpora()
            else None
        )
        if departed:
            worker.ngram_corpus.erase_match_state(list(departed))
        drafts, masks, from_corpus, firsts = [], [], [], []
        for i, (req, ctx) in enumerate(zip(batch.reqs, contexts)):
            if i in skip:
                d, m = root_only(ctx.tail[-1], width)
                drafts.append(d)
                masks.append(m)
                from_corpus.append(False)
                firsts.append((-1, -1))
                continue
            if i in new:
                corpus_of_row = call(
                    lambda: NgramCorpus(
                        max_trie_depth=depth,
                        min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
                        max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
                        draft_token_num=width,
                        match_type=args.speculative_ngram_match_type,
                        capacity=min(MAX_NODES, depth * (ctx.length + 1024)),
                    )
                )
                call(corpus_of_row.batch_put, [ctx.full])
                trie = self.tries[req.rid] = RowTrie(corpus_of_row, depth, width, call)
            else:
                trie = self.tries[req.rid]
            d, m = trie.match(ctx.tail, ctx.length)
            if i not in new:  # this step's tail, inserted by SGLang's insert thread while the step runs
                trie.insert()
            used = False
            if corpus is not None:
                cd, cm = call(corpus.batch_get, [req.rid], [ctx.tail], [ctx.length])
                own, other = offers_of(d, m, width), offers_of(cd, cm, width)
                mine, its = self.hits.setdefault(req.rid, (DraftHits(), DraftHits()))
                firsts.append((int(d[1]) if own else -1, int(cd[1]) if other else -1))
                if prefer_corpus(own, other, mine, its):
                    d, m, used = cd, cm, True
            drafts.append(d)
            masks.append(m)
            from_corpus.append(used)
        n = len(contexts)
        return (
            np.stack(drafts).reshape(n, width),
            np.stack(masks).reshape(n, width, width),
            from_corpus,
            firsts if corpus is not None else None,
        )

    def observe(self, rids: list[str], firsts: Optional[list], roots: list[int]) -> None:
        """A step's committed first tokens against each source's first draft (`drafts`)."""
        for rid, pair, root in zip(rids, firsts or (), roots):
            record = self.hits.get(rid)
            if record is not None:
                for hits, token in zip(record, pair):
                    if token >= 0:
                        hits.observe(1, int(token == root))


def prefer_corpus(own: int, other: int, mine: DraftHits, its: DraftHits) -> bool:
    """Draft from the corpus (`other` drafts offered, its first-draft record `its`) rather than the request's own
    trie (`own`, `mine`): where the trie offers nothing, or the corpus has been right more often."""
    return other > 0 and (own == 0 or its.rate() > mine.rate())


def offers_of(tokens: np.ndarray, mask: np.ndarray, width: int) -> int:
    return int(offered_drafts(tokens.reshape(1, width), mask.reshape(1, width, width))[0])


def root_only(token: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A tree that offers no draft, in the corpus's padded layout (`offered_drafts`; the mask flat, as it returns
    it)."""
    tokens = np.zeros(width, dtype=np.int64)
    tokens[0] = token
    mask = np.eye(width, dtype=np.int64)
    mask[:, 0] = 1
    return tokens, mask.reshape(-1)


@dataclass
class Context:
    """A row's tokens so far as its trie needs them: the last `depth` (what a match reads and each step inserts), the
    length, and all of them where a new trie takes the whole prompt (building the full list every step cost tens of
    microseconds a row at a few thousand tokens)."""

    tail: list[int]
    length: int
    full: Optional[list[int]] = None


def contexts_of(worker, batch, depth: int, whole: set) -> list[Context]:
    """Each row's context, prompt and output (all of it for the rows in `whole`); under SGLang's overlap scheduler
    the last step's accepted tokens are not in output_ids yet and come from the draft input, as in
    `NGRAMWorker._prepare_draft_tokens`."""
    extra = [[] for _ in batch.reqs]
    if worker.enable_overlap and not batch.grammar_needs_sync():
        info, stride = batch.spec_info, worker.speculative_num_draft_tokens
        ids, lens = info.accept_tokens.cpu().tolist(), info.accept_lens.cpu().tolist()
        extra = [ids[i * stride : i * stride + lens[i]] for i in range(len(batch.reqs))]
    out = []
    for i, (r, more) in enumerate(zip(batch.reqs, extra)):
        prompt, output = r.origin_input_ids_unpadded, r.output_ids
        length = len(prompt) + len(output) + len(more)
        if i in whole:
            full = list(prompt) + list(output) + more
            out.append(Context(full[-depth:], length, full))
            continue
        tail = list(output[-depth:]) + more
        if len(tail) < depth:
            tail = list(prompt[len(tail) - depth :]) + tail
        out.append(Context(tail[-depth:], length))
    return out
