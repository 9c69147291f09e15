"""A gloo/CPU stand-in for DeepEP v1.2.1's intranode `Buffer` and `Config` (a test double).

DeepEP needs SM90 GPUs and NVLink, so CPU CI cannot run it. This double implements the intranode
calls Spartron makes with the same signatures, handle layout (six tensors, DeepEP's dtypes and
shapes), receive order (by source rank, then token index), per-rank id translation (-1 and weight 0
for other ranks' experts), fp32 reduction in combine, and the in-place rewrite of `send_head` that
DeepEP's combine performs, and its FP8 dispatch (x given as E4M3 values with fp32 scales per 128, received as
such a pair). The transport is `all_to_all_single`. It counts its calls, so a test can prove that a checkpoint
replay did not redo the layout or the exchanges, and the tokens' bytes its dispatches send.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch import Tensor


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        assert num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens
        self.num_sms = num_sms
        self.recv_tokens = num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels = self.num_sms // 2
        n = channels * num_ranks * 5 * 4 + channels * num_ranks * self.recv_tokens * (hidden_bytes + 128 * 16)
        return (n + 127) // 128 * 128


class Buffer:
    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False):
        assert num_rdma_bytes == 0 and not low_latency_mode  # Spartron uses the intranode kernels only
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.calls: collections.Counter = collections.Counter()
        self.dispatched_bytes = 0  # the tokens' bytes the (uncached) dispatches sent from this rank
        dist.barrier(group=group)  # creating the real buffer is collective too

    def destroy(self) -> None:
        assert self.explicitly_destroy and not self.destroyed
        dist.barrier(group=self.group)
        self.destroyed = True

    # --- helpers -------------------------------------------------------------------------------
    def _exchange(self, rows: list[Tensor], recv_counts: list[int]) -> Tensor:
        send = torch.cat(rows)
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(out, send, recv_counts, [r.shape[0] for r in rows], group=self.group)
        return out

    def _recv_counts(self, rank_prefix_matrix: Tensor) -> list[int]:
        column = rank_prefix_matrix[:, self.rank].to(torch.int64)
        return torch.diff(column, prepend=column.new_zeros(1)).tolist()

    def _destinations(self, is_token_in_rank: Tensor) -> list[Tensor]:
        return [is_token_in_rank[:, r].nonzero().squeeze(1) for r in range(self.group_size)]

    # --- DeepEP's intranode API ----------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self.calls["layout"] += 1
        assert topk_idx.dtype == torch.int64 and topk_idx.is_contiguous()
        per_rank = num_experts // self.group_size
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // per_rank, -1)
        in_rank = torch.stack([(dest == r).any(dim=1) for r in range(self.group_size)], dim=1)
        per_expert = torch.zeros(num_experts, dtype=torch.int64).scatter_add_(
            0, topk_idx[valid], torch.ones_like(topk_idx[valid]))
        return in_rank.sum(0).to(torch.int32), None, per_expert.to(torch.int32), in_rank.contiguous(), None

    def dispatch(self, x: Tensor, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        assert config is not None
        fp8 = isinstance(x, tuple)  # DeepEP's FP8 dispatch: (E4M3 [tokens, hidden], fp32 scales [tokens, hidden/128])
        if fp8:
            x, scales = x
            assert x.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32 and handle is None
            assert scales.shape == (x.shape[0], x.shape[1] // 128)  # any strides: DeepEP reads them through theirs
        assert x.dim() == 2 and x.is_contiguous()
        channels = config.num_sms // 2
        if handle is not None:
            self.calls["cached_dispatch"] += 1
            assert topk_idx is None and topk_weights is None
            rank_prefix_matrix, _, _, recv_src_idx, in_rank, _ = handle
            tokens = self._destinations(in_rank)
            recv_x = self._exchange([x[t].float() for t in tokens], self._recv_counts(rank_prefix_matrix))
            assert recv_x.shape[0] == recv_src_idx.shape[0]
            return recv_x.to(x.dtype), None, None, None, None, None
        self.calls["dispatch"] += 1
        assert topk_weights.dtype == torch.float32 and num_tokens_per_expert.dtype == torch.int32
        ep = self.group_size
        in_rank = is_token_in_rank
        tokens = self._destinations(in_rank)
        send_counts = torch.tensor([t.numel() for t in tokens], dtype=torch.int64)
        rows = [torch.empty_like(send_counts) for _ in range(ep)]
        dist.all_gather(rows, send_counts, group=self.group)
        matrix = torch.stack(rows)  # [src, dst] tokens sent
        recv_counts = matrix[:, self.rank].tolist()
        n_local = num_tokens_per_expert.numel() // ep
        ids, weights = [], []
        for r, t in enumerate(tokens):
            global_ids = topk_idx[t]
            local = global_ids - r * n_local
            mine = (local >= 0) & (local < n_local)
            ids.append(torch.where(mine, local, -1))
            weights.append(torch.where(mine, topk_weights[t], 0.0))
        if fp8:
            rows = [torch.cat((x.view(torch.uint8)[t], scales[t].contiguous().view(torch.uint8)), 1) for t in tokens]
            wire = self._exchange(rows, recv_counts)
            dim = x.shape[1]
            recv_x = (wire[:, :dim].contiguous().view(x.dtype), wire[:, dim:].contiguous().view(torch.float32))
        else:
            rows = [x[t].float() for t in tokens]
            recv_x = self._exchange(rows, recv_counts).to(x.dtype)
        self.dispatched_bytes += sum(r.shape[0] for r in rows) * (x.shape[1] * x.element_size() + (
            4 * scales.shape[1] if fp8 else 0))  # what DeepEP sends of the tokens
        recv_idx = self._exchange(ids, recv_counts)
        recv_w = self._exchange(weights, recv_counts)
        recv_src = self._exchange([t.to(torch.int64) for t in tokens], recv_counts).to(torch.int32)
        counts = [int((recv_idx == e).sum()) for e in range(n_local)]
        send_head = torch.full(in_rank.shape, -1, dtype=torch.int32)
        for r, t in enumerate(tokens):
            send_head[t, r] = torch.arange(t.numel(), dtype=torch.int32)
        handle = (matrix.cumsum(0).to(torch.int32), torch.zeros(ep, channels, dtype=torch.int32),
                  torch.zeros(ep, channels, dtype=torch.int32), recv_src, in_rank, send_head)
        return recv_x, recv_idx, recv_w, counts, handle, None

    def combine(self, x: Tensor, handle, topk_weights: Tensor | None = None, bias=None,
                config: Config | None = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        self.calls["combine"] += 1
        assert config is not None and x.dim() == 2 and x.is_contiguous()
        rank_prefix_matrix, _, _, src_idx, in_rank, send_head = handle
        assert x.shape[0] == src_idx.shape[0]
        send_counts = self._recv_counts(rank_prefix_matrix)
        tokens = self._destinations(in_rank)
        back_counts = [t.numel() for t in tokens]
        order = torch.cat(tokens)
        rows = self._exchange(list(torch.split(x.float(), send_counts)), back_counts)
        out = torch.zeros(in_rank.shape[0], x.shape[1]).index_add_(0, order, rows).to(x.dtype)
        out_w = None
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32
            w = self._exchange(list(torch.split(topk_weights, send_counts)), back_counts)
            out_w = torch.zeros(in_rank.shape[0], topk_weights.shape[1]).index_add_(0, order, w)
        send_head.masked_fill_(send_head < 0, -7)  # DeepEP's combine rewrites skipped slots in place
        return out, out_w, None
