"""Point-to-point transfer of a tensor of any shape between two ranks of a process group.

The pipeline's forward-only path (:meth:`PipelinedModule.through_stages`: evaluation and
generation) sends each stage's output to the next stage's rank, with a shape that changes
from call to call (a prompt, then one token at a time), which torch's ``PipelineStage``
cannot (it fixes its buffers' shapes at its first step). So a header
(:mod:`shardkit.runtime.tensor_header`) goes first, then the data into a buffer of that shape.

Every exchange is posted with ``torch.distributed.batch_isend_irecv`` (on NCCL, a send and its
matching receive must be posted as point-to-point operations both sides see alike; a batch of
one works on gloo and NCCL) and waited for before it returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import UsageError
from . import tensor_header

#: dtypes a pipeline stage may send (its hidden states or logits).
SENDABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def send(tensor: torch.Tensor, group: dist.ProcessGroup, dst: int) -> None:
    """Send ``tensor`` to group rank ``dst``: its header, then its data."""
    if tensor.dtype not in SENDABLE or tensor.dim() > tensor_header.MAX_DIMS:
        raise UsageError(f"a pipeline stage's output of dtype {tensor.dtype} and shape {list(tensor.shape)} cannot be "
                         f"sent to the next stage: give {[str(d) for d in SENDABLE]} with at most "
                         f"{tensor_header.MAX_DIMS} dims")
    _exchange(dist.isend, tensor_header.encode(tensor), group, dst)
    _exchange(dist.isend, tensor.contiguous(), group, dst)


def receive(group: dist.ProcessGroup, src: int, device: torch.device) -> torch.Tensor:
    """The tensor group rank ``src`` sends with :func:`send`."""
    header = tensor_header.empty(device)
    _exchange(dist.irecv, header, group, src)
    shape, dtype = tensor_header.decode(header)
    tensor = torch.empty(shape, dtype=dtype, device=device)
    _exchange(dist.irecv, tensor, group, src)
    return tensor


def _exchange(op: object, tensor: torch.Tensor, group: dist.ProcessGroup, peer: int) -> None:
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, group=group, group_peer=peer)]):
        work.wait()


__all__ = ["SENDABLE", "receive", "send"]
