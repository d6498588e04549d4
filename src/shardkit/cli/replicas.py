"""``shardkit replicas``: print how replicas split into groups (no processes started)::

    shardkit replicas --replication-factor 16 --group-size 4 --stride 4
    shardkit replicas --replication-factor 16 --group-size 4 --transpose
    shardkit replicas --assignment 0,1,1,0
"""

from __future__ import annotations

import argparse

from ..plan import PlanError, ReplicaGrouping
from ..plan.replicas import grouping_table


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "replicas", help="print the replica groups of a grouping",
        description="Print which replicas form each group for a replication factor, group size and stride "
                    "(PopXL's replica groupings), or for an explicit replica -> group assignment.")
    parser.add_argument("--replication-factor", type=int, help="number of replicas (the size of the dp axis)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="replicas per group (default: replication factor // stride)")
    parser.add_argument("--stride", type=int, default=1, help="replica index difference within a group (default: 1)")
    parser.add_argument("--assignment", help="explicit groups, one per replica, e.g. '0,1,1,0'")
    parser.add_argument("--transpose", action="store_true", help="print the orthogonal (transposed) grouping")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.assignment is not None:
        if args.group_size is not None or args.stride != 1:
            raise PlanError("--assignment gives the groups itself; drop --group-size and --stride")
        try:
            values = [int(v) for v in args.assignment.split(",") if v.strip()]
        except ValueError:
            raise PlanError(f"--assignment {args.assignment!r} must be integers separated by commas, "
                            f"e.g. '0,0,1,1'") from None
        grouping = ReplicaGrouping.from_assignment(values)
        if args.replication_factor is not None and args.replication_factor != grouping.replication_factor:
            raise PlanError(f"--replication-factor {args.replication_factor} but --assignment has "
                            f"{grouping.replication_factor} entries (one per replica)")
    elif args.replication_factor is None:
        raise PlanError("give --replication-factor N (with --group-size / --stride) or --assignment")
    else:
        grouping = ReplicaGrouping(args.replication_factor, args.group_size, args.stride)
    if args.transpose:
        grouping = grouping.transpose()
    print(grouping_table(grouping))
    print("assignment (replica -> group): " + ", ".join(map(str, grouping.assignment)))
    problems = grouping.popxl_problems()
    print("PopXL's documented rules: " + ("satisfied" if not problems else "not satisfied: " + "; ".join(problems)))
    if not grouping.is_constant:
        print("not constant (no single group_size and stride): PopXL's collectives reject it, shardkit's accept it")
    return 0
