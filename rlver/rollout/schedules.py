"""When each dialogue's next reply is sampled: in lockstep, or as soon as its user has answered.

`lockstep`: every turn, all active dialogues are sampled in one engine call, then all their
users answer in one simulator call; the turn waits for the slowest generation and the slowest
answer before any dialogue goes on.

`dialogue` (the default): a dialogue goes on as soon as its own user has answered. Users that
wait on an endpoint (`UserSimulator.waits_on_io`) are asked one dialogue at a time from a thread
pool; the engine samples, in one call, every dialogue whose answer is in. In-process users
answer a whole call's replies at once, so for them the two schedules make the same calls.

Neither schedule changes what a dialogue samples: each reply is drawn with a seed of its own
(`turn_seed` of the call's seed, the turn and the dialogue's index), whatever else shares its
engine call. Its recorded log-probs may still differ in their last bits with the call's other
prompts (the kernels' shapes change), and under `dialogue` with users on an endpoint the
answers' timing decides who shares a call: runs agree closely, and bitwise only in `lockstep`
(docs/performance.md, "Rollouts that do not wait at every turn").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from rlver.core.types import UserTurn
from rlver.rollout.dialogue import DialogueDriver, RunningDialogue

if TYPE_CHECKING:
    from rlver.core.trajectory import PolicyTurn

SCHEDULES = ("dialogue", "lockstep")
# Answers that arrive within this long of the first one join the same engine call: a little
# waiting for fuller calls (the engine's cost grows slowly with the batch), never a barrier.
GATHER_SECONDS = 0.05


def turn_seed(call_seed: int, turn: int, index: int) -> int:
    """The sampling seed of one reply: dialogue `index` of a `run(seed=call_seed)`, at `turn`.

    The seed rlver's lockstep loop gave the reply at position `index` of a turn's engine call
    before replies had seeds of their own, so a dialogue that is at its own index in that call
    (every dialogue, while none has ended early) samples what it sampled then."""
    return (call_seed + turn) * 1_000_003 + index


OnTurn = Callable[[int, int], None] | None
ShouldStop = Callable[[], bool] | None


def run_lockstep(
    runner: DialogueDriver, dialogues: list[RunningDialogue], on_turn: OnTurn, should_stop: ShouldStop
) -> None:
    active = [d for d in dialogues if not d.trajectory.termination]
    for turn in range(runner.settings.max_turns):
        runner.check_stop(should_stop, turn)
        active = [d for d in active if runner.fits_context(d)]
        if not active:
            break
        active = answer_together(runner, active, runner.sample(active))
        if on_turn is not None:
            on_turn(turn + 1, len(active))


def answer_together(
    runner: DialogueDriver, batch: list[RunningDialogue], policy_turns: list[PolicyTurn]
) -> list[RunningDialogue]:
    """The users of `batch` answer its replies in one simulator call; the dialogues still going."""
    started = time.perf_counter()
    user_turns = runner.simulator.respond_batch(
        [d.session for d in batch], [t.parsed.visible for t in policy_turns]
    )
    runner.timings["simulator"] += time.perf_counter() - started
    for dialogue, policy_turn, user_turn in zip(batch, policy_turns, user_turns, strict=True):
        runner.advance(dialogue, policy_turn, user_turn)
    return [d for d in batch if not d.trajectory.termination]


class _Answers:
    """The users' answers in flight: one future per dialogue (or per group, for openings)."""

    def __init__(self, runner: DialogueDriver, size: int) -> None:
        self.runner = runner
        self.pool = ThreadPoolExecutor(max_workers=max(size, 1), thread_name_prefix="rlver-user")
        self.in_flight: dict[Future, Callable[[list[UserTurn]], list[RunningDialogue]]] = {}

    def ask(
        self, call: Callable[[], list[UserTurn]], then: Callable[[list[UserTurn]], list[RunningDialogue]]
    ) -> None:
        self.in_flight[self.pool.submit(call)] = then

    def collect(self, block: bool) -> list[RunningDialogue]:
        """The dialogues whose users have answered (waiting for the first when `block`)."""
        if not self.in_flight:
            return []
        started = time.perf_counter()
        if block:
            wait(self.in_flight, return_when=FIRST_COMPLETED)
            wait(self.in_flight, timeout=GATHER_SECONDS)  # answers arriving right after: same call
        done = [future for future in self.in_flight if future.done()]
        self.runner.timings["simulator"] += time.perf_counter() - started
        ready = []
        for future in done:
            then = self.in_flight.pop(future)
            ready.extend(then(future.result()))  # a simulator's exception ends the rollout here
        return ready

    def close(self) -> None:
        for future in self.in_flight:
            future.cancel()
        # Calls already running finish on their own (bounded by the client's timeout); nothing
        # waits for them, and their sessions are dropped with the rollout.
        self.pool.shutdown(wait=False, cancel_futures=True)


def run_dialogue_level(
    runner: DialogueDriver,
    dialogues: list[RunningDialogue],
    openings: Callable[[_Answers], list[RunningDialogue]],
    on_turn: OnTurn,
    should_stop: ShouldStop,
) -> None:
    """`openings(answers)`: the dialogues ready now; it may ask for the rest through `answers`."""
    answers = _Answers(runner, len(dialogues))
    in_process = not runner.simulator.waits_on_io
    try:
        ready = openings(answers)
        furthest = 0
        while ready or answers.in_flight:
            ready += answers.collect(block=not ready)
            ready = sorted((d for d in ready if runner.fits_context(d)), key=lambda d: d.index)
            if not ready:
                continue
            runner.check_stop(should_stop, furthest)
            batch, ready = ready, []
            policy_turns = runner.sample(batch)
            furthest = max(furthest, *(d.trajectory.num_turns + 1 for d in batch))
            if in_process:
                ready = answer_together(runner, batch, policy_turns)
            else:
                for dialogue, policy_turn in zip(batch, policy_turns, strict=True):
                    answers.ask(
                        _respond_call(runner, dialogue, policy_turn),
                        _then_advance(runner, dialogue, policy_turn),
                    )
            if on_turn is not None:
                on_turn(furthest, sum(not d.trajectory.termination for d in dialogues))
    finally:
        answers.close()


def _respond_call(
    runner: DialogueDriver, dialogue: RunningDialogue, policy_turn: PolicyTurn
) -> Callable[[], list[UserTurn]]:
    return lambda: runner.simulator.respond_batch([dialogue.session], [policy_turn.parsed.visible])


def _then_advance(
    runner: DialogueDriver, dialogue: RunningDialogue, policy_turn: PolicyTurn
) -> Callable[[list[UserTurn]], list[RunningDialogue]]:
    def then(user_turns: list[UserTurn]) -> list[RunningDialogue]:
        runner.advance(dialogue, policy_turn, user_turns[0])
        return [] if dialogue.trajectory.termination else [dialogue]

    return then


def group_openings(
    runner: DialogueDriver, group_size: int, dialogues: Sequence[RunningDialogue]
) -> Callable[[_Answers], list[RunningDialogue]]:
    """Openings for `run_dialogue_level`: each group's opening is asked for on its own; the
    group's members (who adopt it) start together as soon as it has arrived."""

    def ask_for(group: list[RunningDialogue]) -> Callable[[], list[UserTurn]]:
        return lambda: runner.openings([d.session for d in group], group_size)

    def start(group: list[RunningDialogue]) -> Callable[[list[UserTurn]], list[RunningDialogue]]:
        return lambda written: runner.start(group, written)

    def openings(answers: _Answers) -> list[RunningDialogue]:
        for leader in range(0, len(dialogues), group_size):
            group = list(dialogues[leader : leader + group_size])
            answers.ask(ask_for(group), start(group))
        return []

    return openings
