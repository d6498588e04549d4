"""Every point-to-point exchange of shardkit: sends and receives posted together in one batch.

Why one home: on NCCL the sends and receives that must progress together (a ring step: each
rank sends to the next and receives from the previous) have to be posted in one group, which
``torch.distributed.batch_isend_irecv`` is; a send posted alone, with its receive in a later
batch of the other rank, waits for it, and around a ring that wait closes a cycle that hangs
as soon as a message outgrows NCCL's buffers. So the rule is: a message's send and its receive
are in the *same* batch on both sides (:func:`exchange`), and ``tests/test_p2p_pairing.py``
records every batch of every user (ring attention, halos, pipelines under torch's schedules,
generation, serving, export, calibration's probe) on gloo and checks that no batch waits on a
later one, and refuses a bare ``isend``/``irecv``/``send``/``recv`` in the package. Messages between one pair of ranks match in the order they are given.

The pipeline's forward-only path (:meth:`PipelinedModule.through_stages`: evaluation and
generation) sends each stage's output to the next stage's rank, with a shape that changes
from call to call (a prompt, then one token at a time), which torch's ``PipelineStage``
cannot (it fixes its buffers' shapes at its first step). So :func:`send` posts a header
(:mod:`shardkit.runtime.tensor_header`) first, then the data into a buffer of that shape; a
receiver that already knows the layout (the pipeline's decode steps, after the first) is sent
none, and reads nothing to the host to receive.

>>> exchange(None, sends=[], receives=[])
[]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..plan import UsageError
from . import tensor_header

#: dtypes a pipeline stage may send (its hidden states or logits).
SENDABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

#: ``(peer, tensor)``: the peer's rank in the exchange's group (the global rank when the group is ``None``).
Message = tuple[int, torch.Tensor]
#: ``(shape, dtype)`` of a tensor a receiver expects.
Layout = tuple[tuple[int, ...], torch.dtype]


def exchange(group: dist.ProcessGroup | None, sends: Sequence[Message] = (), receives: Sequence[Message] = ()
             ) -> list:
    """Post ``sends`` and ``receives`` in one ``batch_isend_irecv``; returns the works (see :func:`wait`).

    The other side of every message must post its half in its matching batch; between one pair
    of ranks, messages match in the order given. Receive buffers are filled in place.
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=peer) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for peer, t in receives]
    return dist.batch_isend_irecv(ops) if ops else []


def wait(works: Sequence) -> None:
    """Wait for the works of :func:`exchange`."""
    for work in works:
        work.wait()


def exchange_and_wait(group: dist.ProcessGroup | None, sends: Sequence[Message] = (),
                      receives: Sequence[Message] = ()) -> None:
    """:func:`exchange`, then wait for it."""
    wait(exchange(group, sends, receives))


def send(tensor: torch.Tensor, group: dist.ProcessGroup, dst: int, header: bool = True) -> None:
    """Send ``tensor`` to group rank ``dst``: its header (unless ``header=False``: the receiver passes
    the layout to :func:`receive`), then its data (each a batch of its own, as :func:`receive` posts them)."""
    if tensor.dtype not in SENDABLE or tensor.dim() > tensor_header.MAX_DIMS:
        raise UsageError(f"a pipeline stage's output of dtype {tensor.dtype} and shape {list(tensor.shape)} cannot be "
                         f"sent to the next stage: give {[str(d) for d in SENDABLE]} with at most "
                         f"{tensor_header.MAX_DIMS} dims")
    if header:
        exchange_and_wait(group, sends=[(dst, tensor_header.encode(tensor))])
    exchange_and_wait(group, sends=[(dst, tensor)])


def receive(group: dist.ProcessGroup, src: int, device: torch.device, layout: Layout | None = None) -> torch.Tensor:
    """The tensor group rank ``src`` sends with :func:`send`: of ``layout`` when given (sent without a
    header), else of the header received first (one host read)."""
    if layout is None:
        header = tensor_header.empty(device)
        exchange_and_wait(group, receives=[(src, header)])
        layout = tensor_header.decode(header)
    shape, dtype = layout
    tensor = torch.empty(shape, dtype=dtype, device=device)
    exchange_and_wait(group, receives=[(src, tensor)])
    return tensor


__all__ = ["SENDABLE", "Layout", "Message", "exchange", "exchange_and_wait", "receive", "send", "wait"]
