"""The DeepEP communication buffer of one EP group: sizing from the model config, lazy creation.

Why an explicit object: a `deep_ep.Buffer` pins NVLink-shared (IPC) memory and a communication
stream and is created collectively by every rank of the group. It belongs to the EP group's
transport (spartron.comm.transport.EPTransport: one per model, shared by every MoE layer; a layer
built alone has its own), never a module-level cache. Creation is lazy: constructing a model costs
nothing, and the first dispatch creates it inside the `spartron_deepep::dispatch` op, where a
checkpoint policy never sees (or replays) the collective set-up traffic.

Lifetime: the transport calls `destroy()` on every rank before the process group goes away (the
buffer is created with DeepEP's `explicitly_destroy`); the trainer does it through the model's
`close()` when a run ends well. A process that exits without it only leaks what the OS reclaims anyway.

Sizing (intranode, NVLink): DeepEP streams tokens through per-(channel, peer) ring queues of
`num_max_nvl_chunked_recv_tokens` slots, so the NVLink buffer depends on hidden size, EP size and
channel count (= SMs / 2), not on the number of tokens. `nvl_buffer_bytes` mirrors DeepEP v1.2.1's
`Config.get_nvl_buffer_size_hint` (NVSHMEM disabled) for the dispatch and combine configs and takes
the larger; `runtime()` additionally takes DeepEP's own hint, so a library change cannot undersize it.

The ops take it as an argument, through `DeepEPBuffer.ref` (a `DeepEPBufferRef`): a custom op
cannot take a plain Python object, but it can take a registered opaque reference type, which
torch.compile passes into the graph as a black box (no ContextVar scope, which dynamo cannot trace,
and nothing keyed by ids). The ref holds the buffer and nothing else, so the traced Python code
reads the buffer's plain attributes (its checks) and only the ref crosses the op boundary.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase  # torch >= 2.11: opaque types derive from it

from spartron.comm.fp8_rows import TILE
from spartron.optional import MissingDependencyError, require

FEATURE = "model.moe.dispatcher = 'deepep'"
INSTALL_HINT = ("build DeepEP v1.2.1 from source, intranode only: clone https://github.com/deepseek-ai/DeepEP "
                "at tag v1.2.1 and run `pip install --no-build-isolation .` in it with NVSHMEM absent "
                "(NVSHMEM_DIR unset, no nvshmem wheel; then the -rdc=true nvcc flag must not be used). "
                "Needs SM90 GPUs on one NVLink node. The PyPI 'deep-ep' 1.0.0 sdist does not work")

# DeepEP v1.2.1's recommended intranode chunk sizes per EP size: (send tokens, receive tokens).
DISPATCH_CHUNKS = {2: (24, 256), 4: (6, 256), 8: (6, 256)}
COMBINE_CHUNKS = {2: (10, 256), 4: (9, 256), 8: (4, 256)}
RDMA_CHUNKS = (6, 128)  # unused intranode; the Config constructor still validates them

MAX_TOPK = 32  # one warp lane per top-k entry in the intranode kernels
HINT_MAX_TOPK = 128  # what DeepEP's size hint reserves per token for top-k ids/weights
HINT_MAX_SCALES = 128  # ... and for FP8 scales
MAX_LOCAL_EXPERTS = 1024

def load_deep_ep() -> ModuleType:
    """`import deep_ep`, or a ValueError naming the option and how to install DeepEP."""
    try:
        return require("deep_ep", FEATURE, INSTALL_HINT)
    except MissingDependencyError as err:
        raise ValueError(f"{FEATURE} needs DeepEP, which is not importable here: {err}") from err


def check_deepep_shape(n_experts: int, top_k: int, ep: int, num_sms: int, hidden: int | None = None) -> None:
    """Every limit of DeepEP's intranode kernels we can check without a GPU; errors name config keys."""
    if ep not in DISPATCH_CHUNKS:
        raise ValueError(f"{FEATURE} runs intranode over NVLink with an EP group of 2, 4 or 8 ranks; "
                         f"parallel.ep is {ep} (use 'all_to_all')")
    if num_sms % 2:
        raise ValueError(f"model.moe.deepep_num_sms must be even (one send + one receive SM per "
                         f"channel), got {num_sms}")
    if top_k > MAX_TOPK:
        raise ValueError(f"{FEATURE} supports model.moe.top_k <= {MAX_TOPK}, got {top_k}")
    if n_experts % ep or n_experts // ep > MAX_LOCAL_EXPERTS:
        raise ValueError(f"{FEATURE}: model.moe.n_routed_experts {n_experts} must be divisible by the EP "
                         f"size {ep} with at most {MAX_LOCAL_EXPERTS} experts per rank")
    if hidden is not None and (hidden * 2) % 16:
        raise ValueError(f"{FEATURE}: model.dim {hidden} x 2 bytes (bf16) must be a multiple of 16 bytes")


def nvl_buffer_bytes(hidden: int, ep: int, num_sms: int) -> int:
    """NVLink buffer bytes for bf16 tokens of `hidden` (max over the dispatch and combine configs)."""
    channels = num_sms // 2
    hidden_bytes = hidden * 2
    per_slot = hidden_bytes + HINT_MAX_TOPK * (8 + 4) + HINT_MAX_SCALES * 4

    def hint(recv_tokens: int) -> int:
        n = channels * ep * (2 * 1 + 3) * 4 + channels * ep * recv_tokens * per_slot
        return (n + 127) // 128 * 128

    return max(hint(DISPATCH_CHUNKS[ep][1]), hint(COMBINE_CHUNKS[ep][1]))


class DeepEPBufferRef(OpaqueBase):
    """What the `spartron_deepep` ops take: the buffer, as an opaque reference (module docstring)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: DeepEPBuffer):
        self.buffer = buffer


register_opaque_type(DeepEPBufferRef, typ="reference")


class DeepEPBuffer:
    """One EP group's DeepEP buffer and configs, created on first use (collectively, every rank)."""

    def __init__(self, group: dist.ProcessGroup, top_k: int, n_experts: int, num_sms: int,
                 hidden: int | None = None, library: ModuleType | Any | None = None):
        """`hidden` None: taken from the first tokens dispatched (then fixed). `library`: the module
        providing `Buffer` and `Config` (default `deep_ep`, imported now so a missing install fails
        when the model is built, not at the first step)."""
        self.group = group
        self.ep = dist.get_world_size(group)
        check_deepep_shape(n_experts, top_k, self.ep, num_sms, hidden)
        self.hidden, self.top_k, self.n_experts, self.num_sms = hidden, top_k, n_experts, num_sms
        self.needs_cuda = library is None
        self.library = load_deep_ep() if library is None else library
        self.ref = DeepEPBufferRef(self)  # what the ops take (one per buffer: compiled graphs guard on it)
        self.num_nvl_bytes: int | None = None  # set when the runtime buffer is created
        self._runtime: Any | None = None
        self.dispatch_config: Any | None = None
        self.combine_config: Any | None = None

    @property
    def created(self) -> bool:
        return self._runtime is not None

    def runtime(self) -> Any:
        """The `deep_ep.Buffer` (created on the first call; a collective over the EP group)."""
        if self._runtime is None:
            if self.hidden is None:
                raise RuntimeError("DeepEPBuffer.runtime(): hidden size unknown (no tokens checked yet)")
            lib = self.library
            self.dispatch_config = lib.Config(self.num_sms, *DISPATCH_CHUNKS[self.ep], *RDMA_CHUNKS)
            self.combine_config = lib.Config(self.num_sms, *COMBINE_CHUNKS[self.ep], *RDMA_CHUNKS)
            hints = [int(c.get_nvl_buffer_size_hint(self.hidden * 2, self.ep))
                     for c in (self.dispatch_config, self.combine_config)]
            nbytes = max(nvl_buffer_bytes(self.hidden, self.ep, self.num_sms), *hints)
            self.num_nvl_bytes = nbytes
            # explicit destroy: DeepEP's destructor runs a cross-rank barrier, which can hang or abort
            # when it runs during interpreter shutdown; `destroy()` does it while every rank is alive
            self._runtime = lib.Buffer(self.group, nbytes, 0, explicitly_destroy=True)
        return self._runtime

    def destroy(self) -> None:
        """Release the DeepEP buffer (collective: every rank of the group calls it). Idempotent;
        a later dispatch creates a new one."""
        if self._runtime is not None:
            if self.needs_cuda:
                torch.cuda.synchronize()
            self._runtime.destroy()
            self._runtime = None

    def check_input(self, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Local checks before a rank enters a DeepEP collective (a wrong shape there hangs the peers)."""
        if self.hidden is None and x.dim() == 2:
            check_deepep_shape(self.n_experts, self.top_k, self.ep, self.num_sms, x.shape[1])
            self.hidden = x.shape[1]
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"{FEATURE}: tokens must be [tokens, {self.hidden}], got {tuple(x.shape)} "
                             "(the buffer was sized for model.dim)")
        if x.device.type != "cuda" and self.needs_cuda:
            raise ValueError(f"{FEATURE} runs on CUDA tensors, got tokens on {x.device}")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{FEATURE} moves bfloat16 tokens (its combine reduces bf16 only); got "
                             f"{x.dtype}: set model.dtype = 'bfloat16'")
        if topk_ids.shape != (x.shape[0], self.top_k) or topk_ids.dtype != torch.int64:
            raise ValueError(f"{FEATURE}: topk_ids must be int64 [{x.shape[0]}, {self.top_k}], got "
                             f"{topk_ids.dtype} {tuple(topk_ids.shape)}")

    def check_fp8(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's FP8 rows as DeepEP's FP8 dispatch takes them (checked before the collective, as check_input): q
        float8_e4m3fn [tokens, dim] (made contiguous), scales float32 [tokens, dim / 128] (any strides: DeepEP reads
        them through theirs)."""
        tiles = x.shape[1] // TILE
        if x.shape[1] % TILE or q.dtype != torch.float8_e4m3fn or q.shape != x.shape:
            raise ValueError(f"{FEATURE}: FP8 rows must be float8_e4m3fn {tuple(x.shape)} with dim a multiple of 128, "
                             f"got {q.dtype} {tuple(q.shape)}")
        if scales.dtype != torch.float32 or scales.shape != (x.shape[0], tiles):
            raise ValueError(f"{FEATURE}: FP8 scales must be float32 [{x.shape[0]}, {tiles}] (one per 128 values), "
                             f"got {scales.dtype} {tuple(scales.shape)}")
        return q.contiguous(), scales
