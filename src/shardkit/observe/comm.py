"""Count the collectives this process issues, and their payload bytes, per op kind.

Why a dispatch mode and not patched ``torch.distributed`` functions: in torch 2.x every
``ProcessGroup`` call (``dist.all_reduce``, ``dist.all_gather_single``, ``send``, ``barrier``,
FSDP2's all-gathers and reduce-scatters, DDP's bucket all-reduces, even ``pg.allreduce``
called directly) goes through a dispatcher op in the ``c10d`` namespace, and DTensor /
tensor-parallel code uses the functional collectives in ``_c10d_functional``. One
``TorchDispatchMode`` sees both families. Patching Python functions would miss callers
that hold their own reference (``from torch.distributed import all_reduce``) or call the
process group directly, and would count twice where one Python collective calls another.
Inside the mode's handler the mode is switched off, so a functional collective that runs a
``c10d`` op underneath is counted once, as itself. This is what torch's ``CommDebugMode``
does too; it returns ``NotImplemented`` for DTensor arguments so DTensor can lower its op
into the collectives that are then counted.

Byte convention: the payload this rank hands to the op, i.e. the ``nbytes`` of its input
tensor(s): the tensor for ``all_reduce`` / ``broadcast`` / ``send``, the local shard for
all-gathers, the full input for reduce-scatters and all-to-all, the receive buffer for
``recv``; barriers count 0. This is a size of the data, not of the traffic on the wire
(a ring all-reduce of n bytes over p ranks sends ``2 n (p-1)/p`` bytes per rank).
For all-to-all (expert parallelism's exchanges) :meth:`CommCounter.remote` also gives the part
of the payload addressed to other ranks: the input less the split a rank sends itself (from the
op's own split sizes and the rank's place in its group), which is a local copy, not traffic.

Only this thread is observed (dispatch modes are thread-local; autograd's backward on the
same device inherits it), and only while the counter is entered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: op namespace -> {op name: (reported kind, index of the payload argument or None for no payload)}
_OPS: dict[str, dict[str, tuple[str, int | None]]] = {
    "c10d": {
        "allreduce_": ("all_reduce", 0),
        "allreduce_coalesced_": ("all_reduce_coalesced", 0),
        "_allgather_base_": ("all_gather_into_tensor", 1),
        "allgather_": ("all_gather", 1),
        "allgather_coalesced_": ("all_gather_coalesced", 1),
        "allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", 1),
        "_reduce_scatter_base_": ("reduce_scatter_tensor", 1),
        "reduce_scatter_": ("reduce_scatter", 1),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", 1),
        "alltoall_base_": ("all_to_all_single", 1),
        "alltoall_": ("all_to_all", 1),
        "broadcast_": ("broadcast", 0),
        "reduce_": ("reduce", 0),
        "gather_": ("gather", 1),
        "scatter_": ("scatter", 1),
        "send": ("send", 0),
        "recv_": ("recv", 0),
        "recv_any_source_": ("recv", 0),
        "barrier": ("barrier", None),
        "monitored_barrier_": ("barrier", None),
    },
    "_c10d_functional": {
        "all_reduce": ("all_reduce", 0),
        "all_reduce_": ("all_reduce", 0),
        "all_reduce_coalesced": ("all_reduce_coalesced", 0),
        "all_reduce_coalesced_": ("all_reduce_coalesced", 0),
        "all_gather_into_tensor": ("all_gather_into_tensor", 0),
        "all_gather_into_tensor_out": ("all_gather_into_tensor", 0),
        "all_gather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 0),
        "reduce_scatter_tensor": ("reduce_scatter_tensor", 0),
        "reduce_scatter_tensor_out": ("reduce_scatter_tensor", 0),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 0),
        "all_to_all_single": ("all_to_all_single", 0),
        "broadcast": ("broadcast", 0),
        "broadcast_": ("broadcast", 0),
    },
    "_c10d_functional_autograd": {
        "all_to_all_single": ("all_to_all_single", 0),
        "all_gather_into_tensor": ("all_gather_into_tensor", 0),
        "reduce_scatter_tensor": ("reduce_scatter_tensor", 0),
    },
}


def payload_bytes(value: Any) -> int:
    """Total ``nbytes`` of the tensors in ``value`` (a tensor or nested lists of tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return sum(payload_bytes(v) for v in value)
    return 0


#: (namespace, op name) of an all-to-all -> (index of its input, of its group, of its input split sizes or None)
_ALL_TO_ALL: dict[tuple[str, str], tuple[int, int, int | None]] = {
    ("c10d", "alltoall_base_"): (1, 2, 4),
    ("c10d", "alltoall_"): (1, 2, None),
    ("_c10d_functional", "all_to_all_single"): (0, 3, 2),
    ("_c10d_functional_autograd", "all_to_all_single"): (0, 3, 2),
}


def _group(group: Any) -> Any:
    """The ProcessGroup an op names: a boxed one (``c10d`` ops) or a group name (functional ops)."""
    import torch.distributed as dist

    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group


def _own_split_bytes(spec: tuple[int, int, int | None], args: Sequence[Any]) -> int:
    """Bytes of an all-to-all's input (``spec``: its :data:`_ALL_TO_ALL` entry) that this rank
    addresses to itself: its split of one tensor (equal splits when no sizes are given), or its
    tensor of a list."""
    inputs, group, splits = spec
    pg = _group(args[group])
    rank, size = pg.rank(), pg.size()
    if splits is None:
        return payload_bytes(args[inputs][rank])
    tensor, sizes = args[inputs], list(args[splits])
    rows = tensor.shape[0] if tensor.dim() else 0
    if not rows:
        return 0
    row = payload_bytes(tensor) // rows
    return row * (int(sizes[rank]) if sizes else rows // size)


class CommCounter(TorchDispatchMode):
    """Context manager counting collective calls and payload bytes per op kind in this process
    (:meth:`summary`), and for all-to-all the bytes addressed to other ranks (:meth:`remote`).

    >>> import torch.distributed as dist
    >>> with CommCounter() as comm:        # doctest: +SKIP
    ...     dist.all_reduce(torch.ones(4))
    >>> comm.summary()                     # doctest: +SKIP
    {'all_reduce': (1, 16)}
    """

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[str, list[int]] = {}
        self._own: dict[str, int] = {}
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # let DTensor lower the op; its collectives come back through this mode
        kwargs = kwargs or {}
        namespace, opname = getattr(func, "namespace", ""), getattr(func, "_opname", "")
        kind = _OPS.get(namespace, {}).get(opname)
        if kind is not None:
            name, index = kind
            entry = self._counts.setdefault(name, [0, 0])
            entry[0] += 1
            if index is not None:
                entry[1] += payload_bytes(args[index] if index < len(args) else None)
            spec = _ALL_TO_ALL.get((namespace, opname))
            if spec is not None:
                self._own[name] = self._own.get(name, 0) + _own_split_bytes(spec, args)
        return func(*args, **kwargs)

    def summary(self) -> dict[str, tuple[int, int]]:
        """``{op kind: (calls, payload bytes)}``, kinds sorted by name."""
        return {name: (calls, size) for name, (calls, size) in sorted(self._counts.items())}

    def remote(self) -> dict[str, int]:
        """``{all-to-all kind: payload bytes addressed to other ranks}``: :meth:`summary`'s bytes
        less the splits each call's rank sent itself (kinds sorted by name)."""
        return {name: self._counts[name][1] - own for name, own in sorted(self._own.items())}

    def totals(self) -> tuple[int, int]:
        """``(calls, payload bytes)`` over all op kinds."""
        return sum(c for c, _ in self._counts.values()), sum(b for _, b in self._counts.values())

    def reset(self) -> None:
        self._counts.clear()
        self._own.clear()
