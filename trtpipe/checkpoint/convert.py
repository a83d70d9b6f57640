"""HF -> TensorRT-LLM checkpoint conversion, as passes over one layer at a time.

    read (hf.HFReader)  ->  unsharded TRT-LLM tensors (rename + fuse: ``unsharded_layer``)
        ->  [optional transform, e.g. quantization]  ->  per-rank shards (``shard_for_rank``)
        ->  streaming write (writer.RankFile)

The same passes first run on ``meta`` tensors to plan every rank file's header and to find missing,
extra or mis-shaped tensors before any byte is written. Memory: one layer's fused tensors (views of
the mmapped source wherever possible), never the model.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from trtpipe.checkpoint.experts import ExpertParts, streams
from trtpipe.checkpoint.hf import FLOATS, HFReader, open_hf
from trtpipe.checkpoint.quant_layouts import SHARED_BY_EXPERTS
from trtpipe.checkpoint.shard import Layout, pp_layers, split_experts, split_linear_tensor, split_vocab
from trtpipe.checkpoint.writer import RankFile, atomic_dir, return_large_buffers, write_json, write_parts, write_same
from trtpipe.errors import CheckpointError
from trtpipe.models import Family, Rule, get_family
from trtpipe.models.family import shape_symbols
from trtpipe.models.dims import ModelDims, read_hf_config
from trtpipe.models.trtllm_config import build_config, resolve_dtype
from trtpipe.formats import mxfp4

LAYER = "transformer.layers.{}."
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.tiktoken",
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# A transform maps one unit's unsharded tensors (full TRT-LLM names) to new ones, e.g. quantization.
Transform = Callable[[dict[str, torch.Tensor], "ConversionPlan", Optional[int]], dict[str, torch.Tensor]]


@dataclass
class ConversionPlan:
    """Everything decided before reading weights: the family, dims, dtype, mapping and config.json."""

    info: ModelDims
    family: Family
    dtype: str
    tp: int
    pp: int
    layout: Layout
    config: dict
    rules: dict[str, Rule] = field(default_factory=dict)  # relative TRT-LLM tensor name -> its rule

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def rule_for(self, name: str) -> tuple[Optional[Rule], str]:
        """(rule of tensor ``name``, or of its module's weight for tensors a transform adds; suffix)."""
        rel = _relative(name)
        module, _, suffix = rel.rpartition(".")
        return self.rules.get(rel) or self.rules.get(module + ".weight"), suffix

    def ranks_of(self, name: str) -> list[int]:
        """Ranks whose file holds ``name`` (its PP stage's tp ranks)."""
        layer = _layer_index(name)
        if layer is not None:
            stage = next(p for p in range(self.pp) if layer in pp_layers(self.info.num_layers, self.pp, p))
        else:
            stage = 0 if name.startswith("transformer.vocab_embedding") else self.pp - 1
        return list(range(stage * self.tp, (stage + 1) * self.tp))


def _layer_index(name: str) -> Optional[int]:
    if not name.startswith("transformer.layers."):
        return None
    return int(name.split(".")[2])


def _relative(name: str) -> str:
    return ".".join(name.split(".")[3:]) if _layer_index(name) is not None else name


def make_plan(
    model_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "auto",
    moe_tp: int = -1,
    moe_ep: int = -1,
    use_parallel_embedding: bool = False,
    embedding_sharding_dim: int = 0,
    source_dtype: Optional[str] = None,
    attention_dp: bool = False,
) -> ConversionPlan:
    """Decide the conversion from config.json alone; errors for impossible tp/pp before any weight is read."""
    info = read_hf_config(model_dir)
    family = get_family(info.architecture)
    if pp > info.num_layers:
        raise CheckpointError(f"pp={pp} is larger than num_hidden_layers={info.num_layers}")
    dtype = resolve_dtype(dtype, source_dtype or info.torch_dtype)
    config = build_config(
        info, family, dtype, tp, pp, moe_tp, moe_ep, use_parallel_embedding, embedding_sharding_dim, attention_dp
    )
    use_parallel_embedding, embedding_sharding_dim = config["use_parallel_embedding"], config["embedding_sharding_dim"]
    m = config["mapping"]
    layout = Layout(
        info.num_heads,
        info.num_kv_heads,
        info.head_dim,
        tp,
        info.num_experts if info.is_moe else 0,
        m["moe_tp_size"],
        m["moe_ep_size"],
        use_parallel_embedding,
        embedding_sharding_dim,
        attention_dp,
    )
    layout.check()
    rules = {rule.trt: rule for rule in family.global_rules + family.layer_rules if rule.when(info)}
    return ConversionPlan(info, family, dtype, tp, pp, layout, config, rules)


# --- pass 1: rename + fuse ----------------------------------------------------------------------


def _sources(rule: Rule, info: ModelDims, prefix: str) -> list[list[str]]:
    """HF names per source of a rule (one per expert for ``{e}`` sources)."""
    if "experts" in rule.combine:
        return [[prefix + h.format(e=e) for e in range(info.num_experts)] for h in rule.hf]
    return [[prefix + h] for h in rule.hf]


def _expected(rule: Rule, info: ModelDims, i: int) -> tuple[int, ...]:
    d = shape_symbols(info)
    return tuple(d[s] for s in rule.shapes[i])


def _fetch(reader: HFReader, name: str, expected: tuple[int, ...], meta: bool, info: ModelDims) -> torch.Tensor:
    if name not in reader:
        raise CheckpointError(f"{reader.dir}: tensor '{name}' is missing (needed for {info.architecture})")
    shape = reader.shape(name)
    if tuple(shape) != expected:
        raise CheckpointError(
            f"{reader.dir}: tensor '{name}' has shape {list(shape)} but config.json implies {list(expected)}"
        )
    return reader.meta(name) if meta else reader.get(name)


def up_first(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up rows on dim 1 ([E, 2I, ...] or a [E, 2I] bias; gate = even, up = odd) -> [up; gate]."""
    return torch.cat([t[:, 1::2], t[:, 0::2]], dim=1)


def interleaved(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`up_first`: [up; gate] on dim 1 -> gate/up interleaved (gate = even, up = odd)."""
    up, gate = t.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def transposed(t: torch.Tensor) -> torch.Tensor:
    """Fused experts stored in -> out ([E, in, out]) <-> [E, out, in]; a [E, n] bias is returned as it is."""
    return _transposed(t)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2) if t.dim() == 3 else t  # [E, in, out] -> [E, out, in]; a [E, n] bias as it is


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decoded experts [E, out, in] in float32 (exact: MXFP4 values are float32 numbers); meta in, meta out."""
    if blocks.is_meta:
        return torch.empty(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2, device="meta")
    return mxfp4.dequantize(blocks, scales)


# Combine op (a Rule's ``combine``) -> fn(parts) where parts[i] lists source i's tensors (one per expert for {e}).
COMBINERS: dict[str, Callable[[list[list[torch.Tensor]]], torch.Tensor]] = {
    "one": lambda parts: parts[0][0],
    "cat": lambda parts: torch.cat([p[0] for p in parts], dim=0),
    "experts": lambda parts: torch.stack(parts[0], dim=0),  # [E, out, in]
    "experts_cat": lambda parts: torch.cat([torch.stack(p, dim=0) for p in parts], dim=-2),
    "transposed": lambda parts: _transposed(parts[0][0]),
    "gate_up_t": lambda parts: up_first(_transposed(parts[0][0])),
    "mxfp4": lambda parts: _mxfp4(parts[0][0], parts[1][0]),
    "mxfp4_gate_up": lambda parts: up_first(_mxfp4(parts[0][0], parts[1][0])),
}


def _combine(rule: Rule, parts: list[list[torch.Tensor]]) -> torch.Tensor:
    return COMBINERS[rule.combine](parts)


def _iter_rules(
    rules,
    reader: HFReader,
    plan: ConversionPlan,
    hf_prefix: str,
    trt_prefix: str,
    meta: bool,
    used: Optional[set],
    stream_experts: bool = False,
    layer: Optional[int] = None,
):
    """Yield (TRT-LLM name, unsharded tensor, HF source names), one rule at a time (of decoder ``layer``'s kind).

    With ``stream_experts`` a fused expert weight comes as :class:`ExpertParts` (the parts, not the stack)."""
    for rule in rules:
        if not rule.at(plan.info, layer):
            continue
        names = _sources(rule, plan.info, plan.info.weight_prefix + hf_prefix)
        parts = [
            [_fetch(reader, n, _expected(rule, plan.info, i), meta, plan.info) for n in group]
            for i, group in enumerate(names)
        ]
        if used is not None:
            used.update(n for group in names for n in group)
        if stream_experts and not meta and streams(rule, parts):
            yield (
                trt_prefix + rule.trt,
                ExpertParts(tuple(map(tuple, parts)), tuple(map(tuple, names))),
                [n for group in names for n in group],
            )
            continue
        t = _combine(rule, parts)
        if rule.offset and not meta:  # in float32, before the writer's cast to the checkpoint dtype
            t = t.float() + rule.offset
        if not meta and rule.combine != "one":
            for group in parts:  # the fused copy holds the data now
                for part in group:
                    reader.drop_pages(part)
        yield trt_prefix + rule.trt, t, [n for group in names for n in group]


def _unit_iter(reader, plan, unit, meta, used=None, importer=None, stream_experts=False):
    if isinstance(unit, int):
        rules = plan.family.layer_rules
        if importer is not None:  # a pre-quantized source: its quantized linears come from the importer
            owned = [r for r in rules if r.at(plan.info, unit) and importer.owns(plan, r, unit)]
            rules = [r for r in rules if r not in owned]
        yield from _iter_rules(
            rules,
            reader,
            plan,
            plan.family.hf_layer_prefix.format(unit),
            LAYER.format(unit),
            meta,
            used,
            stream_experts,
            unit,
        )
        if importer is not None:
            yield from importer.layer_tensors(reader, plan, unit, owned, meta, used, stream_experts)
        return
    embed = unit == "embedding"
    rules = [r for r in plan.family.global_rules if r.trt.startswith("transformer.vocab_embedding") == embed]
    yield from _iter_rules(rules, reader, plan, "", "", meta, used)


def unsharded_layer(
    reader: HFReader, plan: ConversionPlan, layer: int, meta: bool = False, used: Optional[set] = None
) -> dict[str, torch.Tensor]:
    """One decoder layer's TRT-LLM tensors before sharding, full names ``transformer.layers.{layer}.*``.

    Tensors keep the source dtype (views of the file where no fusion is needed); the writer casts.
    """
    return {name: t for name, t, _ in _unit_iter(reader, plan, layer, meta, used)}


# --- pass 2: shard --------------------------------------------------------------------------------


def _moe(style: str):
    def split(t, suffix, plan, tp_rank, what):
        lay = plan.layout
        experts = lay.num_experts // lay.moe_ep
        if suffix not in SHARED_BY_EXPERTS:  # a [in] scale of all experts has no expert axis, even where in == E
            t = split_experts(t, tp_rank, lay, what)
        inter = plan.info.intermediate_size
        sections = (inter, inter) if style == "column" else ()
        return split_linear_tensor(t, suffix, style, tp_rank, lay, sections=sections, experts=experts, what=what)

    return split


def _embedding(t, suffix, plan, tp_rank, what):
    lay = plan.layout
    return split_vocab(t, tp_rank, lay.tp, dim=lay.embedding_sharding_dim) if lay.use_parallel_embedding else t


def _linear(style: str):
    return lambda t, suffix, plan, tp_rank, what: split_linear_tensor(t, suffix, style, tp_rank, plan.layout, what=what)


# Split style (a Rule's ``split``) -> fn(tensor, suffix, plan, tp_rank, what) returning the rank's shard.
SPLITTERS = {
    "replicate": lambda t, suffix, plan, tp_rank, what: t,
    "column": _linear("column"),
    "row": _linear("row"),
    "qkv": _linear("qkv"),
    "vocab": lambda t, suffix, plan, tp_rank, what: t if t.numel() == 1 else split_vocab(t, tp_rank, plan.layout.tp),
    "embedding": _embedding,
    "moe_fc": _moe("column"),
    "moe_proj": _moe("row"),
}


MOE_SPLITS = ("moe_fc", "moe_proj")  # the routed experts: split by moe_ep x moe_tp whatever the attention does


def _split(
    t: torch.Tensor, rule: Optional[Rule], suffix: str, plan: ConversionPlan, tp_rank: int, what: str
) -> torch.Tensor:
    """One rank's shard; tensors no rule owns (e.g. a KV-cache scale a transform adds) are replicated, and so is
    every tensor but the routed experts' under attention data parallel."""
    split = rule.split if rule else "replicate"
    if plan.layout.attention_dp and split not in MOE_SPLITS:
        split = "replicate"
    return SPLITTERS[split](t, suffix, plan, tp_rank, what)


def local_name(name: str, plan: ConversionPlan) -> str:
    """Per-PP-rank name: layer indices are local to the stage."""
    layer = _layer_index(name)
    if layer is None:
        return name
    stage = next(p for p in range(plan.pp) if layer in pp_layers(plan.info.num_layers, plan.pp, p))
    first = pp_layers(plan.info.num_layers, plan.pp, stage).start
    return LAYER.format(layer - first) + _relative(name)


def shard_for_rank(tensors: dict[str, torch.Tensor], plan: ConversionPlan, rank: int) -> dict[str, torch.Tensor]:
    """The tensors of ``rank`` (tp fastest, then pp) out of unsharded ones, under their local names."""
    out = {}
    for name, t in tensors.items():
        if rank not in plan.ranks_of(name):
            continue
        rule, suffix = plan.rule_for(name)
        out[local_name(name, plan)] = _split(t, rule, suffix, plan, rank % plan.tp, name)
    return out


def target_dtype(name: str, t: torch.Tensor, plan: ConversionPlan) -> torch.dtype:
    """Tensors produced by the family rules take the model dtype (or the rule's); others keep theirs."""
    rule, suffix = plan.rule_for(name)
    if rule is None or t.dtype not in FLOATS or suffix not in ("weight", "bias"):
        return t.dtype
    return DTYPES[rule.dtype or plan.dtype]


# --- driver ---------------------------------------------------------------------------------------


def _units(plan: ConversionPlan):
    yield "embedding"
    yield from range(plan.info.num_layers)
    yield "head"


def _unit_tensors(reader, plan, unit, meta, used=None, importer=None) -> dict[str, torch.Tensor]:
    return {name: t for name, t, _ in _unit_iter(reader, plan, unit, meta, used, importer)}


def _check_extra(reader: HFReader, plan: ConversionPlan, used: set) -> None:
    ignored = plan.family.ignored + (("lm_head.weight",) if plan.info.tie_word_embeddings else ())
    # multi-token-prediction layers after the decoder's (DeepSeek-V3 num_nextn_predict_layers): not converted
    info = plan.info
    mtp = tuple(
        info.weight_prefix + plan.family.hf_layer_prefix.format(info.num_layers + i) for i in range(info.mtp_layers)
    )
    skipped = plan.family.ignored_prefixes + mtp
    for name in reader.keys():
        if name not in used and not any(name.endswith(s) for s in ignored) and not name.startswith(skipped):
            raise CheckpointError(
                f"{reader.dir}: tensor '{name}' is not part of the {plan.info.architecture} mapping "
                f"(extra tensor, or config.json does not match the weights)"
            )


def plan_files(
    reader: HFReader, plan: ConversionPlan, transform: Optional[Transform] = None, importer=None
) -> list[list]:
    """Per rank, the ``(name, dtype, shape)`` entries of its file, by running the passes on meta tensors."""
    used: set = set()
    entries: list[list] = [[] for _ in range(plan.world_size)]
    for unit in _units(plan):
        tensors = _unit_tensors(reader, plan, unit, True, used, importer)
        if transform is not None:
            tensors = transform(tensors, plan, unit if isinstance(unit, int) else None)
        for rank in range(plan.world_size):
            for name, t in shard_for_rank(tensors, plan, rank).items():
                entries[rank].append((name, target_dtype(name, t, plan), tuple(t.shape)))
    _check_extra(reader, plan, used)
    return entries


def copy_tokenizer(model_dir: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer files and generation_config.json (the repo stage reads them from the checkpoint)."""
    copied = []
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
            copied.append(name)
    return copied


def convert(
    model_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "auto",
    moe_tp: int = -1,
    moe_ep: int = -1,
    allow_pickle: bool = False,
    use_parallel_embedding: bool = False,
    embedding_sharding_dim: int = 0,
    transform: Optional[Transform] = None,
    config_update: Optional[dict] = None,
    workers: Optional[int] = None,
    overwrite: bool = False,
    progress: Optional[Callable[[int, int], None]] = None,
    importer=None,
    attention_dp: bool = False,
) -> Path:
    """Convert an HF model directory into a TRT-LLM checkpoint at ``out_dir`` (written atomically).

    Without a transform, tensors stream one at a time (peak memory ~ the largest fused tensor); with one,
    a whole layer is materialized for it.

    Args:
        transform: optional pass between fusion and sharding (quantization): ``fn(tensors, plan, layer)``
            with ``layer`` None for the embedding/head units. It must also accept meta tensors, because
            the header plan runs the same passes on them.
        config_update: merged into config.json (e.g. the ``quantization`` dict a transform implies).
        workers: threads writing rank files in parallel (default: min(world_size, 4)).
        progress: called with (units done, units total).
        attention_dp: every rank holds whole attention, dense and shared-expert weights, the embedding and
            lm_head; only the routed experts are split (``mapping.enable_attention_dp`` in config.json).
        importer: ``fn(plan, reader) ->`` the linear source of a pre-quantized checkpoint
            (:class:`trtpipe.quant.imported.trtllm.ImportedLinears`): its quantized linears are taken from it
            already fused (codes and scales, never dequantized) and its ``quantization()`` goes into config.json.
    Returns:
        out_dir.
    Raises:
        CheckpointError: naming the tensor or key; nothing is left at ``out_dir``.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    return_large_buffers()  # peak memory flat in the number of layers (see its docstring)
    with (
        atomic_dir(out_dir, overwrite) as tmp,
        open_hf(model_dir, allow_pickle, check_finite=transform is not None) as reader,
    ):
        first = plan_first_source(model_dir, reader)
        plan = make_plan(
            model_dir,
            tp,
            pp,
            dtype,
            moe_tp,
            moe_ep,
            use_parallel_embedding,
            embedding_sharding_dim,
            source_dtype=str(first).replace("torch.", ""),
            attention_dp=attention_dp,
        )
        linears = importer(plan, reader) if importer is not None else None
        if linears is not None and transform is not None:
            raise CheckpointError(f"{model_dir}: a pre-quantized checkpoint is not quantized again")
        entries = plan_files(reader, plan, transform, linears)
        files = [RankFile(tmp / f"rank{r}.safetensors", entries[r]) for r in range(plan.world_size)]
        units = list(_units(plan))
        with ThreadPoolExecutor(max_workers=workers or min(plan.world_size, 4)) as pool:
            for done, unit in enumerate(units, 1):
                if transform is None:
                    parts = _unit_iter(reader, plan, unit, False, None, linears, stream_experts=True)
                    for name, t, sources in parts:
                        if isinstance(t, ExpertParts):
                            _write_experts(pool, files, reader, plan, name, t)
                        else:
                            _write_tensor(pool, files, reader, plan, name, t, _what(reader, name, sources))
                else:
                    tensors = transform(
                        _unit_tensors(reader, plan, unit, False), plan, unit if isinstance(unit, int) else None
                    )
                    for name, t in tensors.items():
                        _write_tensor(pool, files, reader, plan, name, t, None)
                    del tensors
                reader.release()
                if progress:
                    progress(done, len(units))
        for f in files:
            f.close()
        config = dict(plan.config)
        if linears is not None:
            config["quantization"] = linears.quantization()
        if config_update:
            config.update(config_update)
        write_json(tmp / "config.json", config)
        copy_tokenizer(model_dir, tmp)
    return out_dir


def _what(reader: HFReader, name: str, sources: list[str]) -> str:
    if len(sources) == 1:
        return f"{reader.dir}: tensor '{sources[0]}'"
    return f"{reader.dir}: tensors {', '.join(repr(s) for s in sources)} (fused into {name})"


def _write_tensor(pool, files, reader, plan, name, t, what) -> None:
    """Shard ``t`` for each rank holding it and write the shards in parallel; data is checked once."""
    rule, suffix = plan.rule_for(name)
    ranks = plan.ranks_of(name)
    local = local_name(name, plan)

    shards = {r: _split(t, rule, suffix, plan, r % plan.tp, name) for r in ranks}  # views, or small copies
    same = [r for r in ranks if shards[r] is t]
    jobs = []
    if same:  # replicated: read each chunk once, write it to every rank file
        jobs.append(pool.submit(write_same, [files[r] for r in same], local, t, what, reader.drop_pages))
    for r in ranks:
        if shards[r] is not t:
            jobs.append(pool.submit(files[r].write, local, shards[r], what, reader.drop_pages))
    for job in jobs:
        job.result()


def _write_experts(pool, files, reader, plan, name, experts: ExpertParts) -> None:
    """Each rank's shard of a fused expert weight, written part by part from the source views (no stack)."""
    rule, _ = plan.rule_for(name)
    local = local_name(name, plan)
    jobs = []
    for r in plan.ranks_of(name):
        parts = experts.rank_parts(plan.layout, r % plan.tp, rule.split)
        jobs.append(pool.submit(write_parts, files[r], local, parts, f"{reader.dir}: tensor", reader.drop_pages))
    for job in jobs:
        job.result()


def plan_first_source(model_dir: Path, reader: HFReader) -> torch.dtype:
    """dtype of the source weights (for dtype auto): the embedding's, else the first tensor's."""
    for name in ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight"):
        if name in reader:
            return reader.dtype(name)
    keys = reader.keys()
    if not keys:
        raise CheckpointError(f"{model_dir}: the checkpoint holds no tensors")
    return reader.dtype(keys[0])
