"""The multi-turn loop with the real SmolLM2: exact tokens, masks, termination, transcripts."""

import json
from dataclasses import replace

import pytest
from rlver_plugins.formats import NoThinkFormat, ThinkFormat
from rlver_plugins.hf_engine import HFEngine

from rlver.core.interfaces import Generation, ParsedReply, RolloutEngine, UserSession, UserSimulator
from rlver.core.types import Profile, UserTurn
from rlver.rollout.runner import PolicyTurn, RolloutRunner, RolloutSettings, pack_sequences, summarize
from rlver.rollout.transcripts import TranscriptWriter, read_transcripts


def make_profile(pid, first_talk="My sister moved away and I feel lost.", **extra):
    return Profile(
        pid,
        "* Name: Ana",
        "A story.",
        "passive",
        ("a", "b", "c"),
        "You want deep empathy for what you feel, not shallow comfort.",
        first_talk=first_talk,
        extra=extra,
    )


class ScriptedSession(UserSession):
    """+5 per reply; ends with success once a dialogue reaches `success_at`."""

    def __init__(self, profile, success_at):
        self.profile = profile
        self.success_at = success_at
        self._emotion = 40.0
        self.replies = []

    @property
    def emotion(self):
        return self._emotion

    def opening(self):
        return UserTurn(self.profile.first_talk, self._emotion)

    def respond(self, reply):
        self.replies.append(reply)
        self._emotion += 5
        done = "success" if self._emotion >= self.success_at else None
        return UserTurn(
            f"I see. Tell me more about {len(self.replies)}.", self._emotion, 5.0, {"why": "scripted"}, done
        )


class ScriptedSimulator(UserSimulator):
    def __init__(self, success_at=1000):
        self.success_at = success_at
        self.sessions = []

    def open(self, profile, *, seed):
        session = ScriptedSession(profile, self.success_at)
        self.sessions.append(session)
        return session


def runner_for(policy, prompt_format, simulator, **settings):
    defaults = dict(max_turns=2, max_new_tokens=24, temperature=1.0, seed=1)
    return RolloutRunner(
        policy, HFEngine(policy), simulator, prompt_format, RolloutSettings(**{**defaults, **settings})
    )


def assert_masks_cover_exactly_the_sampled_ids(trajectory):
    sequences = trajectory.sequences
    sampled = [t.response_ids for t in trajectory.policy_turns]
    covered = []
    for sequence in sequences:
        assert len(sequence.input_ids) == len(sequence.loss_mask) == len(sequence.old_logprobs)
        for turn_index, start, end in sequence.turn_spans:
            turn = trajectory.policy_turns[turn_index]
            assert sequence.input_ids[start:end] == turn.response_ids
            assert sequence.old_logprobs[start:end] == turn.logprobs
            assert sequence.input_ids[:start][-len(turn.prompt_ids) :] == turn.prompt_ids or start == len(
                turn.prompt_ids
            )
        masked = [i for i, m in zip(sequence.input_ids, sequence.loss_mask) if m == 1]
        covered.append(masked)
        spans = {p for _, s, e in sequence.turn_spans for p in range(s, e)}
        assert {i for i, m in enumerate(sequence.loss_mask) if m} == spans
        assert all(lp == 0.0 for lp, m in zip(sequence.old_logprobs, sequence.loss_mask) if not m)
    assert [i for ids in covered for i in ids] == [i for ids in sampled for i in ids]


@pytest.mark.slow
def test_nothink_dialogue_packs_into_one_exact_sequence(policy):
    simulator = ScriptedSimulator()
    runner = runner_for(policy, NoThinkFormat(), simulator)
    trajectories = runner.run([make_profile("a"), make_profile("b", "Work has been awful lately.")])
    assert [t.num_turns for t in trajectories] == [2, 2]
    for trajectory in trajectories:
        assert trajectory.termination == "max_turns"
        assert trajectory.emotions == [40.0, 45.0, 50.0]
        assert len(trajectory.sequences) == 1  # the second prompt extends prompt + sampled ids
        assert_masks_cover_exactly_the_sampled_ids(trajectory)
        second = trajectory.policy_turns[1]
        first = trajectory.policy_turns[0]
        assert (
            second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)]
            == first.prompt_ids + first.response_ids
        )
        # the user's reply is in the second prompt, and decodes as the chat template renders it
        assert "Tell me more about 1." in policy.tokenizer.decode(second.prompt_ids)
    # each simulator session saw exactly its own dialogue's visible replies
    for session, trajectory in zip(simulator.sessions, trajectories):
        assert session.replies == [t.parsed.visible for t in trajectory.policy_turns]


@pytest.mark.slow
def test_think_history_hides_thinking_and_starts_new_sequences(policy):
    runner = runner_for(policy, ThinkFormat(), ScriptedSimulator(), max_new_tokens=16)
    (trajectory,) = runner.run([make_profile("t")])
    first, second = trajectory.policy_turns
    context = policy.tokenizer.decode(second.prompt_ids)
    if first.parsed.thinking:
        assert first.parsed.thinking not in context
    assert first.parsed.visible in context
    assert_masks_cover_exactly_the_sampled_ids(trajectory)


@pytest.mark.slow
def test_a_thought_cut_off_at_the_token_limit_never_reaches_the_user(policy):
    class CutOffEngine(RolloutEngine):
        """Every reply hits max_new_tokens inside <think>."""

        def generate(self, prompts, sampling):
            ids = policy.tokenizer("<think>SECRET reasoning about the user")["input_ids"]
            return [Generation(tuple(ids), tuple([-0.5] * len(ids)), "length") for _ in prompts]

    class RecordingSimulator(ScriptedSimulator):
        def __init__(self):
            super().__init__()
            self.sent = []

        def respond_batch(self, sessions, replies):
            self.sent.extend(replies)
            return super().respond_batch(sessions, replies)

    simulator = RecordingSimulator()
    settings = RolloutSettings(max_turns=2, max_new_tokens=24)
    runner = RolloutRunner(policy, CutOffEngine(), simulator, ThinkFormat(), settings)
    (trajectory,) = runner.run([make_profile("cut")])
    first, second = trajectory.policy_turns
    assert simulator.sent == ["", ""]
    assert first.finish_reason == "length" and not first.parsed.format_ok
    assert first.parsed.thinking == "SECRET reasoning about the user"  # kept for the record
    history = policy.tokenizer.decode(second.prompt_ids)
    assert "SECRET" not in history
    assert "<|im_start|>assistant\n<|im_end|>" in history  # the cut-off turn is an empty reply
    assert all("SECRET" not in (t["text"] or "") for t in trajectory.to_record()["turns"])


@pytest.mark.slow
def test_finished_dialogues_leave_without_disturbing_others(policy):
    class EndsEarly(ScriptedSimulator):
        def open(self, profile, *, seed):
            session = super().open(profile, seed=seed)
            session.success_at = 45 if profile.id == "short" else 1000
            return session

    runner = runner_for(policy, NoThinkFormat(), EndsEarly(), max_turns=3, max_new_tokens=12)
    short, long = runner.run([make_profile("short"), make_profile("long")])
    assert (short.termination, short.num_turns, short.final_emotion) == ("success", 1, 45.0)
    assert (long.termination, long.num_turns, long.final_emotion) == ("max_turns", 3, 55.0)
    assert summarize([short, long]) == {
        "dialogues": 2,
        "mean_final_emotion": 50.0,
        "success": 1,
        "failure": 0,
        "mean_turns": 2.0,
        "format_violations": 0,
    }


@pytest.mark.slow
def test_context_limit_ends_a_dialogue(policy):
    runner = runner_for(
        policy, NoThinkFormat(), ScriptedSimulator(), max_turns=4, max_new_tokens=16, max_context_tokens=90
    )
    (trajectory,) = runner.run([make_profile("c")])
    assert trajectory.termination == "context_limit"
    assert all(len(t.prompt_ids) + 16 <= 90 for t in trajectory.policy_turns)


@pytest.mark.slow
def test_same_seed_same_dialogues(policy):
    profiles = [make_profile("a"), make_profile("b")]
    first = runner_for(policy, NoThinkFormat(), ScriptedSimulator()).run(profiles, seed=5)
    second = runner_for(policy, NoThinkFormat(), ScriptedSimulator()).run(profiles, seed=5)
    assert [t.to_record() for t in first] == [t.to_record() for t in second]


@pytest.mark.slow
def test_transcript_is_complete_and_self_describing(policy, tmp_path):
    runner = runner_for(policy, ThinkFormat(), ScriptedSimulator(), max_new_tokens=12)
    runner.components = {
        "simulator": "scripted",
        "prompt_format": "think",
        "engine": "hf",
        "model": "smollm2",
    }
    trajectories = runner.run([make_profile("a"), make_profile("b")])
    with TranscriptWriter(tmp_path / "t.jsonl") as writer:
        writer.write(trajectories)
    records = list(read_transcripts(tmp_path / "t.jsonl"))
    assert len(records) == 2
    for record in records:
        assert record["profile_id"] in {"a", "b"}
        assert record["simulator"] == "scripted" and record["prompt_format"] == "think"
        assert [t["role"] for t in record["turns"]] == ["user", "assistant", "user", "assistant", "user"]
        assert record["turns"][0]["text"] == make_profile("a").first_talk or record["profile_id"] == "b"
        assert record["turns"][2]["reason"] == {"why": "scripted"} and record["turns"][2]["change"] == 5.0
        assert all("thinking" in t and "format_ok" in t for t in record["turns"] if t["role"] == "assistant")
        assert record["termination"] == "max_turns" and record["final_emotion"] == 50.0
        assert record["format_violations"] == sum(
            not t["format_ok"] for t in record["turns"] if t["role"] == "assistant"
        )
        json.dumps(record)


# --------------------------------------------------------------------------- packing without a model
def _turn(prompt, response):
    return PolicyTurn(prompt, response, [-0.5] * len(response), "stop", "x", ParsedReply("x"))


def test_pack_sequences_by_hand():
    turns = [_turn([1, 2], [3, 4]), _turn([1, 2, 3, 4, 5, 6], [7]), _turn([9, 9], [8])]
    first, second = pack_sequences(turns)
    assert first.input_ids == [1, 2, 3, 4, 5, 6, 7]
    assert first.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert first.old_logprobs == [0, 0, -0.5, -0.5, 0, 0, -0.5]
    assert first.turn_spans == [(0, 2, 4), (1, 6, 7)]
    assert (
        second.input_ids == [9, 9, 8] and second.loss_mask == [0, 0, 1] and second.turn_spans == [(2, 2, 3)]
    )


def test_settings_are_validated():
    with pytest.raises(ValueError, match=r"max_turns \(0\) must be >= 1"):
        RolloutSettings(max_turns=0)
    with pytest.raises(ValueError, match=r"temperature \(-1\) must be >= 0"):
        RolloutSettings(temperature=-1)
    with pytest.raises(ValueError, match="max_context_tokens"):
        RolloutSettings(max_new_tokens=100, max_context_tokens=100)


@pytest.mark.slow
def test_a_reply_cut_at_the_token_limit_ends_at_its_last_whole_sentence(tokenizer):
    from rlver.rollout.runner import sentence_end

    def cut(text):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        count = sentence_end(tokenizer, ids)
        return None if count is None else tokenizer.decode(ids[:count])

    assert cut("I am sorry to hear that. It sounds hard, and I") == "I am sorry to hear that."
    assert cut('Really? "Yes." And then') == 'Really? "Yes."'
    assert cut("我很难过。你好吗") == "我很难过。"
    assert cut("That is 3.5 times more than") is None  # a decimal point ends no sentence
    assert cut("No end here at all") is None


@pytest.mark.slow
def test_end_at_sentence_trims_the_ids_and_logprobs_it_trains_on(policy):
    class RunOnEngine(RolloutEngine):
        def generate(self, prompts, sampling):
            ids = policy.tokenizer("I hear you. That must be so", add_special_tokens=False)["input_ids"]
            return [
                Generation(tuple(ids), tuple(-0.1 * (i + 1) for i in range(len(ids))), "length")
                for _ in prompts
            ]

    settings = RolloutSettings(max_turns=1, max_new_tokens=8, end_at_sentence=True)
    runner = RolloutRunner(policy, RunOnEngine(), ScriptedSimulator(), NoThinkFormat(), settings)
    (trajectory,) = runner.run([make_profile("cut")])
    turn = trajectory.policy_turns[0]
    assert turn.finish_reason == "sentence" and turn.completion == "I hear you."
    assert turn.logprobs == [-0.1 * (i + 1) for i in range(len(turn.response_ids))]  # the kept prefix's own
    whole = RolloutRunner(
        policy, RunOnEngine(), ScriptedSimulator(), NoThinkFormat(), replace(settings, end_at_sentence=False)
    )
    assert whole.run([make_profile("cut")])[0].policy_turns[0].finish_reason == "length"
