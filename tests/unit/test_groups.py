"""GRPO groups: one persona, one opening line, per group, whatever the simulator."""

import dataclasses

import pytest
from rlver_plugins.embedded_user import EmbeddedUserSimulator
from rlver_plugins.formats import NoThinkFormat
from rlver_plugins.sage_user import SageUserSimulator
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer, call_kind

from rlver.core.interfaces import Generation, RolloutEngine
from rlver.data.profiles import load_profile_sets
from rlver.rollout.runner import RolloutRunner, RolloutSettings
from tests.plugins.test_sage_user import FAST, person

pytestmark = pytest.mark.slow  # the real tokenizer (policy fixture)


class CannedEngine(RolloutEngine):
    """Every prompt gets the same short reply: only the user's side varies."""

    def __init__(self, policy):
        self.ids = [*policy.tokenizer("I'm here, tell me more.")["input_ids"], policy.stop_token_ids[0]]

    def generate(self, prompts, sampling):
        return [Generation(tuple(self.ids), tuple([-0.5] * len(self.ids)), "stop") for _ in prompts]


def runner(policy, simulator):
    settings = RolloutSettings(max_turns=1, max_new_tokens=16)
    return RolloutRunner(policy, CannedEngine(policy), simulator, NoThinkFormat(), settings)


def without_first_talk(count):
    # The official RLVER training profiles have no first_talk: the user writes the opening.
    return [dataclasses.replace(p, first_talk=None) for p in load_profile_sets(["builtin:en_train"])[:count]]


def openings(trajectories):
    return [t.user_turns[0].text for t in trajectories]


def test_embedded_user_group_members_share_the_opening(policy):
    (a,) = without_first_talk(1)
    run = runner(policy, EmbeddedUserSimulator()).run
    # Seeds are stable hashes, so these draws are fixed: without groups the user's first
    # words vary from dialogue to dialogue (two openers per personality here).
    alone = openings(run([a] * 12, seed=7))
    assert len(set(alone)) > 1
    grouped = openings(run([a] * 12, seed=7, group_size=3))
    groups = [grouped[i : i + 3] for i in range(0, 12, 3)]
    assert all(len(set(group)) == 1 for group in groups)
    assert len({group[0] for group in groups}) > 1  # each group is its own draw


def test_llm_user_writes_one_opening_per_group(policy):
    with ScriptedServer(Script()) as server:
        simulator = SageUserSimulator(server.url, "scripted-user", **FAST)
        trajectories = runner(policy, simulator).run(
            [person("Ana", None)] * 3 + [person("Ben", None)] * 3, seed=1, group_size=3
        )
        simulator.close()
        kinds = [call_kind(request["messages"]) for request in server.script.requests]
    assert kinds.count("open") == 2  # one per group, not one per dialogue
    texts = openings(trajectories)
    assert len(set(texts[:3])) == 1 and len(set(texts[3:])) == 1
    assert all(t.num_turns == 1 and t.termination != "simulator_error" for t in trajectories)


def test_groups_must_be_whole_and_of_one_profile(policy):
    run = runner(policy, EmbeddedUserSimulator()).run
    a, b = without_first_talk(2)
    with pytest.raises(ValueError, match="groups of 2"):
        run([a, a, b], group_size=2)
    with pytest.raises(ValueError, match="mixes profiles"):
        run([a, b], group_size=2)
