"""SAGE's and the RLVER reference's own simulator code driven by rlver, checked against their code run directly.

The fidelity test replays SAGE's recorded Qwen2.5-72B dialogues turn by turn: a fake user
LLM answers with the recorded answers, once behind SAGE's own functions called directly and
once behind rlver's `sage_official` simulator (over HTTP, through rlver's client), and the
requests, the emotion trajectories and the endings must be identical.

Their files come from ../shared/sage-protocol (MIT); the project ships none of their text.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from rlver_plugins.sage_user.official import ReferenceUserSimulator, SageOfficialSimulator, reference_source
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

from rlver.core.types import Profile
from tests.conftest import REPO

PROTOCOL = REPO.parent / "shared" / "sage-protocol"
TRANSCRIPTS = REPO.parent / "shared" / "data" / "sage_transcripts_qwen2.5-72b.jsonl"
OFFICIAL_TRAIN = REPO.parent / "shared" / "data" / "rlver_train_profiles_sample.jsonl"
pytestmark = pytest.mark.skipif(not PROTOCOL.is_dir(), reason="needs ../shared/sage-protocol")

FAST = {"timeout": 10, "max_retries": 0, "backoff_seconds": 0.01, "max_concurrency": 16}


def load_direct(path: Path, source: str | None = None, names: dict[str, Any] | None = None) -> Any:
    """Their file as a plain module, the way a user of their code would import it."""
    spec = importlib.util.spec_from_file_location(f"direct_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(names or {})
    if source is None:
        spec.loader.exec_module(module)
    else:
        exec(compile(source, str(path), "exec"), module.__dict__)
    return module


# --------------------------------------------------------------------------- the recorded answers
def planning_answer(planning: dict[str, Any]) -> str:
    """A raw planning answer that SAGE's parser reads back into the recorded fields."""
    return (
        f"Content:\n{planning['content']}\nTargetCompletion:\n{planning['TargetCompletion']}\n"
        f"Activity:\n{planning['activity']}\nAnalyse:\n{planning['analyse']}\nChange:\n{planning['change']}"
    )


def reply_answer(message: dict[str, Any]) -> str:
    return f"Thinking:\n{message.get('thinking', '')}\nResponse:\n{message['content']}"


class OutOfAnswers(BaseException):
    """More calls than recorded answers (a BaseException: SAGE's loops retry every Exception)."""


def recorded_replies(record: dict[str, Any]) -> list[str]:
    """The policy replies the user answered (a record may end with one it never answered)."""
    history = record["history"]
    return [
        message["content"]
        for message, following in itertools.pairwise(history)
        if message["role"] == "assistant" and following["role"] == "user"
    ]


def recorded_answers(record: dict[str, Any]) -> list[str]:
    """The user model's answers, in the order SAGE's chat_player asks (plan, reply per turn)."""
    answers = []
    for message in record["history"][1:]:
        if message["role"] == "user":
            answers += [planning_answer(message["planning"]), reply_answer(message)]
    return answers


def profile_of(record: dict[str, Any]) -> Profile:
    return Profile(
        id=record["id"],
        player=record["player"],
        scene=record["scene"],
        main_cha=record["character"],
        cha_group=(),
        task=record["task"],
        first_talk=record["history"][0]["content"],
        extra={"topic": record["topic"]},
    )


def direct_sage_run(record: dict[str, Any]) -> dict[str, Any]:
    """SAGE's chat_player called directly, as its benchmark loop does, on the recorded replies."""
    module = load_direct(PROTOCOL / "SAGE" / "simulator_response.py")
    answers = iter(recorded_answers(record))
    prompts: list[str] = []

    def call_llm(prompt):
        prompts.append(prompt)
        try:
            return next(answers)
        except StopIteration:
            raise OutOfAnswers(record["id"]) from None

    module.call_llm = call_llm
    first = record["history"][0]
    player_data = {  # their player_init's fields; `target` 0: see SageProtocol.new_state
        "id": record["id"], "emo_point": 40, "emo_state": "Emotion-B", "target": 0,
        "player": record["player"], "scene": record["scene"], "character": record["character"],
        "topic": record["topic"], "task": record["task"],
        "history": [{"role": "user", "content": first["content"], "emotion-point": 40}],
    }  # fmt: skip
    emotions, texts, ending = [], [], None
    for reply in recorded_replies(record):
        player_data["history"].append({"role": "assistant", "content": reply})
        player_data = module.chat_player(player_data)
        emotions.append(player_data["emo_point"])
        texts.append(player_data["history"][-1]["content"])
        ending = {"Emotion-S": "success", "Emotion-F": "failure"}.get(player_data["emo_state"])
        if ending:
            break
    return {"prompts": prompts, "emotions": emotions, "texts": texts, "ending": ending}


def rlver_sage_run(
    records: list[dict[str, Any]], url: str, cache: Path | None = None
) -> list[dict[str, Any]]:
    """The same dialogues through rlver's sage_official simulator, all concurrently, turn by turn."""
    simulator = SageOfficialSimulator(code=str(PROTOCOL), base_url=url, model="recorded", **FAST)
    try:
        sessions = [simulator.open(profile_of(r), seed=0) for r in records]
        simulator.opening_batch(sessions)
        replies = [recorded_replies(r) for r in records]
        results = [{"emotions": [], "texts": [], "ending": None} for _ in records]
        active = list(range(len(records)))
        turn = 0
        while active:
            active = [i for i in active if turn < len(replies[i])]
            turns = simulator.respond_batch([sessions[i] for i in active], [replies[i][turn] for i in active])
            for i, user in zip(active, turns, strict=True):
                results[i]["emotions"].append(user.emotion)
                results[i]["texts"].append(user.text)
                results[i]["ending"] = user.termination
            active = [i for i, user in zip(active, turns, strict=True) if not user.done]
            turn += 1
        results_system = simulator.policy_system_prompt(profile_of(records[0]), thinking=False)
        for result in results:
            result["system_prompt"] = results_system
        return results
    finally:
        simulator.close()


# --------------------------------------------------------------------------- SAGE: fidelity
@pytest.mark.skipif(not TRANSCRIPTS.is_file(), reason="needs the recorded SAGE dialogues")
def test_sage_official_matches_sages_own_code_on_every_recorded_dialogue():
    records = [json.loads(line) for line in TRANSCRIPTS.read_text(encoding="utf-8").splitlines()]
    direct = [direct_sage_run(record) for record in records]
    answer_for = {}
    for record, run in zip(records, direct, strict=True):
        answer_for.update(zip(run["prompts"], recorded_answers(record), strict=False))
    sent: list[dict[str, Any]] = []

    def respond(payload):
        sent.append(payload)
        messages = payload["messages"]
        if len(messages) != 1 or messages[0]["role"] != "user":
            return None
        return answer_for.get(messages[0]["content"])

    with ScriptedServer(Script(responder=respond)) as server:
        replayed = rlver_sage_run(records, server.url)

    # 1. The requests: SAGE's prompts, byte for byte, one user message each, nothing else.
    assert sorted(p["messages"][0]["content"] for p in sent) == sorted(
        p for run in direct for p in run["prompts"]
    )
    assert (
        len(sent) == sum(len(run["prompts"]) for run in direct) == 2 * sum(len(r["emotions"]) for r in direct)
    )
    # 2. The emotion trajectories, and the user's words, turn by turn.
    for record, run, ours in zip(records, direct, replayed, strict=True):
        assert ours["emotions"] == run["emotions"], record["id"]
        assert ours["texts"] == run["texts"], record["id"]
        recorded = [int(m["emotion-point"]) for m in record["history"][1:] if m["role"] == "user"]
        assert run["emotions"] == recorded[: len(run["emotions"])], record["id"]  # the fixture is right
    # 3. The endings: success / failure exactly where SAGE's own state says so.
    for run, ours in zip(direct, replayed, strict=True):
        if run["ending"]:
            assert ours["ending"] == run["ending"]
        else:
            assert ours["ending"] in (None, "goodbye")
    endings = [ours["ending"] for ours in replayed]
    assert endings.count("failure") == sum(r["emo_state"] == "Emotion-F" for r in records)
    assert endings.count("success") == sum(r["emo_state"] == "Emotion-S" for r in records)
    # The model under test gets SAGE's own system prompt, read from npc_response.py.
    npc = load_direct(PROTOCOL / "SAGE" / "npc_response.py")
    seen = []
    npc.call_llm = lambda messages: seen.append(messages) or ""
    npc.call_npc([])
    assert replayed[0]["system_prompt"] == seen[0][0]["content"]


def test_a_replay_from_the_cache_needs_no_endpoint(tmp_path):
    records = [json.loads(line) for line in TRANSCRIPTS.read_text(encoding="utf-8").splitlines()[:3]]
    direct = [direct_sage_run(record) for record in records]
    answer_for = {}
    for record, run in zip(records, direct, strict=True):
        answer_for.update(zip(run["prompts"], recorded_answers(record), strict=False))
    cache = tmp_path / "cache.sqlite"
    options = {**FAST, "cache": str(cache)}
    with ScriptedServer(Script(responder=lambda p: answer_for.get(p["messages"][0]["content"]))) as server:
        first = _run_with(records, server.url, options)
    again = _run_with(records, "http://127.0.0.1:9/v1", {**options, "cache_only": True})  # nothing listens
    assert [r["emotions"] for r in again] == [r["emotions"] for r in first] == [r["emotions"] for r in direct]


def _run_with(records, url, options):
    simulator = SageOfficialSimulator(code=str(PROTOCOL), base_url=url, model="recorded", **options)
    try:
        results = []
        for record in records:
            session = simulator.open(profile_of(record), seed=0)
            session.opening()
            emotions = []
            for reply in recorded_replies(record):
                user = session.respond(reply)
                emotions.append(user.emotion)
                if user.done:
                    break
            results.append({"emotions": emotions})
        return results
    finally:
        simulator.close()


# --------------------------------------------------------------------------- failures stay bounded
def test_an_answer_their_parser_never_reads_ends_the_dialogue_after_max_reasks():
    """SAGE's planning loop retries forever on an answer without a number; rlver stops it."""
    record = json.loads(TRANSCRIPTS.read_text(encoding="utf-8").splitlines()[0])
    with ScriptedServer(Script(responder=lambda p: "Content:\nno number anywhere")) as server:
        simulator = SageOfficialSimulator(
            code=str(PROTOCOL), base_url=server.url, model="garbled", max_reasks=2, **FAST
        )
        session = simulator.open(profile_of(record), seed=0)
        session.opening()
        user = session.respond("hello")
        counters = simulator.drain_metrics()
        simulator.close()
        calls = len(server.script.requests)
    assert user.termination == "simulator_error" and user.text == ""
    assert user.emotion == 40  # the last real emotion, not a made-up one
    assert "no usable answer after 3 attempts" in user.reason["error"]
    assert calls == 3
    assert counters["dialogue_errors"] == 1 and counters["their_errors"] == 3 and counters["reasks"] == 2


def test_a_dead_endpoint_ends_the_dialogue_with_an_error_not_a_hang():
    record = json.loads(TRANSCRIPTS.read_text(encoding="utf-8").splitlines()[0])
    simulator = SageOfficialSimulator(
        code=str(PROTOCOL), base_url="http://127.0.0.1:9/v1", model="none", **FAST
    )
    profile = profile_of(record)
    session = simulator.open(profile.__class__(**{**profile.__dict__, "first_talk": None}), seed=0)
    opening = session.opening()
    simulator.close()
    assert opening.termination == "simulator_error"
    assert "request failed after 1 attempts" in opening.reason["error"]


def test_code_that_is_not_there_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"sage_official simulator: code .*no simulator_response.py"):
        SageOfficialSimulator(code=str(tmp_path), base_url="http://127.0.0.1:9/v1", model="m")
    (tmp_path / "simulator_response.py").write_text("def broken(:\n")
    (tmp_path / "npc_response.py").write_text("")
    with pytest.raises(ValueError, match=r"simulator_response.py:1: cannot load"):
        SageOfficialSimulator(code=str(tmp_path), base_url="http://127.0.0.1:9/v1", model="m")


# --------------------------------------------------------------------------- the RLVER reference user
def reference_planning(change: str) -> str:
    return f"Content:\n说了些话\nReason:\n有点贴合\nActivity:\n想了想\nAnalyse:\n还行\nChange:\n{change}"


# Planning answers in the shapes their parser handles: signed, unsigned, the value under a
# line that says 变化 ("change"), brackets and quotes around it.
REFERENCE_CHANGES = ["+12", "-5", "8", "变化值\n[+20]", "“-3”", "25", "-40", "+9"]


def test_rlver_reference_matches_the_reference_code(tmp_path, monkeypatch):
    rows = [json.loads(line) for line in OFFICIAL_TRAIN.read_text(encoding="utf-8").splitlines()[:4]]
    prompts_module = load_direct(PROTOCOL / "RLVER" / "system_prompt.py")
    names = {k: v for k, v in vars(prompts_module).items() if k.startswith("system_prompt")}
    source = reference_source(
        (PROTOCOL / "RLVER" / "hard_player_simulator_dsv3.py").read_text(encoding="utf-8")
    )

    def script(index: int) -> list[str]:
        rng = random.Random(index)
        answers = [f"Thinking:\n开个头\nResponse:\n最近有点烦{index}"]
        for turn in range(6):
            answers += [
                reference_planning(rng.choice(REFERENCE_CHANGES)),
                f"Thinking:\n想\nResponse:\n嗯{index}-{turn}",
            ]
        return answers

    direct_runs = []
    for index, row in enumerate(rows):
        # Their constructor reads data/train_profile.jsonl and picks a random role: a file of one.
        folder = tmp_path / f"direct{index}"
        (folder / "data").mkdir(parents=True)
        (folder / "data" / "train_profile.jsonl").write_text(
            json.dumps({**row, "topic": ""}, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        monkeypatch.chdir(folder)
        module = load_direct(PROTOCOL / "RLVER" / "hard_player_simulator_dsv3.py", source, names)
        answers = iter(["(discarded by their constructor)", *script(index)])
        prompts: list[str] = []
        module.call_api = lambda prompt, mode="dsv3", prompts=prompts, answers=answers: (
            prompts.append(prompt) or next(answers)
        )
        player = module.PlayerSimulator(save_dir=str(folder))
        prompts.clear()  # their constructor's own (discarded) call is not part of a dialogue
        emotions = []
        player.reply(None)
        for turn in range(6):
            player.reply(f"我在听{turn}")
            emotions.append(player.emo_point)
            if player.emo_point <= 0 or player.emo_point >= 100:
                break
        direct_runs.append({"prompts": prompts, "emotions": emotions})
    monkeypatch.chdir(REPO)

    answer_for = {}
    for index, run in enumerate(direct_runs):
        answer_for.update(zip(run["prompts"], script(index), strict=False))
    sent = []

    def respond(payload):
        sent.append(payload["messages"][0]["content"])
        return answer_for.get(payload["messages"][0]["content"])

    with ScriptedServer(Script(responder=respond)) as server:
        simulator = ReferenceUserSimulator(code=str(PROTOCOL), base_url=server.url, model="scripted", **FAST)
        ours = []
        for row in rows:
            profile = Profile(
                id=row["id"], player=row["player"], scene=row["scene"], main_cha=row["main_cha"],
                cha_group=tuple(row.get("cha_group", ())), task=row["task"],
            )  # fmt: skip
            session = simulator.open(profile, seed=0)
            opening = session.opening()
            assert opening.emotion == 30  # their start
            emotions = []
            for turn in range(6):
                user = session.respond(f"我在听{turn}")
                emotions.append(user.emotion)
                if user.done:
                    assert user.termination in ("failure", "success", "goodbye")
                    break
            ours.append(emotions)
        think = simulator.policy_system_prompt(profile, thinking=True)
        plain = simulator.policy_system_prompt(profile, thinking=False)
        simulator.close()
    assert sorted(sent) == sorted(p for run in direct_runs for p in run["prompts"])
    assert ours == [run["emotions"] for run in direct_runs]
    assert any(e > 100 - 1 or e <= 0 for run in ours for e in run) or any(len(run) == 6 for run in ours)
    assert think == names["system_prompt_train_think"] and plain == names["system_prompt_train_unthink"]


def test_the_think_format_keeps_a_prompt_that_asks_for_think_tags_and_extends_one_that_does_not():
    from rlver_plugins.formats import NoThinkFormat, ThinkFormat

    from rlver.core.interfaces import UserSimulator
    from rlver.rollout.runner import RolloutRunner

    class Protocol(UserSimulator):
        def __init__(self, prompt):
            self.prompt = prompt

        def open(self, profile, *, seed):
            raise NotImplementedError

        def policy_system_prompt(self, profile, *, thinking):
            return self.prompt

    profile = Profile(id="p", player="p", scene="s", main_cha="负面型", cha_group=(), task="t")

    def prompt_of(fmt, simulator):
        runner = RolloutRunner.__new__(RolloutRunner)
        runner.prompt_format, runner.simulator = fmt, simulator
        return runner.system_prompt(profile)

    assert prompt_of(NoThinkFormat(), Protocol("SAGE 的提示")) == "SAGE 的提示"
    assert prompt_of(ThinkFormat(), Protocol("请用<think></think>包裹")) == "请用<think></think>包裹"
    extended = prompt_of(ThinkFormat(language="zh"), Protocol("SAGE 的提示"))
    assert extended.startswith("SAGE 的提示") and "<think>" in extended
    assert prompt_of(NoThinkFormat(system_prompt="mine"), Protocol("SAGE 的提示")) == "mine"
    assert prompt_of(NoThinkFormat(language="en"), Protocol(None)).startswith("You are an intelligent")
