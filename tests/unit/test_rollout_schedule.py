"""Dialogue-level scheduling: dialogues go on as their users answer, and sample what lockstep does."""

from __future__ import annotations

import threading
import time

import pytest
from rlver_plugins.formats import NoThinkFormat
from rlver_plugins.hf_engine import HFEngine
from rlver_plugins.sage_user import SageUserSimulator
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

from rlver.core.interfaces import SimulatorUnavailable
from rlver.core.types import UserTurn
from rlver.modeling.models import load_policy
from rlver.rollout.runner import RolloutRunner, RolloutSettings, StopRequested
from tests.unit.test_rollout import ScriptedSession, ScriptedSimulator, make_profile


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir))


# How long a held answer waits for its release before the test counts the schedule as stuck
# (far above any CPU's time for the work that releases it; reached only when the check fails).
HOLD_LIMIT_SECONDS = 120.0


class EndpointSession(ScriptedSession):
    """An answer that takes `delays[turn]` seconds, as an LLM endpoint's would; the `held` one
    waits until the simulator releases it."""

    def __init__(self, profile, simulator):
        super().__init__(profile, success_at=1000)
        self.simulator = simulator

    def respond(self, reply):
        simulator, key = self.simulator, (self.profile.id, len(self.replies))
        time.sleep(simulator.delays.get(key, 0.0))
        if key == simulator.held and not simulator.release.wait(timeout=HOLD_LIMIT_SECONDS):
            simulator.held_too_long = True
        with simulator.lock:
            simulator.answered.append(key)
            others = sum(who != simulator.held[0] for who, _ in simulator.answered) if simulator.held else 0
            if simulator.release_after is not None and others >= simulator.release_after:
                simulator.release.set()
        if self.profile.id in simulator.failing:
            return UserTurn("", self.emotion, 0.0, {"error": "injected"}, "simulator_error")
        if self.profile.id in simulator.gone:
            raise SimulatorUnavailable("the endpoint is gone")
        return super().respond(reply)


class EndpointSimulator(ScriptedSimulator):
    """`held`: the (profile id, turn) whose answer waits for `release` (set by the test, or once
    `release_after` answers of the other dialogues are in): ordering without timing."""

    waits_on_io = True

    def __init__(self, delays=None, failing=(), gone=(), held=None, release_after=None):
        super().__init__()
        self.delays, self.failing, self.gone = dict(delays or {}), set(failing), set(gone)
        self.held, self.release_after = held, release_after
        self.release, self.held_too_long = threading.Event(), False
        self.lock = threading.Lock()
        self.answered = []
        self.threads = set()

    def open(self, profile, *, seed):
        session = EndpointSession(profile, self)
        self.sessions.append(session)
        return session

    def respond_batch(self, sessions, replies):
        self.threads.add(threading.current_thread().name)
        return super().respond_batch(sessions, replies)


class CountingEngine(HFEngine):
    def __init__(self, policy):
        super().__init__(policy)
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        return super().generate(prompts, sampling)


def run(policy, simulator, schedule, profiles, group_size=1, **settings):
    engine = CountingEngine(policy)
    options = dict(max_turns=3, max_new_tokens=12, temperature=1.0, seed=3, schedule=schedule)
    runner = RolloutRunner(
        policy, engine, simulator, NoThinkFormat(), RolloutSettings(**{**options, **settings})
    )
    return runner.run(profiles, group_size=group_size), engine


def tokens(trajectories):
    return [[(t.prompt_ids, t.response_ids) for t in trajectory.policy_turns] for trajectory in trajectories]


PROFILES = [make_profile(name, f"{name}: my week was hard.") for name in ("a", "b", "c", "d")]


def test_with_an_in_process_user_the_dialogue_schedule_makes_lockstep_calls(tiny_policy):
    lockstep, lockstep_engine = run(tiny_policy, ScriptedSimulator(), "lockstep", PROFILES)
    dialogue, dialogue_engine = run(tiny_policy, ScriptedSimulator(), "dialogue", PROFILES)
    assert dialogue_engine.calls == lockstep_engine.calls == [4, 4, 4]
    assert [t.to_record() for t in dialogue] == [t.to_record() for t in lockstep]
    assert [[p.logprobs for p in t.policy_turns] for t in dialogue] == [
        [p.logprobs for p in t.policy_turns] for t in lockstep
    ]


def test_with_an_instant_endpoint_user_the_dialogues_equal_lockstep(tiny_policy):
    lockstep, _ = run(tiny_policy, EndpointSimulator(), "lockstep", PROFILES)
    simulator = EndpointSimulator()
    dialogue, _ = run(tiny_policy, simulator, "dialogue", PROFILES)
    assert tokens(dialogue) == tokens(lockstep)
    assert [t.emotions for t in dialogue] == [t.emotions for t in lockstep]
    assert all(name.startswith("rlver-user") for name in simulator.threads)  # asked from the pool


def test_a_slow_user_holds_up_only_its_own_dialogue(tiny_policy):
    """User a's first answer is held until b, c and d have had all three turns answered: that
    can happen only if they go on without a (with a barrier they would wait for it, and it for
    them, until HOLD_LIMIT_SECONDS). Every dialogue samples what lockstep samples."""
    lockstep, lockstep_engine = run(tiny_policy, EndpointSimulator(), "lockstep", PROFILES)
    simulator = EndpointSimulator(held=("a", 0), release_after=9)
    dialogue, engine = run(tiny_policy, simulator, "dialogue", PROFILES)
    assert not simulator.held_too_long, "b, c and d waited for a"
    assert tokens(dialogue) == tokens(lockstep)
    assert lockstep_engine.calls == [4, 4, 4]
    first_a = simulator.answered.index(("a", 0))
    assert sorted(simulator.answered[:first_a]) == [(who, turn) for who in "bcd" for turn in range(3)]
    # one call for all four; then b-d's two more turns (in two calls, or more where an answer
    # came in after the others' gathering window); then a alone, twice
    assert engine.calls[0] == 4 and engine.calls[-2:] == [1, 1]
    assert sum(engine.calls[1:-2]) == 6 and len(engine.calls[1:-2]) >= 2


def test_groups_share_their_opening_and_start_when_it_arrives(tiny_policy):
    group = [make_profile("a")] * 2 + [make_profile("b", "b: work is awful.")] * 2
    lockstep, _ = run(tiny_policy, EndpointSimulator(), "lockstep", group, group_size=2)
    dialogue, _ = run(tiny_policy, EndpointSimulator({("a", 0): 0.3}), "dialogue", group, group_size=2)
    assert tokens(dialogue) == tokens(lockstep)
    assert dialogue[0].user_turns[0] == dialogue[1].user_turns[0]
    assert dialogue[0].policy_turns[0].response_ids != dialogue[1].policy_turns[0].response_ids


def test_a_failed_answer_ends_only_its_dialogue_and_a_gone_endpoint_ends_the_rollout(tiny_policy):
    dialogue, _ = run(tiny_policy, EndpointSimulator(failing={"b"}), "dialogue", PROFILES)
    assert [t.termination for t in dialogue] == ["max_turns", "simulator_error", "max_turns", "max_turns"]
    assert dialogue[1].num_turns == 1 and dialogue[0].num_turns == 3
    with pytest.raises(SimulatorUnavailable, match="gone"):
        run(tiny_policy, EndpointSimulator(gone={"c"}), "dialogue", PROFILES)


def test_a_stop_is_honoured_without_waiting_for_a_slow_user(tiny_policy):
    """a's first answer is held for as long as the test runs: the stop (after the second engine
    call) ends the rollout while it is still out."""
    simulator = EndpointSimulator(held=("a", 0))
    engine = CountingEngine(tiny_policy)
    settings = RolloutSettings(max_turns=3, max_new_tokens=8, seed=3, schedule="dialogue")
    runner = RolloutRunner(tiny_policy, engine, simulator, NoThinkFormat(), settings)
    try:
        with pytest.raises(StopRequested):
            runner.run(PROFILES, should_stop=lambda: len(engine.calls) >= 2)
        assert ("a", 0) not in simulator.answered and not simulator.held_too_long
    finally:
        simulator.release.set()  # the abandoned call finishes on its own thread


def test_the_sage_user_behind_a_server_with_latency_gives_lockstep_dialogues(tiny_policy):
    """The real client and HTTP: uneven latencies, each dialogue still samples what lockstep does."""
    with ScriptedServer(Script(latency_spec="uniform:0:0.2")) as server:
        results = {}
        for schedule in ("lockstep", "dialogue"):
            simulator = SageUserSimulator(server.url, "scripted-user", max_retries=0, timeout=30)
            results[schedule], _ = run(tiny_policy, simulator, schedule, PROFILES[:3], max_turns=2)
            simulator.close()
    assert tokens(results["dialogue"]) == tokens(results["lockstep"])
    assert [t.emotions for t in results["dialogue"]] == [t.emotions for t in results["lockstep"]]


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule .'async'. must be one of dialogue, lockstep"):
        RolloutSettings(schedule="async")
