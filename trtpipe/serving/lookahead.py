"""Lookahead decoding's state machine, per request: the 2D window of Jacobi guesses, the n-gram pool, the verification
set, the tree-encoded drafts with their attention mask and position ids, and acceptance.

A port of TensorRT-LLM's CPU algorithm, step for step (pure Python, no model):

- the configuration (W, N, G), its legality and its draft length: :class:`trtpipe.recipe.lookahead.LookaheadConfig`.
- ``cpp/tensorrt_llm/layers/lookaheadPoolManager.cpp@22d95135``: the pool of (N - 1)-grams keyed by the token before
  them, at most G per key, most recently inserted last (:class:`NgramPool`).
- ``cpp/tensorrt_llm/layers/lookaheadAlgorithm.cpp@22d95135``: ``setup`` / ``accept`` / ``lookahead`` / ``guess`` /
  ``posIdsToMask`` / ``treeEncode`` / ``prepare`` / ``verify`` / ``update`` (:class:`LookaheadAlgorithm`).
- ``cpp/tensorrt_llm/layers/lookaheadDecodingLayer.cpp@05cc2c11``: how a decoding step drives it: a step without
  drafts (the first after the context) only ``accept`` s its token; a step with drafts ``update`` s; then ``prepare``
  lays out the next step's drafts at positions from the sequence length, every draft also attending the last token.
  Its target tokens are top-1 (``params.maxTopK = 1``): lookahead decoding is greedy.

Two differences, neither visible in the output: upstream seeds the window with C ``rand()`` after ``srand(seed)``
(uniform prompt tokens); this draws them with :class:`random.Random` (seed) instead. And ``treeEncode`` walks an
``unordered_map``, so the order of sibling branches is unspecified upstream; here it is first-inserted first. The
accepted path is then the first of equally long ones in that order; its tokens are the target's greedy tokens either
way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

from trtpipe.recipe.lookahead import LookaheadConfig


class NgramPool:
    """N-grams seen so far, keyed by the token before them: each key keeps its ``guess_set_size`` most recent distinct
    (N - 1)-token continuations, oldest first (``LookaheadPoolManager``)."""

    def __init__(self, guess_set_size: int):
        self.guess_set_size = guess_set_size
        self.map: dict[int, list[tuple[int, ...]]] = {}

    def insert_one(self, key: int, ngram: Sequence[int]) -> None:
        ngram = tuple(ngram)
        if not ngram or self.guess_set_size == 0:
            return
        items = self.map.get(key)
        if items is None:
            self.map[key] = [ngram]
            return
        items[:] = [x for x in items if x != ngram]
        if self.guess_set_size > 0 and len(items) >= self.guess_set_size:
            items.pop(0)
        items.append(ngram)

    def accept(self, tokens: Sequence[int], level: int) -> None:
        """Every n-gram of ``level`` tokens of ``tokens``: its first token is the key, the rest the continuation."""
        for ti in range(0, len(tokens) - level + 1):
            self.insert_one(tokens[ti], tokens[ti + 1 : ti + level])

    def guess(self, last_token: int, size: int) -> list[tuple[int, ...]]:
        """The (at most) ``size`` most recently inserted continuations of ``last_token``, oldest first."""
        items = self.map.get(last_token, [])
        return list(items[-size:]) if size > 0 and len(items) > size else list(items) if size > 0 else []

    def update(self, keys: Sequence[int], rows: Sequence[Sequence[int]]) -> None:
        for key, row in zip(keys, rows):
            self.insert_one(key, row)


def positions_to_mask(positions: Sequence[int]) -> list[list[bool]]:
    """``posIdsToMask``: a token attends the latest earlier tokens forming a run of consecutive positions ending just
    before its own (and itself); a position not above the run's top pops it back."""
    n = len(positions)
    mask = [[False] * n for _ in range(n)]
    stack: list[tuple[int, int]] = []
    for i, cur in enumerate(positions):
        while stack and cur <= stack[-1][1]:
            stack.pop()
        if stack and cur != stack[-1][1] + 1:
            raise ValueError(f"position ids {list(positions)} are not runs of consecutive positions")
        stack.append((i, cur))
        for j, _ in stack:
            mask[i][j] = True
    return mask


def tree_encode(
    tokens: Sequence[int], positions: Sequence[int], mask: Sequence[Sequence[bool]]
) -> tuple[list[int], list[int], list[list[bool]], list[int]]:
    """``treeEncode``: merge branches that share a prefix into a trie, laid out depth first.

    Returns:
        (tokens, positions, mask, encode_map): the trie's tokens, their positions (the first input position plus the
        depth), each node's ancestors-and-self mask, and for every input index the trie index it was merged into.
    """
    root: dict[int, list] = {}  # token -> [sources, children]
    for i in range(len(tokens)):
        nexts = root
        for j in range(i + 1):
            if mask[i][j]:
                node = nexts.setdefault(tokens[j], [[], {}])
                node[0].append(j)
                nexts = node[1]
    out_tokens: list[int] = []
    out_pos: list[int] = []
    encode_map = [0] * len(tokens)
    paths: list[list[int]] = []
    base = positions[0] if positions else 0

    def visit(tok: int, node: list, depth: int, path: list[int]) -> None:
        idx = len(out_tokens)
        for src in node[0]:
            encode_map[src] = idx
        out_tokens.append(tok)
        out_pos.append(base + depth)
        here = path + [idx]
        paths.append(here)
        for t, child in node[1].items():
            visit(t, child, depth + 1, here)

    for t, child in root.items():
        visit(t, child, 0, [])
    size = len(out_tokens)
    out_mask = [[False] * size for _ in range(size)]
    for i, path in enumerate(paths):
        for j in path:
            out_mask[i][j] = True
    return out_tokens, out_pos, out_mask, encode_map


@dataclass
class LookaheadDrafts:
    """One step's drafts after the request's last token: tokens, absolute position ids and the mask among them (each
    row: which drafts it attends, itself included). Every draft also attends the last token and the cached
    sequence."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    mask: list[list[bool]] = field(default_factory=list)

    def full_mask(self) -> list[list[bool]]:
        """The mask over ``[last token, drafts...]`` (upstream's attention mask with ``attentionMaskOffset`` 1: row 0
        is the last token, every row attends it)."""
        n = len(self.tokens)
        rows = [[True] + [False] * n]
        for i in range(n):
            rows.append([True] + list(self.mask[i]))
        return rows


class LookaheadAlgorithm:
    """One request's lookahead state (``LookaheadAlgorithm``), sized for the executor's (max W, N, G)."""

    def __init__(self, max_config: LookaheadConfig):
        bad = max_config.problems()
        if bad:
            raise ValueError(f"lookahead {max_config}: {'; '.join(bad)}")
        self.max_config = max_config
        self.config = max_config
        self.pool = NgramPool(max_config.verification_set_size)
        self.prefills: list[int] = []
        self.past: list[list[int]] = []
        self.golden: list[int] = []
        self.filling = 0
        self._drafts: list[int] = []
        self._mask: list[list[bool]] = []
        self._encode_map: list[int] = []
        self._guess_len = 0

    @property
    def w(self) -> int:
        return self.config.window_size

    @property
    def n(self) -> int:
        return self.config.ngram_size

    @property
    def g(self) -> int:
        return self.config.verification_set_size

    def setup(self, prompt: Sequence[int], config: Optional[LookaheadConfig] = None, seed: int = 0) -> None:
        """A request's start: the pool from the prompt's n-grams, the window seeded with prompt tokens."""
        config = config or self.max_config
        if not config.fits_in(self.max_config):
            raise ValueError(f"lookahead {config} exceeds the executor's {self.max_config}")
        bad = config.problems()
        if bad:
            raise ValueError(f"lookahead {config}: {'; '.join(bad)}")
        if not prompt:
            raise ValueError("lookahead needs a non-empty prompt")
        self.config = config
        w, n = self.w, self.n
        self.pool = NgramPool(self.g)
        self.pool.accept(prompt, n)
        rng = random.Random(seed)
        self.prefills = [prompt[rng.randrange(len(prompt))] for _ in range(max(0, n - 2))]
        self.past = [[-1] * (n - 1) for _ in range(w)]
        for row in self.past:
            if n > 1:
                row[0] = prompt[rng.randrange(len(prompt))]
        self.golden = list(prompt[len(prompt) - (n - 1) :]) if n > 1 else []
        self.filling = 1 if n > 1 else 0
        self._drafts, self._mask, self._encode_map, self._guess_len = [], [], [], 0

    def accept(self, generated: Sequence[int]) -> None:
        """Tokens the sequence took: the n-grams ending in them join the pool."""
        if len(generated) > self.n:
            raise ValueError(f"lookahead accepts at most n = {self.n} tokens at once, got {len(generated)}")
        gold = self.golden[: self.n - 1] + list(generated)
        self.pool.accept(gold, self.n)
        self.golden = gold[len(gold) - (self.n - 1) :] if self.n > 1 else []

    def _lookahead(self, start: int) -> tuple[list[int], list[int]]:
        """The lookahead branch: the window's rows (after the prefill while it fills), and their positions."""
        n, w, f = self.n, self.w, self.filling
        prefill = n - 2 - f
        if f < n - 1:  # prefilling
            tokens = list(self.prefills[f:])
            for row in self.past:
                tokens += row[:f]
        else:  # shift up: the flattened window without its first token
            flat = [t for row in self.past for t in row[:f]]
            tokens = flat[1 : f * w]
        positions: list[int] = []
        if prefill >= 0:
            positions += range(start, start + prefill)
            for wj in range(w):
                positions += range(start + prefill + wj, start + prefill + wj + f)
        else:
            positions += range(start, start + f - 1)
            for wj in range(1, w):
                positions += range(start - 1 + wj, start - 1 + wj + f)
        return tokens, positions

    def _guess(self, start: int, last_token: int) -> tuple[list[int], list[int]]:
        """The verification branch: up to G pooled continuations of the last token, each at positions from start."""
        tokens: list[int] = []
        positions: list[int] = []
        for ngram in self.pool.guess(last_token, self.g):
            tokens += ngram
            positions += range(start, start + len(ngram))
        return tokens, positions

    def prepare(self, offset: int, last_token: int) -> LookaheadDrafts:
        """The next step's drafts: ``offset`` is the sequence length (the last token sits at ``offset - 1``)."""
        if self.config.max_draft_len == 0:
            self._drafts, self._mask, self._encode_map, self._guess_len = [], [], [], 0
            return LookaheadDrafts()
        look_t, look_p = self._lookahead(offset)
        guess_t, guess_p = self._guess(offset, last_token)
        tokens, positions = look_t + guess_t, look_p + guess_p
        self._guess_len = len(guess_t)
        mask = positions_to_mask(positions)
        enc_t, enc_p, enc_m, enc_map = tree_encode(tokens, positions, mask)
        self._drafts, self._mask, self._encode_map = enc_t, enc_m, enc_map
        return LookaheadDrafts(enc_t, enc_p, enc_m)

    def drop_prepared(self) -> None:
        """Forget the drafts :meth:`prepare` laid out (the step runs without them: only :meth:`accept` follows)."""
        self._drafts, self._mask, self._encode_map, self._guess_len = [], [], [], 0

    def _verify(self, new_last: int, gold: Sequence[int], end_id: Optional[int]) -> tuple[list[int], list[int]]:
        """The longest draft path the target agrees with: (accepted tokens, the trie indices of the accepted drafts)."""
        size = len(self._drafts)
        max_hit, hit_idx = 0, 0
        for i in range(size):
            hit, cur = 0, new_last
            for j in range(size):
                if self._mask[i][j]:
                    if self._drafts[j] == cur and self._drafts[j] != end_id:
                        hit += 1
                        cur = gold[j]
                    else:
                        break
            if hit > max_hit:
                max_hit, hit_idx = hit, i
        max_hit = min(max_hit, self.n - 1)
        accepted, offsets = [new_last], []
        for j in range(size):
            if self._mask[hit_idx][j] and len(offsets) < max_hit:
                offsets.append(j)
                accepted.append(gold[j])
        return accepted, offsets

    def update(self, sampled: Sequence[int], end_id: Optional[int] = None) -> tuple[list[int], list[int]]:
        """After a step with drafts: ``sampled`` is the target's token at the last token and at every draft (trie
        order, 1 + len(drafts)). Advances the window, feeds the pool, and returns (the tokens the sequence takes:
        the target's token after the last one, then one per accepted draft; the trie indices of the accepted drafts,
        whose KV the sequence keeps)."""
        if len(sampled) != 1 + len(self._drafts):
            raise ValueError(f"lookahead: {len(sampled)} sampled tokens for {len(self._drafts)} drafts (want one more)")
        n, w, f = self.n, self.w, self.filling
        unzipped = [sampled[0]] + [sampled[m + 1] for m in self._encode_map]
        new_last = unzipped[0]
        prefill = n - 2 - f
        keys = [unzipped[prefill + i * f + f] for i in range(w)]
        if f < n - 1:
            for i in range(w):
                self.past[i][f] = keys[i]
        elif n > 1:
            for i in range(w):
                row = self.past[i]
                first = row[0]
                self.past[i] = row[1:] + [keys[i]]
                keys[i] = first
            keys[0] = new_last
            self.pool.update(keys, self.past)
        look_size = 1 + (n - 2 if n > 1 else 0) - f + f * w
        if self._guess_len + look_size != len(unzipped):
            raise AssertionError(f"lookahead: {self._guess_len} + {look_size} != {len(unzipped)}")
        accepted, offsets = self._verify(new_last, sampled[1:], end_id)
        self.accept(accepted)
        if f < n - 1:
            self.filling += 1
        return accepted, offsets


# ---- configuration: the executor's, a request's, and what is refused ----------------------------------------------

LOOKAHEAD = "Lookahead"  # ExecutorConfig.speculative_decoding_type
GREEDY_ONLY = (
    "lookahead decoding is greedy (its decoding layer takes the top-1 token: lookaheadDecodingLayer.cpp maxTopK 1); "
    "send temperature 0 or runtime_top_k 1, or serve a model without lookahead for sampling"
)


def executor_lookahead(config) -> Optional[LookaheadConfig]:
    """The executor's (max) lookahead configuration, or None when it does not run lookahead decoding."""
    if config.speculative_decoding_type != LOOKAHEAD:
        return None
    return LookaheadConfig(
        config.lookahead_window_size, config.lookahead_ngram_size, config.lookahead_verification_set_size
    )


def executor_knobs(decoding_mode: Optional[str], params: dict, engine_max_draft_len: Optional[int] = None) -> dict:
    """ExecutorConfig fields of the Triton model's ``decoding_mode`` and ``lookahead_*`` parameters ({} unless
    decoding_mode is lookahead, as the backend reads them only then). ValueError names the parameter."""
    if str(decoding_mode or "").lower() != "lookahead":
        return {}
    values = {
        k: params.get(k) for k in ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
    }
    if any(v is None or v == "" for v in values.values()):
        raise ValueError(
            "decoding_mode lookahead: set lookahead_window_size, lookahead_ngram_size and "
            f"lookahead_verification_set_size together (got {values})"
        )
    try:
        cfg = LookaheadConfig(*(int(v) for v in values.values()))
    except ValueError:
        raise ValueError(
            f"decoding_mode lookahead: the lookahead_* parameters must be integers, got {values}"
        ) from None
    bad = cfg.problems()
    if bad:
        raise ValueError(f"decoding_mode lookahead: lookahead {cfg}: {'; '.join(bad)}")
    if engine_max_draft_len is not None and engine_max_draft_len != cfg.max_draft_len:
        raise ValueError(
            f"decoding_mode lookahead {cfg} drafts {cfg.max_draft_len} tokens per step but the engine was built with "
            f"max_draft_len {engine_max_draft_len} (they must be equal: lookaheadDecodingLayer.cpp checks it)"
        )
    return {"speculative_decoding_type": LOOKAHEAD, **cfg.executor_fields()}


def request_sizes(get) -> Optional[tuple[int, int, int]]:
    """A Triton request's ``lookahead_*`` inputs: all three or none (``get(name)`` -> numpy array or None)."""
    names = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
    arrays = [get(n) for n in names]
    given = [a is not None and a.size > 0 for a in arrays]
    if not any(given):
        return None
    if not all(given):
        raise ValueError(f"{', '.join(names)}: give all three or none (got {[n for n, g in zip(names, given) if g]})")
    return tuple(int(a.reshape(-1)[0]) for a in arrays)


def request_problem(config, request) -> Optional[str]:
    """Why the executor cannot run this request's lookahead (one line), or None."""
    mine = executor_lookahead(config)
    if request.lookahead is not None:
        if mine is None:
            return (
                "The request lookahead decoding input tensors (window_size, ngram_size and verification_set_size) "
                "can only be set if the model instance lookahead parameters are also specified"
            )
        theirs = LookaheadConfig(*request.lookahead)
        bad = theirs.problems()
        if bad:
            return f"request lookahead {theirs}: {'; '.join(bad)}"
        if not theirs.fits_in(mine):
            return f"request lookahead {theirs} exceeds the model's {mine}: each size must be at most the model's"
    if mine is not None and not request.sampling.greedy:
        return GREEDY_ONLY
    return None


# ---- the executor's drafter: one LookaheadAlgorithm per request, its drafts verified as one masked token set -------


@dataclass
class _RequestState:
    algo: LookaheadAlgorithm
    synced: int  # tokens of the request's sequence the algorithm has taken
    end_id: Optional[int] = None
    pending: Optional[int] = None  # sequence length when the drafts now in flight were prepared


def _paths(drafts: LookaheadDrafts, cap: int, end_id: Optional[int]) -> list[list[int]]:
    """Candidate paths over ``[last token, drafts...]`` (indices into that list): each trie node's root path, at most
    ``cap`` drafts long (upstream's ``mRuntimeMaxDraftPathLen`` N - 1, and the room the request has left) and cut
    before an end-id draft (``verify`` counts no hit on one); prefixes of longer paths dropped."""
    out: list[tuple[int, ...]] = []
    for i in range(len(drafts.tokens)):
        path = [j + 1 for j in range(len(drafts.tokens)) if drafts.mask[i][j]][:cap]
        if end_id is not None and any(drafts.tokens[j - 1] == end_id for j in path):
            path = path[: next(k for k, j in enumerate(path) if drafts.tokens[j - 1] == end_id)]
        if path:
            out.append(tuple(path))
    keep = set(out)
    for p in list(keep):
        for k in range(1, len(p)):
            keep.discard(p[:k])
    return [list(p) for p in sorted(keep)]


class LookaheadDrafter:
    """Lookahead decoding in the in-flight batching executor (``decoding_type`` Lookahead), as upstream's decoding
    layer drives its algorithm: the step after the context (or any step without drafts) only ``accept`` s the new
    tokens; a step with drafts ``update`` s from the target's token at every row; then ``prepare`` lays out the next
    drafts. All branches (the window's rows and the verification set) go into the request's one entry of the step,
    as a token set with upstream's mask and positions (:mod:`trtpipe.serving.tree_verify`); acceptance keeps the
    longest agreeing path and its KV."""

    def __init__(self, config):
        self.max_config = executor_lookahead(config)
        if self.max_config is None:
            raise ValueError("speculative decoding_type Lookahead needs lookahead_window_size / ngram / verification")
        self.config = config
        self.state: dict[int, _RequestState] = {}

    def _state(self, r) -> _RequestState:
        st = self.state.get(r.id)
        if st is None:
            req = r.request
            cfg = LookaheadConfig(*req.lookahead) if req.lookahead is not None else self.max_config
            algo = LookaheadAlgorithm(self.max_config)
            seed = req.sampling.seed if req.sampling.seed is not None else 0  # DefaultDecodingParams::getSeed()
            algo.setup(list(req.prompt), cfg, seed)
            st = self.state[r.id] = _RequestState(algo, len(req.prompt), req.end_id)
        return st

    def propose(self, requests: list, ks: dict[int, int]) -> dict[int, tuple]:
        """Each request's next drafts, ``(drafts, None, StepEntry fields)``; ``ks``: how many more tokens each may
        take beyond the next one (no drafts when its drafts would pass max_seq_len)."""
        out = {}
        for r in requests:
            st = self._state(r)
            new = r.tokens[st.synced :]
            n = st.algo.n
            for i in range(0, len(new), max(1, n)):  # tokens decoded without drafts: into the pool
                st.algo.accept(new[i : i + max(1, n)])
            st.synced = len(r.tokens)
            st.pending = None
            drafts = st.algo.prepare(len(r.tokens), r.tokens[-1])
            if not drafts.tokens or len(r.tokens) + len(drafts.tokens) > self.config.max_seq_len:
                self._no_drafts(st)
                continue
            paths = _paths(drafts, min(st.algo.n - 1, ks.get(r.id, 0)), r.request.end_id)
            if not paths:
                self._no_drafts(st)
                continue
            base = len(r.tokens) - 1  # the last token's position: the entry's start_pos
            fields = {
                "spec_positions": [0] + [p - base for p in drafts.positions],
                "spec_mask": drafts.full_mask(),
                "spec_paths": paths,
            }
            st.pending = len(r.tokens)
            out[r.id] = (list(drafts.tokens), None, fields)
        return out

    @staticmethod
    def _no_drafts(st: _RequestState) -> None:
        """This step decodes the request without drafts: the algorithm only accepts its token (upstream's
        tokensPerStep == 1 branch), so the prepared layout is dropped."""
        st.algo.drop_prepared()

    def stepped(self, batch, result) -> None:
        """After the target's forward: each request that verified drafts updates its window and pool from the
        target's token at every row (``StepResult.targets``)."""
        for e in batch.entries:
            st = self.state.get(e.request_id)
            if st is None or st.pending is None or e.spec_mask is None:
                continue
            rows = result.targets.get(e.request_id)
            if rows is None:  # the entry failed: its drafts are dropped, nothing was taken
                st.pending = None
                st.algo.drop_prepared()
                continue
            accepted, _ = st.algo.update(rows, st.end_id)
            st.synced = st.pending + len(accepted)
            st.pending = None

    def accepted(self, request_id: int, valid: int) -> None:
        """The executor's acceptance changes nothing here (the algorithm updated from the step's rows)."""

    def forget(self, request_id: int) -> None:
        self.state.pop(request_id, None)
