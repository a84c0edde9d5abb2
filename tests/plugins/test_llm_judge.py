"""The dialogue judge plugin (`llm_judge`): parsing bad answers, registration, and the scripted
OpenAI-compatible server replaying recorded judge answers (malformed ones and timeouts included)."""

import json
import threading
import time

import pytest
from rlver_plugins.llm_judge import DIMENSIONS, DimensionJudge, parse_judge_answer
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

from rlver.cli import main
from rlver.core.plugins import PluginError, Registry, get_registry
from tests.conftest import REPO

RECORDED = json.loads((REPO / "tests" / "data" / "judge_answers.json").read_text())
THREE = ("empathy", "insight", "action")


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "text, scores, problems",
    [
        ('{"empathy": 8, "insight": 6, "action": 3}', {"empathy": 8, "insight": 6, "action": 3}, []),
        (
            'Rating:\n```json\n{"Empathy": "7", "insight": 5.5, "action": {"score": 2}}\n```',
            {"empathy": 7, "insight": 5.5, "action": 2},
            [],
        ),
        (
            'I think {"empathy": 1, "insight": 2, "action": 0} fits.',
            {"empathy": 1, "insight": 2, "action": 0},
            [],
        ),
        ("empathy: 8, insight: 6", {}, ["no JSON object"]),
        ('{"empathy": 8, "insight": 6', {}, ["no JSON object"]),
        ('["empathy", 8]', {}, ["no JSON object"]),
        ('{"empathy": 8, "insight": 6}', {"empathy": 8, "insight": 6}, ["action: missing"]),
        (
            '{"empathy": 11, "insight": -0.5, "action": 10}',
            {"action": 10},
            ["empathy: 11 is outside 0-10", "insight: -0.5 is outside 0-10"],
        ),
        (
            '{"empathy": true, "insight": "high", "action": NaN}',
            {},
            ["empathy: not a number", "insight: not a number", "action: not a number"],
        ),
    ],
)
def test_judge_answers_are_read_dimension_by_dimension(text, scores, problems):
    answer = parse_judge_answer(text, THREE)
    assert answer.scores == scores
    assert len(answer.problems) == len(problems)
    for problem, expected in zip(answer.problems, problems):
        assert problem.startswith(expected), answer.problems
    assert answer.complete == (not problems)


# --------------------------------------------------------------------------- registration
def test_the_judge_plugin_registers_through_the_entry_point_group():
    registry = get_registry()
    assert registry.names("judges") == ["dimensions"]
    assert registry.get("judges", "dimensions").plugin == "llm_judge"
    assert registry.describe()  # `rlver plugins` lists it
    with pytest.raises(PluginError, match=r"--judge.colour: unknown option"):
        registry.check("judges", {"name": "dimensions", "colour": "red"}, flag="--judge")


def test_a_bad_model_judge_is_refused_naming_the_flag_before_any_dialogue(tmp_path):
    from rlver.evaluate.judging import check_judge_spec

    check_judge_spec(
        {"name": "dimensions", "base_url": "http://127.0.0.1:9/v1", "model": "m"}, "--model.judge"
    )
    with pytest.raises(PluginError, match=r"--model.judge.colour: unknown option"):
        check_judge_spec({"name": "dimensions", "colour": "red"}, "--model.judge")
    with pytest.raises(PluginError, match=r"--model.judge: .*'mood'"):
        check_judge_spec("mood", "--model.judge")
    with pytest.raises(ValueError, match=r"--model.judge: .*judge.yaml not found"):
        check_judge_spec(str(tmp_path / "judge.yaml"), "--model.judge")


def test_a_third_party_judge_registers_through_rlver_register_judges():
    from rlver import hookimpl

    class MyJudges:
        @hookimpl
        def rlver_register_judges(self, register):
            register("mine", dict)

    registry = Registry()
    registry.add(MyJudges(), name="my_judges")
    assert registry.names("judges") == ["mine"]


def test_unknown_dimensions_are_one_error():
    with pytest.raises(ValueError, match=r"judge.dimensions: unknown \['kindness'\]"):
        DimensionJudge(base_url="http://127.0.0.1:9/v1", model="m", dimensions=["empathy", "kindness"])


# --------------------------------------------------------------------------- the scripted server
def _dialogue(name):
    return [
        {"role": "user", "content": f"I'm {name}, and my week was awful."},
        {"role": "assistant", "content": "That sounds exhausting. What happened?"},
        {"role": "user", "content": "My manager took credit for my work."},
        {"role": "assistant", "content": "That's unfair; you could talk to them about it."},
    ]


class RecordedJudge:
    """A responder: each dialogue's recorded answers in order, TIMEOUT as a stall."""

    def __init__(self, stall_seconds):
        self.stall_seconds = stall_seconds
        self.sent = {}
        self.seeds = {}
        self.lock = threading.Lock()

    def __call__(self, payload):
        conversation = payload["messages"][-1]["content"]
        name = next(name for name in RECORDED if name in conversation)
        with self.lock:
            count = self.sent[name] = self.sent.get(name, 0) + 1
            self.seeds.setdefault(name, []).append(payload["seed"])
        answer = RECORDED[name][min(count, len(RECORDED[name])) - 1]
        if answer == "TIMEOUT":
            time.sleep(self.stall_seconds)
            return "{}"  # too late: the client has given up
        time.sleep(0.1)  # long enough for the requests to overlap
        return answer


def test_recorded_answers_good_bad_and_missing_never_crash_the_judge(tmp_path):
    names = ["Avery", "Blake", "Casey", "Devon", "Emery"]
    responder = RecordedJudge(stall_seconds=1.5)
    cache = tmp_path / "judge.sqlite"
    with ScriptedServer(Script(responder=responder)) as server:
        judge = DimensionJudge(
            base_url=server.url,
            model="scripted-judge",
            dimensions=list(THREE),
            timeout=0.5,
            max_retries=1,
            max_reasks=2,
            cache=str(cache),
        )
        try:
            scores = judge.judge([_dialogue(name) for name in names])
            metrics = judge.drain_metrics()
        finally:
            judge.close()
        in_flight = server.script.max_in_flight
    assert scores == [
        {"empathy": 8.0, "insight": 6.0, "action": 3.0},  # a clean answer
        {"empathy": 7.0, "insight": 5.0, "action": 4.0},  # not JSON, then a fenced answer
        {"empathy": 6.0, "insight": None, "action": None},  # dimensions missing on every try
        {"empathy": None, "insight": 4.0, "action": 9.0},  # empathy out of range on every try
        {"empathy": None, "insight": None, "action": None},  # timed out after the client's retry
    ]
    # Bounded: 1 + max_reasks asks at most, each re-ask with a new seed; a timeout is the
    # client's (1 + max_retries posts), not re-asked.
    assert responder.sent == {"Avery": 1, "Blake": 2, "Casey": 3, "Devon": 3, "Emery": 2}
    assert responder.seeds["Casey"] == [0, 1, 2]
    assert metrics["judge/re_asks"] == 5 and metrics["judge/missing_scores"] == 6
    assert metrics["judge/failed_requests"] == 1 and metrics["judge/http_timeouts"] == 1
    assert in_flight >= 2, "the dialogues were judged one at a time"

    # The cache replays every answer it holds without the endpoint.
    replay = DimensionJudge(
        base_url="http://127.0.0.1:9/v1",
        model="scripted-judge",
        dimensions=list(THREE),
        max_reasks=2,
        cache=str(cache),
        cache_only=True,
    )
    try:
        assert replay.judge([_dialogue(name) for name in names]) == scores
    finally:
        replay.close()


def test_rlver_score_reports_the_dimensions_beside_score_success_failure(tmp_path, capsys):
    transcripts = tmp_path / "policy.jsonl"
    with transcripts.open("w") as handle:
        for index, name in enumerate(["Avery", "Blake", "Devon"]):
            history = [dict(m) for m in _dialogue(name)]
            for emotion, message in zip((40, 55), [m for m in history if m["role"] == "user"]):
                message["emotion-point"] = emotion + 10 * index
            record = {"id": name, "emo_point": 55 + 10 * index, "task": "vent" if index else "advice"}
            handle.write(json.dumps({**record, "history": history}) + "\n")

    def answer(payload):
        conversation = payload["messages"][-1]["content"]
        return next(RECORDED[name][-1] for name in RECORDED if name in conversation)

    with ScriptedServer(Script(responder=answer)) as server:
        spec = {
            "name": "dimensions",
            "base_url": server.url,
            "model": "scripted-judge",
            "dimensions": list(THREE),
        }
        # In this process (a new one would spend its time importing torch): the command's own code.
        code = main(
            ["score", str(transcripts), "--plot", "none", "--by", "task", "--judge", json.dumps(spec)]
        )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| model | N |"))
    assert header.endswith("| Failure | mean user msgs | empathy | insight | action | judge missing |")
    # Avery 8/6/3, Blake 7/5/4, Devon (its last recorded answer) empathy out of range, 4, 9.
    row = next(line for line in lines if line.startswith("| policy | 3 | 65.0 ["))
    assert row.endswith(" | 2.00 | 7.5 | 5.0 | 5.3 | 1 |") and "| 0 (0% [" in row
    vent = next(line for line in lines if line.startswith("| policy | vent | 2 | 70.0 ["))
    assert vent.endswith(" | 2.00 | 7.0 | 4.5 | 6.5 | 1 |")
    advice = next(line for line in lines if line.startswith("| policy | advice | 1 | 55.0 ["))
    assert advice.endswith(" | 2.00 | 8.0 | 6.0 | 3.0 | 0 |")
    judged = [json.loads(line) for line in (tmp_path / "policy.judged.jsonl").read_text().splitlines()]
    assert [row["scores"]["empathy"] for row in judged] == [8.0, 7.0, None]


def test_every_dimension_has_a_rubric_and_a_source():
    for dimension in DIMENSIONS.values():
        assert "0:" in dimension.rubric and "10:" in dimension.rubric, dimension.name
        assert dimension.source, dimension.name
    assert {"empathy", "insight", "action"} <= set(DIMENSIONS)
