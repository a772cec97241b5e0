"""A stand-in for a run's stage processes: real publishers, real command receivers.

``python tests/fake_run.py --bus ADDR ...`` publishes the events P stages of a
run publish (stage.started, run.started, step.started/ended with realistic
loss, lr, timings and memory, heartbeats, eval results, stage.stopped,
run.ended) and, like the stages, receives commands at every step boundary
on one `CommandReceiver` per stage and takes them as the stages do: each
stage's `CommandLedger` and `Orders` accept and acknowledge them for their
boundary; ``cmd.evaluate`` (a standing one too) runs an "evaluation" (the last
stage publishes eval.ended with the next value of ``--eval-losses``),
``cmd.stop`` ends the run with the command's reason.

With ``--dp D`` every stage runs on D replicas, as a data-parallel run's
processes publish: replica 0 (source ``stage/S``) everything above, each
replica d > 0 (source ``stage/S/d``) its own stage.started, heartbeats, step
events (its own timings and memory; the same loss and global samples as
replica 0) and stage.stopped, and nothing else. ``--spans`` adds every
process's microbatch spans: a forward and a backward per microbatch, the
waits for activations (later stages) and, with replicas, the wait for the
gradient reduction at the step's end (``op="reduce"``).

The built-in hook tests drive hooks with it where a real ``evtrain launch``
would cost 10+ s per test; stdout's last line is a JSON summary (commands
received, how the run ended). No torch import: it starts in ~0.2 s. Start it
once the hooks attached (a subscriber misses what was published before it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import uuid
from pathlib import Path

import anyio

from evtrain.bus.address import BusAddress
from evtrain.bus.commands import CommandLedger, CommandReceiver
from evtrain.bus.publisher import Publisher
from evtrain.bus.subscriber import Subscriber
from evtrain.events import (
    BusDrops,
    BusGaps,
    EvalEnded,
    EvalStarted,
    EvaluateNow,
    Heartbeat,
    MicrobatchBackward,
    MicrobatchForward,
    MicrobatchSpan,
    MicrobatchWait,
    RunEnded,
    RunStarted,
    StageStarted,
    StageStopped,
    StepEnded,
    StepStarted,
    StopRun,
)
from evtrain.run_state import stage_source
from evtrain.stages.orders import Orders

MIB = 1024 * 1024
MICROBATCHES = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bus", required=True)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas of each stage")
    parser.add_argument("--spans", action="store_true", help="publish microbatch spans")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.01, help="seconds per step")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--run-dir", default="")
    parser.add_argument("--run-id", default="")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--lr-decay-every", type=int, default=0, help="halve the lr every K steps")
    parser.add_argument("--eval-every", type=int, default=0, help="scheduled evals (engine's own)")
    parser.add_argument("--eval-losses", default="", help="comma-separated eval losses, in order")
    parser.add_argument("--memory-mib", type=int, default=100, help="stage 0's peak; +50 per stage")
    parser.add_argument("--drops-at", type=int, default=0, help="publish a bus.drops at step K")
    parser.add_argument("--gaps-at", type=int, default=0, help="publish a bus.gaps at step K")
    parser.add_argument("--pause-at", type=int, default=0, help="pause before step K ...")
    parser.add_argument("--pause", type=float, default=0.0, help="... for this many seconds")
    parser.add_argument("--pause-until", default="", help="... or until this file exists")
    parser.add_argument("--max-time", type=float, default=120.0)
    return parser.parse_args(argv)


class FakeRun:
    """P x D stage processes in one process: a publisher each, a command receiver per stage."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.address = BusAddress.parse(args.bus)
        self.run_id = args.run_id or uuid.uuid4().hex[:12]
        self.places = [(s, d) for s in range(args.stages) for d in range(args.dp)]
        self.all_pubs = {
            place: Publisher(
                self.address.endpoint("events_in"), source=stage_source(*place), run_id=self.run_id
            )
            for place in self.places
        }
        self.pubs = [self.all_pubs[(s, 0)] for s in range(args.stages)]
        """Replica 0's publishers, by stage: those of the whole run's events."""
        self.receivers = [
            CommandReceiver(self.address.endpoint("commands_out")) for _ in range(args.stages)
        ]
        self.stops = Subscriber(self.address.endpoint("events_out"), [StageStopped.topic.decode()])
        self.ledgers = [CommandLedger(s, self.pubs[s]) for s in range(args.stages)]
        self.orders = [Orders(last_step=args.steps) for _ in range(args.stages)]
        self.eval_losses = [float(x) for x in args.eval_losses.split(",") if x.strip()]
        self.evals = 0
        self.commands: list[dict[str, object]] = []
        self.last_heartbeat = 0.0

    @property
    def last(self) -> int:
        return self.args.stages - 1

    def heartbeat(self, step: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_heartbeat >= 0.3:
            self.last_heartbeat = now
            for (s, d), pub in self.all_pubs.items():
                # Where a stage in a step would be (heartbeats between steps say "").
                doing = "RecvActivation m1 from stage 0" if s else "Forward m1"
                pub.publish(Heartbeat(stage=s, replica=d, step=step, doing=doing, doing_s=0.002))

    def spans(self, step: int, start: float, end: float) -> None:
        """Every process's spans of one step, laid out between ``start`` and ``end``."""
        slot = (end - start) / (2 * MICROBATCHES + 2)
        for (s, d), pub in self.all_pubs.items():
            # (type, microbatch, start slot, slots, op): forwards, then backwards.
            layout: list[tuple[type[MicrobatchSpan], int, float, float, str]] = []
            for m in range(MICROBATCHES):
                if s > 0:
                    layout.append((MicrobatchWait, m, m, 0.25, "recv_act"))
                layout.append((MicrobatchForward, m, m + (0.25 if s > 0 else 0), 0.75, ""))
                layout.append((MicrobatchBackward, m, MICROBATCHES + m, 1, ""))
            if self.args.dp > 1:
                layout.append((MicrobatchWait, -1, 2 * MICROBATCHES, 1, "reduce"))
            for kind, m, at, length, op in layout:
                begin = start + at * slot
                extra = {"op": op} if op else {}
                pub.publish(
                    kind(
                        step=step,
                        stage=s,
                        replica=d,
                        microbatch=m,
                        start=begin,
                        end=begin + length * slot,
                        **extra,
                    )
                )

    def step(self, step: int) -> None:
        args = self.args
        for (s, d), pub in self.all_pubs.items():
            pub.publish(StepStarted(step=step, stage=s, replica=d))
        began = time.time()
        time.sleep(args.step_time)
        if args.spans:
            self.spans(step, began, time.time())
        lr = args.lr
        if args.lr_decay_every:
            lr = args.lr * 0.5 ** ((step - 1) // args.lr_decay_every)
        loss = 2.0 * math.exp(-step / 50) + 0.1 * math.sin(step)
        # The last stage finishes a step first; stage 0 runs the final backward.
        # Every replica reports the global loss and samples, and its own times.
        for s, d in sorted(self.places, key=lambda place: (-place[0], place[1])):
            duration = args.step_time * (1.0 + 0.01 * s) * (1.0 + 0.1 * d)
            self.all_pubs[(s, d)].publish(
                StepEnded(
                    step=step,
                    stage=s,
                    replica=d,
                    loss=loss if s == self.last else None,
                    lr=lr,
                    grad_norm=1.0 + 0.01 * step if s == self.last else None,
                    samples=args.batch_size,
                    duration_s=duration,
                    forward_s=0.3 * duration,
                    backward_s=0.4 * duration,
                    comm_wait_s=0.2 * duration,
                    peak_memory_bytes=(args.memory_mib + 50 * s + 10 * d) * MIB + step * 1024,
                    metrics={"tokens": float(args.batch_size * 16)} if s == self.last else {},
                )
            )

    def evaluate(self, step: int) -> None:
        losses = self.eval_losses or [1.0]
        value = losses[min(self.evals, len(losses) - 1)]
        self.evals += 1
        pub = self.pubs[self.last]
        pub.publish(EvalStarted(step=step, stage=self.last, num_batches=2))
        pub.publish(
            EvalEnded(
                step=step,
                stage=self.last,
                metrics={"loss": value, "accuracy": 1.0 - value / 10},
                samples=64,
                duration_s=0.002,
            )
        )

    async def boundary(self, step: int) -> tuple[bool, str | None]:
        """Commands of every stage at this boundary: (evaluate?, stop reason)."""
        evaluate, stop = self.orders[0].evaluation_due(step), None
        # Every stage takes what it received; stage 0's commands decide what
        # happens (the real stages agree on them in a control collective).
        for s, receiver in enumerate(self.receivers):
            accepted = []
            for command in receiver.poll():
                if not self.ledgers[s].admit(command):
                    continue
                taken = self.orders[s].accept(command, step)
                self.ledgers[s].ack(
                    command, step=taken.step, ok=taken.ok, detail=taken.detail, late=taken.late
                )
                if taken.ok and taken.step == step:
                    accepted.append(command)
            for command in self.orders[s].due(step, accepted):
                if s != 0:
                    continue
                self.commands.append(
                    {"type": command.topic.decode(), "step": step, "source": command.source}
                )
                if isinstance(command, EvaluateNow):
                    evaluate = self.orders[0].add_evaluation(command, step) or evaluate
                elif isinstance(command, StopRun):
                    stop = command.reason or "stopped"
        return evaluate, stop

    async def run(self) -> dict[str, object]:
        args = self.args
        for (s, d), pub in self.all_pubs.items():
            pub.publish(
                StageStarted(
                    stage=s,
                    replica=d,
                    num_stages=args.stages,
                    rank=s * args.dp + d,
                    host="fake",
                    pid=0,
                    device="cpu",
                    layers=[s],
                    num_params=1000,
                )
            )
        self.pubs[0].publish(
            RunStarted(
                name="fake",
                num_stages=args.stages,
                num_microbatches=4,
                schedule="1f1b",
                max_steps=args.steps,
                batch_size=args.batch_size,
                run_dir=args.run_dir,
                data_parallel=args.dp,
            )
        )
        deadline = time.monotonic() + args.max_time
        status, reason, step = "completed", "", 0
        while step < args.steps:
            if time.monotonic() > deadline:
                status, reason = "stopped", "max time"
                break
            if args.pause_at and step + 1 == args.pause_at:
                end = time.monotonic() + args.pause
                held = Path(args.pause_until) if args.pause_until else None
                while (
                    time.monotonic() < end if held is None else not held.exists()
                ) and time.monotonic() < deadline:
                    self.heartbeat(step)
                    await anyio.sleep(0.05)
            step += 1
            self.step(step)
            self.heartbeat(step)
            if args.drops_at == step:
                self.pubs[0].publish(BusDrops(dropped=5, total_dropped=5))
            if args.gaps_at == step:
                self.pubs[0].publish(BusGaps(from_source="stage/1", missing=3, total_missing=3))
            await anyio.sleep(0)
            evaluate, stop = await self.boundary(step)
            if evaluate or (args.eval_every and step % args.eval_every == 0):
                self.evaluate(step)
            if stop is not None:
                status, reason = "stopped", stop
                break
        # Late commands (sent while the last step ran) still get their acknowledgement.
        await anyio.sleep(0.05)
        await self.boundary(step)
        # As the real stages do: RunEnded only once every stage's StageStopped came
        # back through the broker, so no hook exits before a stage's last event.
        for (s, d), pub in self.all_pubs.items():
            pub.publish(StageStopped(stage=s, replica=d, status=status, reason=reason))
        stopped: set[tuple[int, int]] = set()
        with anyio.move_on_after(10):
            while len(stopped) < len(self.places):
                for msg in await self.stops.receive(timeout=0.2):
                    if isinstance(msg, StageStopped) and msg.run_id == self.run_id:
                        stopped.add((msg.stage, msg.replica))
        self.pubs[0].publish(RunEnded(status=status, reason=reason, step=step))
        return {
            "run_id": self.run_id,
            "status": status,
            "reason": reason,
            "steps": step,
            "evals": self.evals,
            "commands": self.commands,
        }

    def close(self) -> None:
        self.stops.close()
        for pub in self.all_pubs.values():
            pub.close()
        for receiver in self.receivers:
            receiver.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fake = FakeRun(args)
    try:
        summary = anyio.run(fake.run)
    finally:
        fake.close()
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
