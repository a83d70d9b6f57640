"""Orchestrator mode: how the two-model draft-target form (``tensorrt_llm`` + ``tensorrt_llm_draft``) is launched on
TensorRT engines when the target has tp x pp > 1.

Upstream (TensorRT-LLM ``docs/source/advanced/speculative-decoding.md@8babaf8a``, "Using Draft model approach with
Triton Inference Server"): "``--multi-model`` is necessary if TP mode is used for target model"; the launch is
``launch_triton_server.py --tensorrt_llm_model_name "tensorrt_llm,tensorrt_llm_draft" --multi-model`` (world size 1),
and each model is placed with its ``gpu_device_ids`` parameter, the draft first (``DRAFT_GPU_DEVICE_IDS="0"``,
``TARGET_GPU_DEVICE_IDS="1,2,3,4"`` "if TP mode is used"). In leader mode (``mpirun`` of one tritonserver per rank,
ranks > 0 loading the TensorRT-LLM models explicitly) the draft's executor has no ranks of its own, so trtpipe writes
orchestrator mode for this case only.

What ``--multi-model`` does (triton-inference-server/tensorrtllm_backend ``scripts/launch_triton_server.py@dbae4e88``,
the last copy there before the script moved to NVIDIA/TensorRT-LLM ``triton_backend/scripts/``): world size must be 1
without ``--disable-spawn-processes``; the environment gets ``TRTLLM_ORCHESTRATOR=1`` and
``TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1``; the one ``mpirun -n 1`` tritonserver gets ``--pinned-memory-pool-byte-size=0
--enable-peer-access=false`` and ``--cuda-memory-pool-byte-size=J:0`` for each GPU J (the script counts
``nvidia-smi --list-gpus``; trtpipe writes the GPUs it places, which are the ones a pod of this layout sees). The
backend then spawns each model instance's executor workers (``trtllmExecutorWorker``, ``MPI_Comm_spawn``) on its
``gpu_device_ids`` (tensorrtllm_backend ``inflight_batcher_llm/src/model_instance_state.cc@dbae4e88``,
``getParallelConfigFromParams``: ``setDeviceIds``, ``CommunicationMode::kORCHESTRATOR``). Spawning is single-node.
``participant_ids`` is only read with spawning disabled (the fast-logits layout), so trtpipe leaves it empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from trtpipe.errors import ServingError

TARGET, DRAFT = "tensorrt_llm", "tensorrt_llm_draft"
ORCHESTRATOR_ENV = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}


def needs_orchestrator(two_model: bool, world: int) -> bool:
    """The two-model form with a tp x pp > 1 target is launched in orchestrator mode (upstream's guide)."""
    return two_model and world > 1


def device_ids(target_world: int, draft_world: int) -> dict[str, str]:
    """``gpu_device_ids`` of each model as upstream's guide places them: the draft on GPUs 0.., the target on the
    GPUs after the draft's."""
    draft = list(range(draft_world))
    target = list(range(draft_world, draft_world + target_world))
    return {DRAFT: ",".join(map(str, draft)), TARGET: ",".join(map(str, target))}


def gpus_needed(ids: dict[str, str]) -> int:
    """How many GPUs of the node a placement uses (the highest id named, plus one)."""
    return 1 + max(int(x) for value in ids.values() for x in value.split(","))


def check_placement(ids: dict[str, str], worlds: dict[str, int], gpus: Optional[int], where: str) -> None:
    """One line naming the model and key when a model's ``gpu_device_ids`` do not list one GPU per rank of its
    engine (tp x pp), or when the placement needs more GPUs than the node has (``gpus``; None: not known)."""
    for model, value in ids.items():
        try:
            got = [int(x) for x in value.split(",")] if value else []
        except ValueError:
            raise ServingError(
                f"{where}/{model}/config.pbtxt: gpu_device_ids {value!r} is not a list of GPU ids"
            ) from None
        if len(got) != worlds[model] or len(set(got)) != len(got) or min(got, default=0) < 0:
            raise ServingError(
                f"{where}/{model}/config.pbtxt: gpu_device_ids {value!r} must name {worlds[model]} distinct GPUs, one "
                f"per rank of its engine (tp x pp {worlds[model]}); orchestrator mode spawns that many workers"
            )
    need = gpus_needed(ids)
    if gpus is not None and need > gpus:
        raise ServingError(
            f"deploy.gpus_per_node: the two-model form at tp x pp > 1 runs in orchestrator mode on one node and needs "
            f"GPUs 0..{need - 1} ({', '.join(f'{m} on {v}' for m, v in ids.items())}); the node has {gpus}"
        )


def read_device_ids(repo: Path) -> dict[str, str]:
    """Each TensorRT-LLM model's ``gpu_device_ids`` as written in ``repo``'s config.pbtxt files."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    out = {}
    for model in (DRAFT, TARGET):
        path = Path(repo) / model / "config.pbtxt"
        try:
            config = text_format.Parse(path.read_text(), mc.ModelConfig())
        except (OSError, text_format.ParseError) as exc:
            raise ServingError(f"{path}: cannot read ({exc})") from None
        param = config.parameters.get("gpu_device_ids")
        out[model] = param.string_value.strip() if param is not None else ""
    return out


def orchestrator_command(
    repo: Path | str,
    gpus: int,
    endpoint: Sequence[str],
    tritonserver: str = "/opt/tritonserver/bin/tritonserver",
    log_file: Optional[str] = None,
) -> list[str]:
    """``launch_triton_server.py --multi-model --tensorrt_llm_model_name tensorrt_llm,tensorrt_llm_draft`` as one
    argv: the environment (``env``), then ``mpirun -n 1`` of the one tritonserver that serves (``endpoint``: its
    address, port and restricted-API flags) and whose backend spawns every model's workers."""
    env = [f"{k}={v}" for k, v in ORCHESTRATOR_ENV.items()]
    cmd = ["env", *env, "mpirun", "--allow-run-as-root", "-n", "1", tritonserver, f"--model-repository={repo}"]
    cmd += list(endpoint)
    if log_file:
        cmd += ["--log-verbose=3", f"--log-file={log_file}"]
    cmd += ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
    cmd += [f"--cuda-memory-pool-byte-size={j}:0" for j in range(gpus)]
    cmd += ["--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=prefix0_"]
    return cmd
