"""Guided (constrained) decoding: a per-request grammar whose token mask is applied in the sampling step.

Everything guided decoding needs in the executor lives here; the executor only asks a request's matcher for
its mask before the step, and feeds it each accepted token after. One home for every front end (OpenAI twin,
Triton twin, Dynamo worker): they build a :class:`Guide` from their own request fields and hand it to the
executor on :class:`~trtpipe.serving.api.Request`.

Names are TensorRT-LLM's:

- :class:`GuidedDecodingParams` is the LLM API's (``tensorrt_llm/sampling_params.py@000a01de``: ``json``,
  ``regex``, ``grammar``, ``json_object``, ``structural_tag``, one at most), and :meth:`GuidedDecodingParams.guide`
  is its ``SamplingParams._get_guided_decoding_params`` (json_object -> ``JSON``, json -> ``JSON_SCHEMA`` with a
  dict dumped to a string, regex -> ``REGEX``, grammar -> ``EBNF_GRAMMAR``, structural_tag -> ``STRUCTURAL_TAG``).
- :class:`Guide` is the executor's ``GuidedDecodingParams(guide_type, guide)``; the guide type names are the
  Triton ``guided_decoding_guide_type`` values (tensorrtllm_backend ``docs/guided_decoding.md``).
- The backends are a table (:data:`BACKENDS`), one row per ``guided_decoding_backend`` value, each a port of its
  factory in ``tensorrt_llm/_torch/pyexecutor/grammar_matcher.py@0fccc5b9``, behind one per-request matcher
  interface (its mask before a step, the token it accepts after, whether it is terminated):

  - ``xgrammar`` (``XGrammarMatcherFactory.create``): ``JSON`` is xgrammar's builtin JSON grammar, ``JSON_SCHEMA``
    ``compile_json_schema``, ``REGEX`` ``compile_regex``, ``EBNF_GRAMMAR`` ``compile_grammar``, ``STRUCTURAL_TAG``
    ``compile_structural_tag``;
  - ``llguidance`` (``LLGuidanceMatcherFactory.create`` / ``LLGuidanceMatcher``): an ``LLTokenizer`` of the
    tokenizer string with the one stop token as its EOS; ``JSON`` is the schema ``{"type": "object"}``,
    ``JSON_SCHEMA`` / ``REGEX`` ``grammar_from_json_schema`` / ``grammar_from_regex``, ``EBNF_GRAMMAR`` is read as
    a Lark grammar (``grammar_from_lark``: upstream's note says llguidance takes Lark, not EBNF), and a structural
    tag is unsupported; once the grammar has stopped only the EOS token is accepted, which terminates it.

  The executor ends a request once its matcher is terminated (it has accepted a stop token after a complete
  match).
- The tokenizer information is xgrammar's ``TokenizerInfo`` built as that factory builds it from
  ``GuidedDecodingConfig(encoded_vocab, tokenizer_str, stop_token_ids)``; :func:`upstream_tokenizer_info` writes
  that triple as ``examples/generate_xgrammar_tokenizer_info.py@7ed07f06`` does (``_xgrammar_tokenizer_info`` in
  ``tensorrt_llm/llmapi/tokenizer.py``): the file Triton's ``xgrammar_tokenizer_info_path`` names.

Policy: compiled grammars are cached per (backend, guide) in a bounded LRU (:data:`CACHE_ENTRIES`); xgrammar's
own cache is off so the hit count is what this cache did (llguidance's compiled form is its validated grammar
text: its matcher compiles lazily, per request, as upstream's does). A guide that does not compile (a bad schema)
raises :class:`GuideError`, which fails that request alone with an ``INVALID`` error.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from trtpipe.triton.xgrammar_info import upstream_tokenizer_info

CACHE_ENTRIES = 256  # compiled grammars kept per executor


class GuideError(ValueError):
    """A guide that cannot be compiled or followed: the request's own fault (HTTP 400 / Triton error)."""


class GuideType(str, enum.Enum):
    """executor ``GuidedDecodingParams::GuideType``, spelled as Triton's ``guided_decoding_guide_type`` values."""

    JSON = "json"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF_GRAMMAR = "ebnf_grammar"
    STRUCTURAL_TAG = "structural_tag"


@dataclass(frozen=True)
class Guide:
    """One request's guide, as the executor carries it (hashable: the compile cache's key)."""

    guide_type: GuideType
    guide: str = ""  # JSON: unused

    @classmethod
    def of(cls, guide_type: str, guide: Optional[str]) -> "Guide":
        """From a front end's (type, text) pair, e.g. Triton's inputs; an unknown type or a missing text is a
        :class:`GuideError` naming the valid types."""
        try:
            kind = GuideType(guide_type)
        except ValueError:
            valid = ", ".join(t.value for t in GuideType)
            raise GuideError(f"guided_decoding_guide_type {guide_type!r} is not one of {valid}") from None
        if kind is not GuideType.JSON and not guide:
            raise GuideError(f"guided_decoding_guide is required for guide type {kind.value!r}")
        return cls(kind, "" if kind is GuideType.JSON else str(guide))


@dataclass
class GuidedDecodingParams:
    """The LLM API's guided decoding parameters: one of the fields at most."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None

    def guide(self) -> Optional[Guide]:
        """The executor's guide (``SamplingParams._get_guided_decoding_params``), or None for no guide."""
        set_ = [n for n in ("json", "regex", "grammar", "json_object", "structural_tag") if getattr(self, n)]
        if len(set_) > 1:
            raise GuideError(f"Only one guide can be used for a request, but got {len(set_)}.")
        if self.json_object:
            return Guide(GuideType.JSON)
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return Guide(GuideType.JSON_SCHEMA, text)
        if self.regex is not None:
            return Guide(GuideType.REGEX, self.regex)
        if self.grammar is not None:
            return Guide(GuideType.EBNF_GRAMMAR, self.grammar)
        if self.structural_tag is not None:
            return Guide(GuideType.STRUCTURAL_TAG, self.structural_tag)
        return None


# --- tokenizer information -------------------------------------------------------------------------------------


def tokenizer_info(info: dict[str, Any], vocab_size: int):
    """xgrammar ``TokenizerInfo`` of an :func:`upstream_tokenizer_info` dict and the model's (padded) vocabulary
    size, as ``XGrammarMatcherFactory.__init__`` builds it."""
    import xgrammar

    vocab_type, prefix = xgrammar.VocabType.RAW, False
    if info.get("tokenizer_str") is not None:
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(info["tokenizer_str"])
        vocab_type, prefix = meta["vocab_type"], meta["add_prefix_space"]
    return xgrammar.TokenizerInfo(
        info["encoded_vocab"],
        vocab_type=vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=info.get("stop_token_ids"),
        add_prefix_space=prefix,
    )


# --- the decoder: compile (cached), then one matcher per request -----------------------------------------------


@dataclass
class GuidedStats:
    """What ``/prometheus/metrics`` shows of guided decoding (counters since start)."""

    constrained_requests: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    failed_guides: int = 0


# The counters every front end exports, (name, GuidedStats field, help): the OpenAI twin's /prometheus/metrics
# (GuidedDecoder.prometheus_lines) and the Triton twin's metric families (model_repo/tensorrt_llm/1/model.py).
COUNTERS = (
    ("trtpipe_guided_requests_total", "constrained_requests", "Requests decoded under a guide"),
    ("trtpipe_guided_grammar_compiles_total", "compiles", "Guides compiled (cache misses that compiled)"),
    ("trtpipe_guided_grammar_compile_seconds_total", "compile_seconds", "Seconds spent compiling guides"),
    ("trtpipe_guided_grammar_cache_hits_total", "cache_hits", "Guides found compiled in the cache"),
    ("trtpipe_guided_invalid_guides_total", "failed_guides", "Guides that failed to compile"),
)


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [V] of an int32 [1, ceil(V / 32)] token bitmask (bit ``i % 32`` of word ``i // 32``, set = allowed; the
    layout xgrammar and llguidance share)."""
    # int32 words as little-endian bytes (the host order of every platform torch ships for), LSB first
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.astype(bool))


class GuideMatcher:
    """One request's xgrammar matcher: its next-token mask, and the tokens it accepts."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar

        self._m = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(V / 32)]
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next."""
        self._m.fill_next_token_bitmask(self._bitmask)
        return _allowed(self._bitmask, self.vocab_size)

    def accept(self, token: int) -> None:
        """Advance by a sampled token; a token the grammar refuses is a :class:`GuideError` (never, when the mask
        was applied)."""
        if not self._m.accept_token(int(token)):
            raise GuideError(f"token {token} does not follow the request's grammar")

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()


class LLGuidanceMatcher:
    """One request's llguidance matcher, with :class:`GuideMatcher`'s interface (``LLGuidanceMatcher``)."""

    def __init__(self, matcher, eos_token: int, vocab_size: int):
        import llguidance.torch

        self._m, self._eos, self.vocab_size = matcher, eos_token, vocab_size
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(V / 32)]
        self._terminated = False

    def allowed(self) -> torch.Tensor:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, self._bitmask, 0)
        self._check()
        return _allowed(self._bitmask, self.vocab_size)

    def accept(self, token: int) -> None:
        if self._m.is_stopped():  # only the EOS token is accepted now, and it terminates the grammar
            ok = int(token) == self._eos
            self._terminated = ok
        else:
            ok = self._m.try_consume_tokens([int(token)]) > 0
            self._check()
        if not ok:
            raise GuideError(f"token {token} does not follow the request's grammar")

    @property
    def terminated(self) -> bool:
        return self._terminated

    def _check(self) -> None:
        if self._m.is_error():
            raise GuideError(f"llguidance matcher error: {self._m.get_error()}")


class XGrammarBackend:
    """``XGrammarMatcherFactory``: the tokenizer information, the compiler, a matcher per request."""

    def __init__(self, info: dict[str, Any], vocab_size: int):
        import xgrammar

        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(tokenizer_info(info, vocab_size), cache_enabled=False)

    def compile(self, guide: Guide):
        c, kind = self._compiler, guide.guide_type
        if kind is GuideType.JSON:
            return c.compile_builtin_json_grammar()
        if kind is GuideType.JSON_SCHEMA:
            json.loads(guide.guide)  # a schema that is not JSON: say so (xgrammar's message is less clear)
            return c.compile_json_schema(guide.guide)
        if kind is GuideType.REGEX:
            return c.compile_regex(guide.guide)
        if kind is GuideType.EBNF_GRAMMAR:
            return c.compile_grammar(guide.guide)
        return c.compile_structural_tag(guide.guide)

    def matcher(self, compiled) -> GuideMatcher:
        return GuideMatcher(compiled, self.vocab_size)


class LLGuidanceBackend:
    """``LLGuidanceMatcherFactory``: an ``LLTokenizer`` of the tokenizer string, a matcher per request."""

    def __init__(self, info: dict[str, Any], vocab_size: int):
        import llguidance

        stop = info.get("stop_token_ids")
        if info.get("tokenizer_str") is None:
            raise ValueError("guided_decoding_backend llguidance needs the tokenizer string (tokenizer.json)")
        if stop is not None and len(stop) != 1:
            raise ValueError(f"guided_decoding_backend llguidance takes one stop token, not {len(stop)} ({stop})")
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            info["tokenizer_str"], n_vocab=vocab_size, eos_token=None if stop is None else stop[0]
        )

    def compile(self, guide: Guide) -> str:
        """The validated grammar text of ``guide`` (llguidance compiles it lazily, in each matcher)."""
        from llguidance import LLMatcher

        kind = guide.guide_type
        if kind is GuideType.STRUCTURAL_TAG:
            raise GuideError("the llguidance backend takes no structural_tag guide (use xgrammar)")
        if kind is GuideType.JSON_SCHEMA:
            json.loads(guide.guide)  # a schema that is not JSON: say so
        grammar = {
            GuideType.JSON: lambda: LLMatcher.grammar_from_json_schema('{"type": "object"}'),
            GuideType.JSON_SCHEMA: lambda: LLMatcher.grammar_from_json_schema(guide.guide),
            GuideType.REGEX: lambda: LLMatcher.grammar_from_regex(guide.guide),
            GuideType.EBNF_GRAMMAR: lambda: LLMatcher.grammar_from_lark(guide.guide),  # Lark, as upstream reads it
        }[kind]()
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, grammar: str) -> LLGuidanceMatcher:
        from llguidance import LLMatcher

        m = LLMatcher(self._tokenizer, grammar)
        if m.is_error():
            raise GuideError(f"llguidance matcher error: {m.get_error()}")
        return LLGuidanceMatcher(m, self._tokenizer.eos_token, self.vocab_size)


# LlmArgs.guided_decoding_backend (None: off) -> its backend
BACKENDS = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}


@dataclass
class GuidedDecoder:
    """An executor's guided decoding: the backend, the compile cache, the counters. ``info`` is the tokenizer
    information as :func:`upstream_tokenizer_info` makes it, ``vocab_size`` the model's (padded) vocabulary."""

    backend: str
    info: dict[str, Any]
    vocab_size: int
    cache_entries: int = CACHE_ENTRIES
    stats: GuidedStats = field(default_factory=GuidedStats)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"guided_decoding_backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        self._backend = BACKENDS[self.backend](self.info, self.vocab_size)
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # compiles run on the executor thread; stats are read by the server

    @classmethod
    def from_tokenizer(cls, backend: Optional[str], tokenizer, vocab_size: int) -> Optional["GuidedDecoder"]:
        """The decoder of a served model's HF tokenizer (None when the backend is unset)."""
        if not backend:
            return None
        return cls(backend, upstream_tokenizer_info(tokenizer), vocab_size)

    def compile(self, guide: Guide):
        """The compiled grammar of ``guide`` (cached); :class:`GuideError` with xgrammar's reason if it fails."""
        key = (self.backend, guide.guide_type, guide.guide)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return self._cache[key]
        t0 = time.perf_counter()
        try:
            compiled = self._backend.compile(guide)
        except Exception as exc:  # the backends raise RuntimeError / ValueError / their own errors for a bad guide
            with self._lock:
                self.stats.failed_guides += 1
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GuideError(f"invalid {guide.guide_type.value} guide: {reason}") from exc
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - t0
            self._cache[key] = compiled
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, guide: Guide):
        """A fresh matcher for one request (counted as a constrained request)."""
        m = self._backend.matcher(self.compile(guide))
        with self._lock:
            self.stats.constrained_requests += 1
        return m

    def snapshot(self) -> GuidedStats:
        """A copy of the counters, taken under the lock."""
        with self._lock:
            return GuidedStats(**vars(self.stats))

    def prometheus_lines(self, labels: str) -> list[str]:
        """The counters in Prometheus text format (``trtpipe_guided_*``; trtllm-serve exports none of its own)."""
        s = self.snapshot()
        out = []
        for name, attr, _ in COUNTERS:
            out += [f"# TYPE {name} counter", f"{name}{{{labels}}} {getattr(s, attr)}"]
        return out


# --- the OpenAI front end's response_format ----------------------------------------------------------------------

RESPONSE_FORMAT_FIELDS = ("type", "schema", "json_schema", "regex", "ebnf", "format")  # ResponseFormat's fields
RESPONSE_FORMAT_TYPES = ("text", "json", "json_schema", "json_object", "regex", "ebnf", "structural_tag")


def response_format_guide(rf: Any) -> Optional[Guide]:
    """trtllm-serve's ``_response_format_to_guided_decoding_params`` (``tensorrt_llm/serve/openai_protocol.py``
    @0076e939) then :meth:`GuidedDecodingParams.guide`: ``text`` (or none) is no guide; ``json`` takes ``schema``;
    ``json_schema`` takes ``json_schema``, unwrapping OpenAI's ``{"name", "schema", "strict"}`` wrapper to its
    ``schema``; ``json_object``, ``regex``, ``ebnf``; ``structural_tag`` is the whole format object as JSON
    (``model_dump_json(exclude_none=True)``). ``strict`` needs nothing more: xgrammar compiles schemas in strict
    mode. A malformed format is a :class:`GuideError` with upstream's wording."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise GuideError("response_format must be an object with a 'type'")
    extra = sorted(set(rf) - set(RESPONSE_FORMAT_FIELDS))
    if extra:
        raise GuideError(f"response_format.{extra[0]}: extra inputs are not permitted")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise GuideError(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    need = {"json": "schema", "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}.get(kind)
    if need and rf.get(need) is None:
        raise GuideError(f"response_format.{need} is required for response_format.type == {kind!r}, but got None.")
    if kind == "text":
        return None
    if kind == "json":
        params = GuidedDecodingParams(json=_schema_object(rf["schema"], "schema"))
    elif kind == "json_schema":
        schema = rf["json_schema"]
        if isinstance(schema, dict) and "schema" in schema:  # OpenAI's wrapper: {"name", "schema", "strict"}
            schema = schema["schema"]
        params = GuidedDecodingParams(json=_schema_object(schema, "json_schema"))
    elif kind == "json_object":
        params = GuidedDecodingParams(json_object=True)
    elif kind == "regex":
        params = GuidedDecodingParams(regex=_text(rf["regex"], "regex"))
    elif kind == "ebnf":
        params = GuidedDecodingParams(grammar=_text(rf["ebnf"], "ebnf"))
    else:
        if not isinstance(rf.get("format"), dict):
            raise GuideError("response_format.format is required for response_format.type == 'structural_tag'")
        params = GuidedDecodingParams(structural_tag=json.dumps({k: v for k, v in rf.items() if v is not None}))
    return params.guide()


def _schema_object(schema: Any, key: str) -> dict:
    if not isinstance(schema, dict):
        raise GuideError(f"response_format.{key} must be a JSON schema object")
    return schema


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise GuideError(f"response_format.{key} must be a non-empty string")
    return value
