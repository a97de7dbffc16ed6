"""Per-request state: the committed tokens of every row and which rows are still decoding."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, NamedTuple

import attrs
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WhisperTimeStampLogitsProcessor,
)


from .cache import bucket, empty_block


class Committed(NamedTuple):
    """What ``DecodeState.commit`` appended, per active row, on the host."""

    accepted: torch.Tensor  # [B] long: drafts the verifier kept
    appended: torch.Tensor  # [B] long: tokens committed (after eos and length cuts)
    finished: torch.Tensor  # [B] bool
    drafted: torch.Tensor  # [B] long
    kept: torch.Tensor  # [B] long: of the drafts read, those the caches keep (``accepted`` but for alternatives)


@attrs.define(eq=False)
class DecodeState:
    """Everything about one ``generate`` call that drafters, policies and verifiers may read.

    Rows are addressed two ways: *original* row ids (0..batch_size-1, fixed for the whole call,
    what ``rows`` holds) and *active* positions (0..len(rows)-1, the batch the models see this
    iteration). Per-row state that must survive rows leaving the batch is best kept indexed by
    original id: ``my_state[state.rows]`` is then always the active view.

    ``sequences[r, :lengths[r]]`` holds row r's prompt (left-padded exactly as given) followed by
    what it has committed; ``token_mask`` marks the real tokens (False over prompt padding).
    ``lengths_host`` and ``sequences_host`` are host copies of ``lengths`` and ``sequences``,
    refreshed by the loop's one sync per iteration: drafters and observers that work on the host
    (n-gram lookup, streaming text) read them without syncing the device again.
    """

    generation_config: GenerationConfig
    processors: LogitsProcessorList
    sequences: torch.Tensor  # [R, T + 1] long; the last column takes writes nobody reads
    token_mask: torch.Tensor  # [R, T + 1] bool
    lengths: torch.Tensor  # [R] long
    lengths_host: torch.Tensor  # [R] long, CPU
    sequences_host: torch.Tensor  # [R, T + 1] long, CPU
    padding_host: torch.Tensor  # [R] long, CPU: left padding of each prompt
    prompt_width: int
    max_new_tokens: int
    eos_token_ids: torch.Tensor  # [E] long
    eos_token_set: frozenset  # the same ids on the host, for the commit
    pad_token_id: int
    rows: torch.Tensor  # [B] long, original ids of the active rows
    rows_host: torch.Tensor  # [B] long, CPU
    generator: torch.Generator | None = None
    model_inputs: dict[str, Any] = attrs.Factory(dict)  # the request's encoder inputs, all rows
    _prepared: tuple | None = attrs.field(default=None, init=False, repr=False)  # (vocab, the processors' stages)
    _in_map: tuple | None = attrs.field(default=None, init=False, repr=False)  # (token map, suppression_in's answer)
    # The target's encoder output for every row (original order) once the loop has encoded the
    # request; None for decoder-only targets. A drafter that shares the target's encoder reads it.
    encoder_outputs: Any = None
    # The target's SlotCache for this request (core/cache.py; None for a re-read target): a drafter
    # that shares the target's encoder may share its cross-attention keys too.
    target_slots: Any = None
    iteration: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    # Times a model's cache was cut to fewer rows (every staying row's tensors copied; when rows
    # leave, and for encoder-decoder caches later: core/cache.py). Policies that time iterations
    # leave those out.
    row_cuts: int = 0
    do_sample: bool = False
    # Whether a draft loop may end as soon as no row drafts on (a host sync per draft position);
    # otherwise it runs to its width with stopped rows masked. Set by the decoder per device.
    draft_early_exit: bool = True
    # Static shapes (``SpeculativeDecoder(static_cache=True)``): preallocated caches, blocks padded
    # to power-of-two widths, finished rows kept in the model's batch until it fits a smaller bucket.
    static_shapes: bool = False
    # Which models' steps run through torch.compile ("draft", "target"); static shapes only.
    compile: frozenset = frozenset()
    # Multi-token steps of float32 CPU models on oneDNN-packed weights (core/packed_linear.py).
    packed_weights: bool = False
    # Where the verify's scores are read only for each position's argmax (a verifier that says so,
    # ``Verifier.argmax_only``, and no logits processor but token suppression and Whisper's timestamp
    # grammar after it), so that the target's LM head may be screened in bfloat16
    # (core/screened_head.py): the masks of the tokens the processors may suppress
    # (``screened_head.suppression_masks``; () for none). None elsewhere.
    screen_suppressed: tuple | None = None
    # With the screen, the first token whose logits every screened call computes in float32, all
    # those after it too (``screened_head.exact_from``: Whisper's timestamp grammar); None for none.
    screen_exact_from: int | None = None
    # Whether this iteration's verify reads the draft's first-position alternatives when it has them
    # (greedy decoding). A policy that prices them sets it at each lookahead (``cost-aware``: they
    # widen the verify, which pays on some CPUs and loses on others); otherwise they are read.
    verify_alternatives: bool = True

    @property
    def batch_size(self) -> int:
        """Rows in the request, finished or not."""
        return self.sequences.shape[0]

    @property
    def active(self) -> int:
        """Rows still decoding."""
        return self.rows_host.shape[0]

    @property
    def device(self) -> torch.device:
        return self.sequences.device

    def progress_host(self) -> tuple[list[int], list[int]]:
        """Each active row's tokens committed so far, and the tokens it may still commit: Python
        integers, read every iteration by the loop and by policies (a tensor index and subtraction
        took 24 us a call on a 2-vCPU Xeon, the lists about 4)."""
        lengths, base = self.lengths_host.tolist(), self.prompt_width
        generated = [lengths[row] - base for row in self.rows_host.tolist()]
        return generated, [self.max_new_tokens - done for done in generated]

    def commit(self, appended: torch.Tensor, accepted: torch.Tensor, drafted: torch.Tensor,
               kept: torch.Tensor | None = None) -> Committed:
        """Append to each active row the first ``accepted[b] + 1`` tokens of ``appended`` ``[B, K + 1]``
        (its accepted drafts, then the verifier's token), cut after an eos and at the length budget.
        ``kept`` (default ``accepted``) is how many of the drafts read the caches keep: fewer where a
        first-position alternative was accepted, which the caches read again as committed tokens.

        The iteration's one device sync brings the verdict to the host first; what each row appends
        is decided there, per row in Python (a handful of integers: cheaper than the tensor ops that
        would compute it, each of which costs about 1/2000 of a small model's step on a CPU, and no
        launches on an accelerator), then written to both copies. Returns those host numbers.
        """
        kept = accepted if kept is None else kept
        synced = torch.cat([torch.stack([accepted, drafted, kept], dim=1), appended], dim=1).cpu()  # the sync
        accepted_host, drafted_host, kept_host, appended_host = synced[:, 0], synced[:, 1], synced[:, 2], synced[:, 3:]
        rows_host = self.rows_host
        lengths = self.lengths_host.tolist()
        limit, eos = self.prompt_width + self.max_new_tokens, self.eos_token_set
        width = appended.shape[1]
        trash = self.sequences.shape[1] - 1  # a column nobody reads takes the tokens not appended
        counts, finished, write_at, new_lengths = [], [], [], []
        for kept, row, original in zip(accepted_host.tolist(), appended_host.tolist(), rows_host.tolist()):
            length = lengths[original]
            count, ended = kept + 1, False
            for j in range(count):
                if row[j] in eos:
                    count, ended = j + 1, True
                    break
            if count >= limit - length:
                count, ended = limit - length, True
            counts.append(count)
            finished.append(ended)
            write_at.append([length + j if j < count else trash for j in range(width)])
            new_lengths.append(length + count)
        write_at_host, lengths_host = torch.tensor(write_at), torch.tensor(new_lengths)
        self.sequences_host[rows_host[:, None], write_at_host] = appended_host
        self.lengths_host[rows_host] = lengths_host
        device = self.device
        self.sequences[self.rows[:, None], write_at_host.to(device, non_blocking=True)] = appended
        self.lengths[self.rows] = lengths_host.to(device, non_blocking=True)
        return Committed(accepted_host, torch.tensor(counts), torch.tensor(finished), drafted_host, kept_host)

    def retire(self, finished_host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Finished rows leave the batch: ``(keep, keep_host)``, the active positions that stay
        (device, CPU), or None when every row goes on."""
        if not any(finished_host.tolist()):
            return None
        keep_host = (~finished_host).nonzero().flatten()
        keep = keep_host.to(self.device, non_blocking=True)
        self.rows = self.rows[keep]
        self.rows_host = self.rows_host[keep_host]
        return keep, keep_host

    def committed_since(self, fed_host: torch.Tensor, bucketed: bool = False):
        """The committed tokens a model has not read yet, as one right-aligned ragged block.

        ``fed_host[b]`` (CPU) is how many buffer positions of active row b the model's cache
        already covers (prompt padding included).
        Returns ``(input_ids [B, W], valid [B, W], positions [B, W])`` with each row's unread tokens
        at the right end, so ``logits[:, -1]`` is every row's next-token distribution; columns to
        their left, and prompt padding, are holes. ``positions`` are the tokens' buffer positions.
        W is the largest backlog, known on the host without a sync; ``bucketed`` pads it (with holes
        on the left) to a power of two, so that a static-shape model sees few block widths.
        """
        rows = self.rows_host.tolist()
        lengths_host, fed = self.lengths_host.tolist(), fed_host.tolist()
        backlog = [lengths_host[row] - read for row, read in zip(rows, fed)]
        width = max(backlog)
        if bucketed:
            width = bucket(width)
        # Host numbers, no sync: the tensor ops below are most of a small model's plain step outside
        # its forward, so the usual case (every row one token behind, past its prompt's padding,
        # every row active) takes the fewest.
        every_row = len(rows) == self.batch_size  # state.rows is then 0 .. R - 1
        sequences = self.sequences if every_row else self.sequences[self.rows]
        lengths = self.lengths if every_row else self.lengths[self.rows]
        index = (lengths - 1)[:, None] if width == 1 else \
            lengths[:, None] + torch.arange(-width, 0, device=self.device)[None, :]  # [B, W]
        if min(backlog) == width and self._past_padding(rows, fed):  # no hole in the block
            return sequences.gather(1, index), torch.ones(index.shape, dtype=torch.bool, device=self.device), index
        inside = index >= fed_host.to(self.device, non_blocking=True)[:, None]
        index = index.clamp(min=0)
        token_mask = self.token_mask if every_row else self.token_mask[self.rows]
        return sequences.gather(1, index), inside & token_mask.gather(1, index), index

    def _past_padding(self, rows: list[int], fed: list[int]) -> bool:
        """Whether each of ``rows`` (original ids) has read ``fed`` tokens at least as far as its prompt's padding."""
        padding = self.padding_host.tolist()
        return all(read >= padding[row] for row, read in zip(rows, fed))

    def backlog_is_dense(self, fed_host: torch.Tensor, width: int) -> bool:
        """Whether ``committed_since(fed_host)``'s block of ``width`` columns holds no hole: every row
        has ``width`` unread tokens and none of them is prompt padding. Host numbers: no sync."""
        rows, fed, lengths = self.rows_host.tolist(), fed_host.tolist(), self.lengths_host.tolist()
        if any(lengths[row] - read != width for row, read in zip(rows, fed)):
            return False
        return self._past_padding(rows, fed)  # the block starts past the prompt's padding

    def process(self, scores: torch.Tensor, block: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
        """Apply the generation config's logits processors to a block of next-token scores.

        ``scores[:, j]`` ([B, n, V], float32) is the distribution after each row's committed tokens
        followed by the uncommitted tokens before it: ``block`` ([B, m], m >= n - 1) right-aligned,
        so position j follows ``block[:, :m - n + 1 + j]``. The verifier passes the drafts
        (m = n - 1: position j follows the first j drafts); a drafter scoring its next token passes
        what it drafted so far (n = 1: the whole block). Processors see exactly the ``input_ids``
        that ``model.generate`` would show them at that point. ``block`` may be a function that
        returns it, called only when a processor reads ``input_ids``.

        Warpers that never read ``input_ids`` (temperature, top-k, top-p, ...) run once over all
        B * n distributions. The others run per position, over groups of rows of equal length;
        with no processors this is free.
        """
        if not self.processors:
            return scores
        batch, width, vocab = scores.shape
        groups = None
        if self._prepared is None or self._prepared[0] != vocab:
            self._prepared = vocab, _stages([_prepared_processor(p, vocab, scores.device) for p in self.processors])
        before = None
        for stage in self._prepared[1]:
            if not isinstance(stage, list):  # one processor that reads input_ids
                if before is None:
                    block = block() if callable(block) else block
                    before = block.shape[1] - width + 1  # uncommitted tokens before position 0
                if type(stage) is _CachedSuppression and not stage.applies(self.lengths_host[self.rows_host], before, width):
                    continue
                if groups is None:
                    groups = self._length_groups()
                for prefix, group, original in groups:
                    processor = _for_rows(stage, original)
                    for j in range(width):
                        input_ids = torch.cat([prefix, block[group, : before + j]], dim=1)
                        scores[group, j] = processor(input_ids, scores[group, j])
                continue
            flat = scores.reshape(batch * width, vocab)
            no_ids = empty_block(batch * width, scores.device, torch.long)
            for processor in stage:
                flat = processor(no_ids, flat)
            scores = flat.reshape(batch, width, vocab)
        return scores

    def suppression_in(self, token_map):
        """For a draft whose head scores only ``token_map``'s tokens (core/reduced_vocab.py): when every
        processor only suppresses tokens (Whisper's ``suppress_tokens`` and ``begin_suppress_tokens``),
        what they do to those tokens, so that the draft can pick its token among them without scoring
        the whole vocabulary: ``(ids [V'] on the device, always [V'] bool, [(at-begin processor,
        [V'] bool), ...], grammar)``. ``grammar`` is None, or where Whisper's timestamp grammar follows
        the suppressions and the map holds eot, notimestamps and every timestamp, ``(the grammar
        over the map's tokens, [V] full id -> map index)`` (``_grammar_in_map``). None where another
        processor reads or changes the scores, or where they would leave none of the map's tokens (the
        draft then goes through ``process`` over the whole vocabulary). Built once per request and map."""
        if self._in_map is not None and self._in_map[0] is token_map:
            return self._in_map[1]
        answer = None
        suppressions = {SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor}
        processors, grammar, held = list(self.processors), None, True
        if processors and type(processors[-1]) is WhisperTimeStampLogitsProcessor:  # last, after the suppressions
            grammar = _grammar_in_map(processors.pop(), token_map, self.device)
            held = grammar is not None  # else the map lacks a token the grammar may force
        if held and {type(processor) for processor in processors} <= suppressions:
            ids = token_map.ids.to(self.device)
            always = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
            at_begin = []
            for processor in processors:
                prepared = _prepared_processor(processor, token_map.vocab, self.device)
                if prepared.at_begin:
                    at_begin.append((processor, prepared.mask[ids]))
                else:
                    always |= prepared.mask[ids]
            if not bool(functools.reduce(torch.logical_or, [mask for _, mask in at_begin], always).all()):
                answer = (ids, always, at_begin, grammar)
        self._in_map = (token_map, answer)
        return answer

    def _length_groups(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """For each set of rows of equal length L: ``(committed prefix [G, L], active positions [G],
        original row ids [G] on the host)``."""
        lengths_host = self.lengths_host[self.rows_host]
        sequences = self.sequences[self.rows]
        groups = []
        for length in lengths_host.unique().tolist():
            group_host = (lengths_host == length).nonzero().flatten()
            group = group_host.to(self.device, non_blocking=True)
            groups.append((sequences[group, :length], group, self.rows_host[group_host]))
        return groups


# transformers' processors whose output for a row depends on that row's scores alone, never on
# input_ids: they can process every row and draft position in one call. Exact types only: a
# subclass may read input_ids.
_ROW_WISE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    TopHLogitsWarper,
    SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
)


def _grammar_in_map(grammar, token_map, device):
    """Whisper's timestamp grammar over a reduced head's scores: ``(a shallow copy of it whose eot,
    notimestamps and first timestamp are their places in the map, [V] long: each full id's place in
    the map, 0 for a token outside it)``, or None where the map lacks any of them. The grammar reads
    token ids only against those three and the timestamps' order, and masks whole ranges: with every
    timestamp at the map's end (its ids are sorted), it does over the map, fed the tokens so far as
    map places, what it does over the whole vocabulary to the map's tokens; the tokens outside have
    -inf there, which neither its maxima nor its log-softmax read."""
    ids = token_map.ids
    first, eot, vocab = grammar.timestamp_begin, grammar.eos_token_id, token_map.vocab
    if (not isinstance(eot, int) or not bool((ids[1:] > ids[:-1]).all())
            or int((ids >= first).sum()) != vocab - first
            or not bool(torch.isin(torch.tensor([eot, grammar.no_timestamps_token_id]), ids).all())
            or int(ids[0]) >= eot):
        return None
    place = torch.zeros(vocab, dtype=torch.long)
    place[ids] = torch.arange(ids.shape[0])
    view = copy.copy(grammar)
    view.eos_token_id, view.no_timestamps_token_id = int(place[eot]), int(place[grammar.no_timestamps_token_id])
    view.timestamp_begin = int(place[first])
    return view, place.to(device)


def _for_rows(processor, original: torch.Tensor):
    """``processor`` restricted to the request's rows ``original`` (host ids), for the processors
    that keep per-row state built from the whole batch at the start of ``generate``; a shallow
    copy, so the request's own processor is never changed. Others are returned as they are."""
    kind = type(processor)
    if kind is RepetitionPenaltyLogitsProcessor and isinstance(processor.prompt_ignore_length, torch.Tensor):
        view = copy.copy(processor)  # prompt_ignore_length: each row's left padding
        view.prompt_ignore_length = processor.prompt_ignore_length[original.to(processor.prompt_ignore_length.device, non_blocking=True)]
        return view
    if kind is EncoderRepetitionPenaltyLogitsProcessor:
        view = copy.copy(processor)  # encoder_input_ids: each row's prompt
        view.encoder_input_ids = processor.encoder_input_ids[original.to(processor.encoder_input_ids.device, non_blocking=True)]
        return view
    if kind is PrefixConstrainedLogitsProcessor and processor._num_beams == 1:
        view = copy.copy(processor)  # calls the user's function with each row's batch index
        rows, allowed = original.tolist(), processor._prefix_allowed_tokens_fn
        view._prefix_allowed_tokens_fn = lambda batch_id, input_ids: allowed(rows[batch_id], input_ids)
        return view
    if kind is EncoderNoRepeatNGramLogitsProcessor:
        view = copy.copy(processor)  # generated_ngrams: the n-grams of each row's prompt
        view.generated_ngrams = [processor.generated_ngrams[row] for row in original.tolist()]
        view.batch_size = len(view.generated_ngrams)
        return view
    return processor


class _CachedSuppression:
    """``SuppressTokensLogitsProcessor`` / ``SuppressTokensAtBeginLogitsProcessor`` with the token mask
    built once. transformers builds it on every call with ``isin`` over the whole vocabulary (about
    4 ms for Whisper's 51865 tokens on a CPU core), which a drafter would pay per drafted token.
    The output is the same tensor: ``where(mask, -inf, scores)`` (at the begin index only, for the
    second)."""

    def __init__(self, processor, mask: torch.Tensor, at_begin: bool):
        self.processor, self.mask, self.at_begin = processor, mask, at_begin

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at_begin and input_ids.shape[-1] != self.processor.begin_index:
            return scores
        return torch.where(self.mask, -float("inf"), scores)

    def applies(self, lengths_host: torch.Tensor, before: int, width: int) -> bool:
        """Whether it changes any of ``width`` positions of rows whose committed lengths are
        ``lengths_host`` with ``before`` uncommitted tokens ahead of the first: the one at the begin
        index only, which a row passes once. Answered on the host, so a step past it skips the
        per-position ``input_ids`` (``_length_groups``, a concatenation per position): 0.3 ms of a
        whisper-base draft step's 4 ms (docs/benchmarks.md, stop 60)."""
        if not self.at_begin:
            return True
        offsets = self.processor.begin_index - before - lengths_host
        return bool(((offsets >= 0) & (offsets < width)).any())


class _NucleusTopP:
    """``TopPLogitsWarper`` without sorting the vocabulary, on a CPU. transformers sorts all of it
    for every distribution: 2.9 ms per position for SmolLM2's 49152 tokens on a CPU core, which a
    sampled iteration pays for each of the target's k + 1 positions and each drafted one (a k = 2
    iteration spent 15 ms in it against a 57 ms target step). The nucleus is read from the
    ``NUCLEUS_CANDIDATES`` most probable tokens instead (0.4 ms for three positions): a token is kept
    when the tokens more probable than it hold less than ``top_p`` of the mass, which is
    transformers' rule (it removes a token when the ascending cumulative mass up to it is at most
    ``1 - top_p``) counted from the other end. Rows whose nucleus reaches past the candidates (flat
    distributions: 1% of SmolLM2's positions at temperature 0.7) go through transformers' warper
    itself. The summation order differs from the sort's, so a token whose mass lies exactly on the
    boundary could fall the other way, and tokens of equal score across the boundary are kept in
    another order than the sort's: the same last-bit freedom a verify's logits already have against
    ``generate``'s (tests/test_rejection.py compares the two warpers)."""

    def __init__(self, processor: TopPLogitsWarper):
        self.processor = processor

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        warper = self.processor
        probs = scores.softmax(dim=-1)
        top, index = probs.topk(min(NUCLEUS_CANDIDATES, scores.shape[-1]), dim=-1)  # descending
        mass = top.cumsum(dim=-1)
        above = mass - top  # the mass of the candidates more probable than each
        keep = above < warper.top_p  # the most probable always: top_p > 0
        if warper.min_tokens_to_keep > 1:
            keep[:, : warper.min_tokens_to_keep] = True
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, index, keep)
        out = scores.masked_fill(~kept, warper.filter_value)
        beyond = (mass[:, -1] < warper.top_p).nonzero().flatten()  # the candidates hold too little
        if beyond.numel():
            out[beyond] = warper(input_ids[beyond], scores[beyond])
        return out


# Candidates _NucleusTopP reads the nucleus from (top-k of them: 0.4 ms for 3 x 49152 scores, against
# 8.1 ms for the sort).
NUCLEUS_CANDIDATES = 256


def _prepared_processor(processor, vocab: int, device):
    kind = type(processor)  # exact types: a subclass may do more
    if (kind is TopPLogitsWarper and device.type == "cpu" and 0.0 < processor.top_p < 1.0
            and processor.min_tokens_to_keep < min(NUCLEUS_CANDIDATES, vocab)):
        # On an accelerator the sort is cheap and reading which rows fall back would sync the device.
        return _NucleusTopP(processor)
    if kind is SuppressTokensLogitsProcessor:
        tokens, at_begin = processor.suppress_tokens, False
    elif kind is SuppressTokensAtBeginLogitsProcessor:
        tokens, at_begin = processor.begin_suppress_tokens, True
    else:
        return processor
    if device.type == "cpu" and tokens.device.type == "cpu":
        mask = _suppression_mask(vocab, tuple(tokens.flatten().tolist()))
    else:  # reading the tokens on the host would sync the device; isin there is cheap
        mask = torch.isin(torch.arange(vocab, device=device), tokens.to(device, non_blocking=True))
    return _CachedSuppression(processor, mask, at_begin)


@functools.lru_cache(maxsize=16)
def _suppression_mask(vocab: int, tokens: tuple[int, ...]) -> torch.Tensor:
    """A [vocab] bool mask of ``tokens`` on the CPU, read-only by contract. generate makes new
    processors for every request, and the loop, the draft's pick among its token map and the
    screened head each prepare them: six isin calls over whisper-base's 51865 tokens, 5 ms a
    request on a Zen 5, 2 % of its decoder time at batch 1 (docs/benchmarks.md, stop 62). The lists
    are the generation config's, the same for every request."""
    return torch.isin(torch.arange(vocab), torch.tensor(tokens, dtype=torch.long))


def _stages(processors) -> list:
    """The processors in order, consecutive row-wise ones gathered into a list (one batched stage)."""
    stages: list = []
    for processor in processors:
        if (type(processor) in _ROW_WISE or type(processor) is _NucleusTopP
                or (type(processor) is _CachedSuppression and not processor.at_begin)):
            if stages and isinstance(stages[-1], list):
                stages[-1].append(processor)
            else:
                stages.append([processor])
        else:
            stages.append(processor)
    return stages
