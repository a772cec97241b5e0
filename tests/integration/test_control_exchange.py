"""The step boundary's control exchange over real gloo process groups (`evtrain.stages.control`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

DRIVER = """
import json, multiprocessing, os, sys
import torch
import torch.distributed as dist
from evtrain.bus.address import free_port_block
from evtrain.launcher.forking import start_fork_server


def member(rank, world, port, out):
    from evtrain.stages.control import StepControl

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    control = StepControl(rank=rank, world_size=world, group=dist.group.WORLD)
    results = []
    for step in range(4):
        control.prepare()
        # Values whose float sum depends on the order they are added in.
        sq_norm = (rank + 1) * 0.1 + step * 1e-17
        exchange = control.start(sq_norm, signalled=(rank == world - 1 and step == 2),
                                 loss_share=1.0 / 3.0 * (rank + 1))
        result = exchange.finish()
        results.append({"norm": result.grad_norm.hex(), "loss": result.loss.hex(),
                        "signalled": result.signalled})
    dist.destroy_process_group()
    with open(os.path.join(out, f"{world}-{rank}.json"), "w") as f:
        json.dump({"parent": control.parent, "children": control.children, "steps": results}, f)


if __name__ == "__main__":
    start_fork_server(["evtrain.stages.control"])
    context = multiprocessing.get_context("forkserver")
    out = sys.argv[1]
    for world in json.loads(sys.argv[2]):
        port = free_port_block()
        members = [context.Process(target=member, args=(r, world, port, out)) for r in range(world)]
        for m in members:
            m.start()
        for m in members:
            m.join(120)
            if m.exitcode != 0:
                for other in members:
                    other.kill()
                sys.exit(f"world {world}: a member exited {m.exitcode}")
"""

WORLDS = [2, 3, 6, 8]


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, object]]]:
    """Every member's view of four exchanges, for each world size."""
    tmp = tmp_path_factory.mktemp("control")
    script = tmp / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp), json.dumps(WORLDS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {
        world: [json.loads((tmp / f"{world}-{rank}.json").read_text()) for rank in range(world)]
        for world in WORLDS
    }


@pytest.mark.parametrize("world", WORLDS)
def test_every_member_gets_the_same_bits_of_the_sums(
    exchanged: dict[int, list[dict[str, object]]], world: int
) -> None:
    members = exchanged[world]
    for step in range(4):
        seen = {json.dumps(m["steps"][step]) for m in members}  # type: ignore[index]
        assert len(seen) == 1, f"world {world}, step {step}: {seen}"
        result = members[0]["steps"][step]  # type: ignore[index]
        norm = float.fromhex(result["norm"])
        expected = sum((r + 1) * 0.1 + step * 1e-17 for r in range(world)) ** 0.5
        assert norm == pytest.approx(expected, rel=1e-12)
        loss = float.fromhex(result["loss"])
        assert loss == pytest.approx(sum((r + 1) / 3.0 for r in range(world)), rel=1e-12)
        # One member's signal reaches every member at the same boundary.
        assert result["signalled"] == (step == 2)


@pytest.mark.parametrize("world", WORLDS)
def test_each_member_talks_to_at_most_three_others(
    exchanged: dict[int, list[dict[str, object]]], world: int
) -> None:
    members = exchanged[world]
    parents = [m["parent"] for m in members]
    assert parents[0] is None
    for rank, member in enumerate(members):
        children = member["children"]
        assert isinstance(children, list) and len(children) <= 2
        for child in children:
            assert parents[child] == rank
    # A tree: every member but the root has one parent, which lists it.
    assert sum(len(m["children"]) for m in members) == world - 1  # type: ignore[arg-type]
