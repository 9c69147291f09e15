"""The eager entries of `all_to_all` (tests/comm/test_collectives.py checks its values against a reference):
the unwatched fast path, the C-level autograd entry and the dispatcher path under a dispatch mode give
identical outputs and gradients, and a dispatch mode (the checkpoint policy, FakeTensorMode) still sees
the op `spartron_collectives::all_to_all`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from spartron.comm import collectives as C
from spartron.testing import run_distributed


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _entries(rank: int, world: int):
    in_splits = [[1, 3], [2, 2]][rank]
    out_splits = [in_splits_of[rank] for in_splits_of in ([1, 3], [2, 2])]
    x = torch.arange(4 * 3, dtype=torch.float32).view(4, 3) + 100 * rank
    w = torch.arange(sum(out_splits) * 3, dtype=torch.float32).view(-1, 3) - rank
    results = {}
    for name in ("fast", "grad", "watched"):
        xi = x.clone().requires_grad_(name != "fast")
        mode = _Ops()
        if name == "watched":
            with mode:
                out = C.all_to_all(xi, out_splits, in_splits)
        else:
            out = C.all_to_all(xi, out_splits, in_splits)
        grad = None
        if xi.requires_grad:
            (out * w).sum().backward()
            grad = xi.grad.tolist()
        # plain lists: tensors sent from a forked rank that exits at once can lose their shared memory
        results[name] = (out.detach().tolist(), grad, [n for n in mode.names if "all_to_all" in n])
    dist.barrier()
    return results


def test_eager_entries_agree_and_the_watched_call_is_the_op():
    for rank, res in enumerate(run_distributed(_entries, 2)):
        fast, grad, watched = res["fast"], res["grad"], res["watched"]
        expected = [[[0, 1, 2], [100, 101, 102], [103, 104, 105]],
                    [[3, 4, 5], [6, 7, 8], [9, 10, 11], [106, 107, 108], [109, 110, 111]]]
        assert fast[0] == expected[rank] and grad[0] == expected[rank] and watched[0] == expected[rank]
        expected_grad = [[[0, 1, 2], [-1, 0, 1], [2, 3, 4], [5, 6, 7]],
                         [[3, 4, 5], [6, 7, 8], [8, 9, 10], [11, 12, 13]]]
        assert grad[1] == expected_grad[rank] and watched[1] == expected_grad[rank]
        assert watched[2] == ["spartron_collectives.all_to_all"]
