"""``baft plan``: the bubble map and where each checkpoint task lands.

Two sources: a simulator preset (the scenario flags of ``baft simulate``, planned by
``baft.sim.command.planned``) or, with ``--run RUN_DIR``, a real checkpointed run
re-planned from its saved inputs (``baft.profile.planrun.plan_from_run``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from baft.cli.simulate import add_scenario_args, fail, policy_from_args, scenario_from_args


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="show the bubble map and the checkpoint plan")
    p.add_argument(
        "--run",
        metavar="RUN_DIR",
        help="plan of a real checkpointed run (its measured bubbles) instead of a preset",
    )
    add_scenario_args(p)
    p.add_argument("--ranks", help="comma-separated global ranks to show (default: dp=0,tp=0)")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """Entry point of ``baft plan``: a real run's profile (``--run``) or a simulator preset."""
    if getattr(args, "run", None):
        try:
            return _plan_of_run(Path(args.run), as_json=args.json)
        except ValueError as err:
            return fail(err)
    from baft.plan.render import bubble_table, bubbles_to_dict, plan_table, plan_to_dict
    from baft.plan.types import TaskKind
    from baft.sim.command import planned

    try:
        scn = scenario_from_args(args)
        _, bubbles, plan, _ = planned(scn, policy_from_args(args), args.storage_gbps * 1e9)
        topo = scn.topology
        if args.ranks:
            ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
            bad = [r for r in ranks if r not in plan.ranks]
            if bad:
                raise ValueError(f"--ranks {bad} outside 0..{topo.world_size - 1}")
        else:
            ranks = [topo.rank_of(pp, 0, 0) for pp in range(topo.num_pp)]
    except ValueError as err:
        return fail(err)
    if args.json:
        shown = set(ranks)
        out = plan_to_dict(plan)
        out["ranks"] = {k: v for k, v in out["ranks"].items() if int(k) in shown}
        print(
            json.dumps(
                {
                    "bubble_maps": bubbles_to_dict({r: bubbles[r] for r in sorted(shown)}),
                    "plan": out,
                }
            )
        )
        return 0
    print(bubble_table(bubbles, ranks))
    print()
    print(plan_table(plan, bubbles, ranks))
    print()
    print(plan.reason)
    snaps = sum(
        t.nbytes
        for rp in plan.ranks.values()
        for ts in rp.tasks.values()
        for t in ts
        if t.kind is TaskKind.SNAPSHOT
    )
    print(f"\n{snaps / 1e9:.2f} GB of snapshot copies planned inside bubbles across all ranks")
    return 0


def _plan_of_run(run_dir: Path, *, as_json: bool) -> int:
    """``baft plan --run``: tables of the re-planned run and where its tasks ran."""
    from baft.plan.render import bubble_table, plan_table, plan_to_dict
    from baft.profile.planrun import plan_from_run

    r = plan_from_run(run_dir)
    if as_json:
        out: dict[str, Any] = {
            "plan": plan_to_dict(r.plan),
            "placement": r.placement,
            "png": str(r.png),
        }
        print(json.dumps(out))
        return 0
    print(bubble_table(r.bubbles))
    print()
    print(plan_table(r.plan, r.bubbles))
    print()
    for rank, c in sorted(r.placement.items()):
        print(
            f"rank {rank}: {c['in_bubble']} snapshot tasks ran inside measured bubbles, "
            f"{c['spilled']} were spilled to the pre-step window (exposed)"
        )
    print(f"timeline with the executed tasks: {r.png}")
    return 0
