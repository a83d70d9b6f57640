"""Tool-call and reasoning parsers: one table of their names per runtime, and each family's defaults.

A served model's output is split into ``content``, ``reasoning_content`` and ``tool_calls`` by a parser the
server is started with: ``trtllm-serve --tool_parser NAME --reasoning_parser NAME``, or a Dynamo worker's
``--dyn-tool-call-parser NAME --dyn-reasoning-parser NAME`` (Dynamo parses in its Rust frontend, for every
backend). The names differ between the two, and between releases, so each row here is one parser with its spelling
in each runtime (``None``: that runtime has no such parser). The recipe's ``serving.tool_parser`` /
``serving.reasoning_parser`` take a row's ``name`` (TensorRT-LLM's spelling where TensorRT-LLM has the parser).

Sources:

- TensorRT-LLM tool parsers: ``ToolParserFactory.parsers`` in
  ``tensorrt_llm/serve/tool_parser/tool_parser_factory.py@34eff6ae`` (NVIDIA/TensorRT-LLM): qwen3, qwen3_coder,
  kimi_k2, deepseekv3, deepseekv3.1, deepseek_v32. Reasoning parsers: ``@register_reasoning_parser("deepseek-r1",
  reasoning_at_start=True)`` and ``("qwen3")`` on ``DeepSeekR1Parser`` in
  ``tensorrt_llm/llmapi/reasoning_parser.py@033a9d09``, the two keys every revision read registers. UNCONFIRMED:
  that these are exactly the tables of the v1.2.1 tag (``release/1.2.1``, the tag the Triton 26.07 image builds,
  triton-inference-server/tensorrtllm_backend ``dockerfile/Dockerfile.triton.trt_llm_backend``): the tag's tree
  could not be read here. Later revisions rename ``deepseekv3`` to ``deepseek_v3`` and add more; 1.2's may hold
  keys this table lacks (validation then refuses a name the release has, never the reverse).
- Dynamo: the ai-dynamo 1.6.1 wheel's own lists, ``dynamo._core.get_tool_parser_names()`` and
  ``get_reasoning_parser_names()`` (the ``choices`` of ``--dyn-tool-call-parser`` / ``--dyn-reasoning-parser`` in
  its ``dynamo/common/configuration/groups/runtime_args.py``); ``tests/models/test_parsers.py`` checks the table
  against the installed wheel.
- gpt-oss: trtllm-serve answers gpt-oss through ``openai_harmony`` (``tensorrt_llm/serve/harmony_adapter.py@02238b67``),
  not through a ``--tool_parser`` name, so its rows have no TensorRT-LLM spelling; it runs them by itself for a
  gpt-oss model (``builtin``).

Family defaults follow TensorRT-LLM's own ``auto`` mapping of a later revision (``MODEL_TYPE_TO_TOOL_PARSER`` /
``MODEL_TYPE_TO_REASONING_PARSER``, ``tool_parser_factory.py@c56ef99a`` in KleinBlueC/TensorRT-LLM, a fork of it):
Qwen2/Qwen3 -> qwen3 (reasoning qwen3 for Qwen3 only), Kimi-K2 -> kimi_k2, DeepSeek-V3 -> its tool parser, with the deepseek-r1
reasoning parser only when the model's name says R1; Llama 3.x and gpt-oss have no TensorRT-LLM 1.2 tool parser,
and take Dynamo's ``llama3_json`` / ``harmony`` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TRTLLM_RELEASE = "1.2"  # the llmapi target's release these names were read for
DYNAMO_RELEASE = "1.6.1"
OFF = "none"  # a recipe's way to turn a family default off


@dataclass(frozen=True)
class Parser:
    """One parser: trtpipe's name, its spelling in trtllm-serve 1.2 and in Dynamo 1.6.1 (None: absent), whether the
    OpenAI twin runs it (:mod:`trtpipe.serving.tool_calls`, :mod:`trtpipe.serving.reasoning`), and whether
    trtllm-serve runs it without a flag for the family it belongs to."""

    name: str
    trtllm: Optional[str]
    dynamo: Optional[str]
    twin: bool = False
    builtin: bool = False


TOOL_PARSERS: tuple[Parser, ...] = (
    Parser("qwen3", "qwen3", "qwen3", twin=True),
    Parser("qwen3_coder", "qwen3_coder", "qwen3_coder", twin=True),
    Parser("kimi_k2", "kimi_k2", "kimi_k2", twin=True),
    Parser("deepseekv3", "deepseekv3", "deepseek_v3", twin=True),
    Parser("deepseekv3.1", "deepseekv3.1", "deepseek_v3_1", twin=True),
    Parser("deepseek_v32", "deepseek_v32", "deepseek_v3_2", twin=True),
    Parser("llama3_json", None, "llama3_json", twin=True),
    Parser("harmony", None, "harmony", twin=True, builtin=True),
)
REASONING_PARSERS: tuple[Parser, ...] = (
    Parser("deepseek-r1", "deepseek-r1", "deepseek_r1", twin=True),
    Parser("qwen3", "qwen3", "qwen3", twin=True),
    Parser("gpt_oss", None, "gpt_oss", twin=True, builtin=True),
)
TABLES = {"tool_parser": TOOL_PARSERS, "reasoning_parser": REASONING_PARSERS}

# HF model_type -> (tool parser, reasoning parser) by default (None: none)
FAMILY_DEFAULTS: dict[str, tuple[Optional[str], Optional[str]]] = {
    "qwen2": ("qwen3", None),
    "qwen3": ("qwen3", "qwen3"),
    "qwen3_moe": ("qwen3", "qwen3"),
    "deepseek_v3": ("deepseekv3", "deepseek-r1"),  # reasoning only for an R1 model (see default_parsers)
    "kimi_k2": ("kimi_k2", None),
    "llama": ("llama3_json", None),  # Llama 3.x only (see default_parsers): Llama 2 has no tool-call format
    "gpt_oss": ("harmony", "gpt_oss"),
}


def by_name(kind: str, name: str) -> Optional[Parser]:
    """The row of ``name`` in the ``kind`` table (``tool_parser`` or ``reasoning_parser``), or None."""
    return next((p for p in TABLES[kind] if p.name == name), None)


def names(kind: str, runtime: Optional[str] = None) -> list[str]:
    """trtpipe's names of the ``kind`` parsers ``runtime`` has (``trtllm``, ``dynamo``, ``twin``; None: any)."""
    return [p.name for p in TABLES[kind] if runtime is None or getattr(p, runtime)]


LLAMA3_VOCAB = 128256  # Llama 3.0-3.3's tokenizer: what tells a Llama 3.x from a Llama 2 of the same model_type


def default_parsers(model_type: str, model_name: str = "", vocab_size: int = 0) -> tuple[Optional[str], Optional[str]]:
    """(tool, reasoning) parser names a family gets when the recipe names none.

    DeepSeek-V3 and R1 share ``model_type: deepseek_v3``; as TensorRT-LLM's ``resolve_auto_reasoning_parser``
    does, only a model whose name holds ``r1`` gets the deepseek-r1 reasoning parser. Llama 2 and 3 share
    ``model_type: llama``; only Llama 3's vocabulary (:data:`LLAMA3_VOCAB`) gets Llama 3's JSON tool calls."""
    if model_type == "llama" and vocab_size != LLAMA3_VOCAB:
        return None, None
    tool, reasoning = FAMILY_DEFAULTS.get(model_type, (None, None))
    if model_type == "deepseek_v3" and "r1" not in model_name.lower():
        reasoning = None
    return tool, reasoning


def resolve(
    kind: str, written: Optional[str], model_type: str, model_name: str = "", vocab_size: int = 0
) -> Optional[Parser]:
    """The parser a deployment runs: the recipe's name (``none``: off), else the family default."""
    if written == OFF:
        return None
    if written is None:
        tool, reasoning = default_parsers(model_type, model_name, vocab_size)
        written = tool if kind == "tool_parser" else reasoning
    return by_name(kind, written) if written else None


def problem(kind: str, written: Optional[str], trtllm_version: str) -> Optional[str]:
    """Why ``serving.<kind>: written`` cannot be deployed (one line naming the allowed names), or None."""
    if written is None or written == OFF:
        return None
    row = by_name(kind, written)
    if row is None:
        return (
            f"{written!r} is not a {kind.replace('_', ' ')} of TensorRT-LLM {TRTLLM_RELEASE} or Dynamo "
            f"{DYNAMO_RELEASE}; one of: {', '.join(names(kind))}, or {OFF}"
        )
    if trtllm_version != TRTLLM_RELEASE:
        return f"parser names are known for TensorRT-LLM {TRTLLM_RELEASE} only (llmapi.version is {trtllm_version})"
    if row.trtllm is None:
        return (
            f"{written!r} is not in TensorRT-LLM {TRTLLM_RELEASE}'s trtllm-serve (it has: "
            f"{', '.join(names(kind, 'trtllm'))}); leave it unset to give Dynamo workers the family's default"
        )
    return None
