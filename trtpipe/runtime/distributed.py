"""The reference runtime with one OS process per rank: each process loads only its ``rank{N}.safetensors``.

Why: :class:`~trtpipe.runtime.model.ReferenceModel` runs every rank's shards in one process, which checks the
numbers of a tp/pp layout but not what serving it takes. Here rank ``N = pp_rank * tp + tp_rank`` (TensorRT-LLM's
``Mapping``) holds one tensor-parallel shard of its pipeline stage's layers, and the ranks talk through MPI
(mpi4py, the MPI library of the ``mpiexec`` that launched them):

- tensor parallel: the row-parallel partials (attention ``dense``, ``mlp.proj``) are all-reduced within the stage,
  the column-parallel ``lm_head`` is all-gathered;
- pipeline parallel: stage p sends its hidden states to stage p+1 (tp rank t to tp rank t); the last stage sends
  the logits rows to global rank 0, which samples.

Every rank calls :meth:`RankModel.forward` with the same arguments (rank 0 broadcasts them, see
:mod:`trtpipe.serving.mpi_engine`); only global rank 0 gets logits back.

Attention data parallel (``mapping.enable_attention_dp``, pp 1): each rank runs its own requests through whole
attention, dense and shared-expert weights and its own KV, and gets its own logits; the MoE layers exchange tokens
(:meth:`Comm.moe_exchange`: every rank's tokens gathered, each rank's experts run on all of them, the outputs summed
back to the rank the tokens came from), as TensorRT-LLM's CUTLASS MoE does under attention DP
(NVIDIA/TensorRT-LLM@000a01de ``tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py``: ``allgather``,
``fused_moe``, ``reducescatter_or_allreduce``). The layers are the reference runtime's
own :class:`~trtpipe.runtime.model.DecoderLayer` built with one shard and an MPI all-reduce.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from trtpipe.checkpoint.shard import pp_layers
from trtpipe.errors import CheckpointError
from trtpipe.extras import require
from trtpipe.runtime.linear import Float32Linear, LinearSpec, build_linear, module_quant_algo
from trtpipe.runtime.loader import read_config, read_rank, with_prefix
from trtpipe.runtime.model import DecoderLayer, ModelArgs, rms_norm, rope_tables, softcap


def mpi():
    """mpi4py's MPI module, initialised for threads (rank 0 calls MPI from the executor's thread)."""
    require("mpi4py", "a tp/pp > 1 leader-mode job (mpiexec)").rc.thread_level = "multiple"
    return require("mpi4py.MPI", "a tp/pp > 1 leader-mode job (mpiexec)")


@dataclass(frozen=True)
class RankLayout:
    """Where one global rank sits in a tp x pp layout (TensorRT-LLM Mapping: rank = pp_rank * tp + tp_rank)."""

    tp: int
    pp: int
    rank: int

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def peer(self, pp_rank: int) -> int:
        """The rank of the same tp index on another pipeline stage."""
        return pp_rank * self.tp + self.tp_rank


class Comm:
    """The collectives a rank needs, over mpi4py buffers (torch's CPU build has no MPI backend).

    ``world`` is the job's communicator (COMM_WORLD); ``tp_comm`` the ranks of this rank's pipeline stage.
    """

    def __init__(self, layout: RankLayout, world=None):
        MPI = mpi()
        self.MPI = MPI
        self.world = world if world is not None else MPI.COMM_WORLD
        if self.world.Get_size() != layout.world:
            raise CheckpointError(
                f"the checkpoint needs {layout.world} ranks (tp {layout.tp} x pp {layout.pp}) but the MPI job has "
                f"{self.world.Get_size()} (launch with mpiexec -n {layout.world})"
            )
        self.layout = layout
        self.tp_comm = self.world.Split(color=layout.pp_rank, key=layout.tp_rank)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of the tp ranks' partials (float32), in place on a contiguous copy."""
        if self.layout.tp == 1:
            return t
        t = t.contiguous()
        self.tp_comm.Allreduce(self.MPI.IN_PLACE, t.numpy(), op=self.MPI.SUM)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate the tp ranks' column shards along the last dim ([..., n] -> [..., tp * n])."""
        if self.layout.tp == 1:
            return t
        t = t.contiguous()
        out = torch.empty((self.layout.tp,) + tuple(t.shape), dtype=t.dtype)
        self.tp_comm.Allgather(t.numpy(), out.numpy())
        return torch.cat(list(out), dim=-1)

    def moe_exchange(self, tokens: torch.Tensor, experts) -> torch.Tensor:
        """Attention DP's MoE: ``experts`` (this rank's) over every tp rank's ``tokens`` [n_r, H] (all-gather, any
        n_r including 0), then the sum of all ranks' outputs for this rank's rows (reduce-scatter)."""
        MPI, comm = self.MPI, self.tp_comm
        tokens = tokens.float().contiguous()
        hidden = tokens.shape[-1]
        counts = [int(n) * hidden for n in comm.allgather(int(tokens.shape[0]))]
        everyone = torch.empty(sum(counts) // hidden, hidden, dtype=torch.float32)
        comm.Allgatherv(tokens.numpy(), [everyone.numpy(), counts])
        out = experts(everyone).float().contiguous()
        mine = torch.empty_like(tokens)
        comm.Reduce_scatter(out.numpy(), mine.numpy(), recvcounts=counts, op=MPI.SUM)
        return mine

    def send(self, t: torch.Tensor, dest: int) -> None:
        self.world.Send(t.contiguous().numpy(), dest=dest, tag=7)

    def recv(self, shape: tuple, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        self.world.Recv(t.numpy(), source=src, tag=7)
        return t

    def bcast(self, obj):
        return self.world.bcast(obj, root=0)


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


class RankModel:
    """One rank's part of the model: its stage's layers (one tp shard each), the embedding on the first stage,
    ``ln_f`` and its ``lm_head`` slice on the last.

    ``forward`` is collective: every rank calls it with the same arguments.
    """

    def __init__(
        self,
        config: dict,
        args: ModelArgs,
        layout: RankLayout,
        comm: Comm,
        layers: list[DecoderLayer],
        embedding: Optional[torch.Tensor],
        ln_f: Optional[torch.Tensor],
        lm_head: Optional[torch.nn.Module],
        weight_bytes: int,
    ):
        self.config, self.args, self.layout, self.comm = config, args, layout, comm
        self.layers = layers
        self.embedding = embedding
        self.ln_f = ln_f
        self.lm_head = lm_head
        self.rope = args.rope()
        self.ropes = args.ropes()  # Gemma 3: a "local" rope for the sliding layers too
        self.weight_bytes = weight_bytes  # bytes of this rank's safetensors tensors (what it loaded)
        # rank 0 of a pp 1 job keeps the outputs of the layers ``capture`` names (FINAL = -1: after the final norm)
        # for a hidden-state drafter (trtpipe.serving.hidden_draft); ``captured``: the last forward's, [N, H x n]
        self.capture: tuple[int, ...] = ()
        self.captured: Optional[torch.Tensor] = None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache=None,
        start_pos: int | torch.Tensor = 0,
        rows: Optional[torch.Tensor] = None,
        cos_sin: Optional[tuple] = None,
    ) -> Optional[torch.Tensor]:
        """input_ids [B, T] at positions start_pos.. -> float32 logits on global rank 0 (None elsewhere).

        ``rows``: flat indices into the B*T positions whose logits are wanted (default: all, as [B, T, V]).
        ``cos_sin``: rope tables of every position (a packed step's tokens are not consecutive), per rope key.
        """
        lay, comm = self.layout, self.comm
        if self.args.attention_dp:
            return self._forward_own(input_ids, cache, start_pos, rows, cos_sin)
        B, T = input_ids.shape
        H = self.args.hidden_size
        if lay.first_stage:
            x = F.embedding(input_ids, self.embedding)  # [B, T, H]
            if self.args.embed_scale != 1.0:
                x = x * self.args.embed_scale
        else:
            x = comm.recv((B, T, H), lay.peer(lay.pp_rank - 1))
        cos_sin = cos_sin if cos_sin is not None else rope_tables(self.ropes, start_pos, T)
        keep = self.capture if lay.rank == 0 and lay.pp == 1 else ()
        captured = []
        for layer in self.layers:
            x = layer(x, start_pos, cache, cos_sin)
            if layer.layer_idx in keep:  # after the all-reduce: every tp rank holds the same whole x
                captured.append(x.reshape(B * T, H))
        if -1 in keep:
            captured.append(rms_norm(x.reshape(B * T, H), self.ln_f, self.args.norm_epsilon))
        self.captured = torch.cat(captured, dim=-1) if captured else None
        n = B * T if rows is None else int(rows.numel())
        V = self.args.vocab_size
        if not lay.last_stage:
            comm.send(x, lay.peer(lay.pp_rank + 1))
            if lay.rank == 0:  # the last stage's tp rank 0 sends the logits back
                logits = comm.recv((n, V), (lay.pp - 1) * lay.tp)
                return logits if rows is not None else logits.view(B, T, V)
            return None
        h = x.reshape(B * T, H)
        if rows is not None:
            h = h[rows]
        logits = comm.all_gather_last(self.lm_head(rms_norm(h, self.ln_f, self.args.norm_epsilon)))[:, :V]
        logits = softcap(logits, self.args.final_logit_softcapping)
        if lay.rank == 0:
            return logits if rows is not None else logits.view(B, T, V)
        if lay.tp_rank == 0:
            comm.send(logits, 0)
        return None

    def _forward_own(self, input_ids, cache, start_pos, rows, cos_sin) -> torch.Tensor:
        """Attention DP: this rank's own requests (``input_ids`` differ per rank) -> this rank's logits."""
        B, T = input_ids.shape
        x = F.embedding(input_ids, self.embedding)
        if self.args.embed_scale != 1.0:
            x = x * self.args.embed_scale
        cos_sin = cos_sin if cos_sin is not None else rope_tables(self.ropes, start_pos, T)
        for layer in self.layers:
            x = layer(x, start_pos, cache, cos_sin)
        h = x.reshape(B * T, -1)
        if rows is not None:
            h = h[rows]
        logits = self.lm_head(rms_norm(h, self.ln_f, self.args.norm_epsilon))[:, : self.args.vocab_size]
        logits = softcap(logits, self.args.final_logit_softcapping)
        return logits if rows is not None else logits.view(B, T, -1)

    def idle(self) -> None:
        """Attention DP: a step with no request of this rank's own still runs its experts for the others."""
        for layer in self.layers:
            layer.idle(self.args.hidden_size)


def load_rank(ckpt_dir: str | Path, comm_or_layout=None, device: str = "cpu") -> RankModel:
    """Load this process's rank of a TRT-LLM checkpoint: only ``rank{N}.safetensors`` is read.

    Args:
        ckpt_dir: the checkpoint directory (config.json + rank files).
        comm_or_layout: a :class:`Comm` (default: COMM_WORLD of the running MPI job, rank from MPI).
    Raises:
        CheckpointError: the rank file or a tensor is missing, or the job's size does not match tp x pp.
    """
    ckpt_dir = Path(ckpt_dir)
    cfg, quant_cfg = read_config(ckpt_dir)
    args = ModelArgs.from_config(cfg, quant_cfg)
    comm = comm_or_layout
    if comm is None:
        rank = mpi().COMM_WORLD.Get_rank()
        comm = Comm(RankLayout(args.tp, args.pp, rank))
    lay = comm.layout
    if args.attention_dp and args.pp > 1:
        raise CheckpointError(f"{ckpt_dir}: attention data parallel with pp={args.pp}: the twin runs it at pp 1 only")
    path = ckpt_dir / f"rank{lay.rank}.safetensors"
    tensors = read_rank(path, device)
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rope = args.ropes()
    layers = []
    for local, global_idx in enumerate(pp_layers(args.num_layers, args.pp, lay.pp_rank)):
        shard = with_prefix(tensors, f"transformer.layers.{local}.")
        if not shard:
            raise CheckpointError(f"{path}: layer {local} (global {global_idx}) has no tensors")
        layers.append(
            DecoderLayer(
                args,
                [shard],
                global_idx,
                rope,
                tp_ranks=[lay.tp_rank],
                all_reduce=comm.all_reduce,
                moe_exchange=comm.moe_exchange if args.attention_dp else None,
            )
        )
    embedding = _rank_embedding(cfg, args, comm, tensors, path) if lay.first_stage else None
    ln_f = lm_head = None
    if lay.last_stage:
        if "transformer.ln_f.weight" not in tensors:
            raise CheckpointError(f"{path}: tensor 'transformer.ln_f.weight' is missing")
        ln_f = tensors["transformer.ln_f.weight"].float()
        lm_head = _rank_lm_head(args, lay, tensors, embedding, path)
    del tensors
    return RankModel(cfg, args, lay, comm, layers, embedding, ln_f, lm_head, weight_bytes)


def _rank_embedding(cfg: dict, args: ModelArgs, comm: Comm, tensors: dict, path: Path) -> torch.Tensor:
    name = "transformer.vocab_embedding.weight"
    if name not in tensors:
        raise CheckpointError(f"{path}: tensor '{name}' is missing")
    table = tensors[name].float()
    if not cfg.get("use_parallel_embedding") or args.tp == 1 or args.attention_dp:
        return table
    # A vocab/hidden-sharded table: gathered once at load (the lookup then needs no communication).
    dim = int(cfg.get("embedding_sharding_dim", 0))
    parts = comm.tp_comm.allgather(table.numpy())
    full = torch.cat([torch.from_numpy(p) for p in parts], dim=dim)
    return full[: args.vocab_size] if dim == 0 else full


def _rank_lm_head(args: ModelArgs, lay: RankLayout, tensors: dict, embedding, path: Path) -> torch.nn.Module:
    if "lm_head.weight" not in tensors:
        if embedding is None or (lay.tp > 1 and not args.attention_dp):
            raise CheckpointError(f"{path}: tensor 'lm_head.weight' is missing")
        return Float32Linear(embedding)  # tied embeddings, one stage, one rank
    algo = module_quant_algo("lm_head", args.quantization, args.quant_cfg)
    if args.attention_dp:  # a whole lm_head on every rank
        return build_linear(
            with_prefix(tensors, "lm_head."), LinearSpec("lm_head", algo, args.quantization or {}, args.dtype)
        )
    spec = LinearSpec("lm_head", algo, args.quantization or {}, args.dtype, "column", lay.tp_rank, args.tp)
    return build_linear(with_prefix(tensors, "lm_head."), spec)


def whole_lm_head(model, checkpoint_dir: Optional[str | Path]) -> list:
    """The lm_head of ``model`` as one linear per tp rank (columns side by side, as
    :class:`~trtpipe.runtime.model.ReferenceModel` holds it), for what reads the target's logits on rank 0 alone (an
    EAGLE-1/2 head drafting there: :mod:`trtpipe.serving.eagle1`). A one-process model's list as it is; a
    :class:`RankModel` of a pp 1 job holds only its own columns, so the other tp ranks' ``lm_head.*`` tensors (and
    nothing else) are read from ``checkpoint_dir``'s rank files."""
    from safetensors import SafetensorError, safe_open

    from trtpipe.runtime.loader import lm_head_linears

    if not isinstance(model, RankModel):
        return list(model.lm_head)
    lay = model.layout
    if lay.tp == 1 or model.args.attention_dp:  # the whole lm_head on this rank
        return [model.lm_head]
    if lay.pp != 1 or checkpoint_dir is None:
        raise ValueError(f"the target's whole lm_head on rank {lay.rank} needs pp 1 and its checkpoint directory")
    ranks = []
    for r in range(lay.tp):
        path = Path(checkpoint_dir) / f"rank{r}.safetensors"
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                ranks.append({k: f.get_tensor(k) for k in f.keys() if k.startswith("lm_head.")})
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: cannot read the lm_head: {exc}") from None
        if "lm_head.weight" not in ranks[-1]:
            raise CheckpointError(f"{path}: tensor 'lm_head.weight' is missing")
    return lm_head_linears(model.args, ranks, model.embedding)


def rank_status(model: Optional[RankModel], layout: RankLayout, error: Optional[str]) -> dict:
    """What a rank reports after loading (readiness is every rank reporting ``ok``)."""
    return {
        "rank": layout.rank,
        "tp_rank": layout.tp_rank,
        "pp_rank": layout.pp_rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "ok": error is None,
        "error": error,
        "rss_mb": round(rss_mb(), 1),
        "weights_mb": round(model.weight_bytes / 2**20, 3) if model is not None else None,
        "layers": [layer.layer_idx for layer in model.layers] if model is not None else [],
    }


class RankLoadError(CheckpointError):
    """Some rank could not load its shard; every rank raises this with the same message."""


def load_all_ranks(ckpt_dir: str | Path, on_status=None) -> tuple[RankModel, list[dict]]:
    """Collective :func:`load_rank`: each rank loads its shard, then all statuses are gathered on rank 0 and the
    verdict is broadcast, so a rank that fails (missing file, bad tensor, out of memory) fails every rank with
    its own error instead of leaving the others blocked in their first collective.

    ``on_status(statuses)`` runs on rank 0 before the verdict (e.g. to write them for a supervisor).
    Returns (model, statuses on rank 0 / [] elsewhere).
    """
    MPI = mpi()
    world = MPI.COMM_WORLD
    model, error = None, None
    try:
        cfg, _ = read_config(Path(ckpt_dir))
        args = ModelArgs.from_config(cfg)
        model = load_rank(ckpt_dir, Comm(RankLayout(args.tp, args.pp, world.Get_rank())))
    except (CheckpointError, OSError, MemoryError, RuntimeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc)
    layout = model.layout if model is not None else RankLayout(1, world.Get_size(), world.Get_rank())
    statuses = world.gather(rank_status(model, layout, error), root=0)
    if world.Get_rank() == 0 and on_status is not None:
        on_status(statuses)
    failed = world.bcast([s for s in statuses if not s["ok"]] if world.Get_rank() == 0 else None, root=0)
    if failed:
        raise RankLoadError(
            "; ".join(f"rank {s['rank']} ({s['host']}) failed to load its shard: {s['error']}" for s in failed)
        )
    return model, statuses or []
