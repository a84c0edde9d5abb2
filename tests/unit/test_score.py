"""`rlver score`, the SAGE record writer and SAGE records read as profiles."""

import json
import math
import re
from itertools import pairwise

import pytest

from rlver.core.interfaces import ParsedReply
from rlver.core.types import UserTurn
from rlver.data.profiles import ProfileError, load_profiles
from rlver.evaluate.score import (
    dialogue_emotions,
    leaderboard_markdown,
    leaderboard_rows,
    load_scored_file,
    mean_trajectory,
    score_records,
)
from rlver.rollout.runner import PolicyTurn, Trajectory
from rlver.rollout.transcripts import SAGE_FIELDS, TranscriptWriter, read_transcripts, to_sage_record
from tests.conftest import SHARED, run_cli
from tests.unit.test_rollout import make_profile

SAGE_FILE = SHARED / "data" / "sage_transcripts_qwen2.5-72b.jsonl"
needs_sage_file = pytest.mark.skipif(not SAGE_FILE.exists(), reason=f"{SAGE_FILE} is not there")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sage_reason(change):
    """What an LLM-played SAGE simulator puts on UserTurn.reason."""
    planning = {"content": "c", "TargetCompletion": "t", "activity": "a", "analyse": "an", "change": change}
    return {"planning": planning, "thinking": "Thinking: ... Origin: ... Response: ..."}


def make_trajectory(pid, emotions, *, thinking=None, reason=sage_reason, termination="max_turns"):
    trajectory = Trajectory(make_profile(pid, topic="family"), 0, "system")
    trajectory.user_turns = [UserTurn("opening", emotions[0])]
    for index, (before, after) in enumerate(pairwise(emotions)):
        change = after - before
        trajectory.policy_turns.append(
            PolicyTurn([1], [2], [-0.1], "stop", "raw", ParsedReply(f"reply {index}", thinking=thinking))
        )
        trajectory.user_turns.append(UserTurn(f"user {index}", after, change, reason(change)))
    trajectory.termination = termination
    return trajectory


# Hand-worked: finals 100, 5, 45 -> Score 50.0, Success 1, Failure 1; user messages 4, 4, 2.
SYNTHETIC = [
    ("up", [40.0, 50.0, 60.0, 100.0], "success"),
    ("down", [40.0, 30.0, 20.0, 5.0], "failure"),
    ("short", [40.0, 45.0], "goodbye"),
]


def synthetic_trajectories(**options):
    return [make_trajectory(pid, e, termination=t, **options) for pid, e, t in SYNTHETIC]


def table_row(stdout, name):
    """The cells of the leaderboard row named `name`."""
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in:\n{stdout}")


# --------------------------------------------------------------------------- pure scoring
def test_score_records_by_hand():
    records = [t.to_record() for t in synthetic_trajectories()]
    z = 1.959963984540054  # Wilson's 95% interval of 1 in 3, by hand
    centre, half = (1 / 3 + z**2 / 6) / (1 + z**2 / 3), z * math.sqrt(2 / 27 + z**2 / 36) / (1 + z**2 / 3)
    assert score_records(records) == {
        "dialogues": 3,
        "score": 50.0,
        "score_low": 0.0,  # 50 -+ 4.303 x 47.7 / sqrt(3) = [-68.5, 168.5], clipped to the emotion's range
        "score_high": 100.0,
        "success": 1,
        "failure": 1,
        "success_low": pytest.approx(centre - half),
        "success_high": pytest.approx(centre + half),
        "failure_low": pytest.approx(centre - half),
        "failure_high": pytest.approx(centre + half),
        "mean_user_messages": pytest.approx(10 / 3),
    }
    assert round(centre - half, 4) == 0.0615 and round(centre + half, 4) == 0.7923
    assert score_records(to_sage_record(t) for t in synthetic_trajectories()) == score_records(records)


def test_per_message_emotions_win_over_the_top_level_field():
    trajectory = make_trajectory("x", [40.0, 50.0, 70.0])
    record = {**trajectory.to_record(), "final_emotion": 3.0}
    sage = {**to_sage_record(trajectory), "emo_point": 3}
    assert dialogue_emotions(record, where="r") == (40.0, 50.0, 70.0)
    assert dialogue_emotions(sage, where="s") == (40.0, 50.0, 70.0)
    # Without per-message data the top-level value is all there is.
    assert dialogue_emotions({"emo_point": 85}, where="s") == (85.0,)
    assert dialogue_emotions({"final_emotion": 7.5}, where="r") == (7.5,)


def test_mean_trajectory_keeps_finished_dialogues_at_their_final_emotion():
    assert mean_trajectory([[40, 50, 60, 100], [40, 30], [40]]) == [40.0, 40.0, 130 / 3, 170 / 3]
    assert mean_trajectory([]) == []


def test_bad_emotions_name_the_field():
    with pytest.raises(ValueError, match=r"^f:3: field 'history\[2\]\.emotion-point': missing$"):
        dialogue_emotions(
            {"history": [{"role": "user", "emotion-point": 40}, {"role": "assistant"}, {"role": "user"}]},
            where="f:3",
        )
    with pytest.raises(ValueError, match=r"^f:1: field 'emotions\[1\]': expected a number, got 'x'"):
        dialogue_emotions({"emotions": [40, "x"]}, where="f:1")
    with pytest.raises(ValueError, match=r"^f:1: no emotions"):
        dialogue_emotions({"id": "a"}, where="f:1")


def test_leaderboard_sorted_by_score_and_split_by_a_field(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    with TranscriptWriter(bad) as writer:
        writer.write(synthetic_trajectories())
    with TranscriptWriter(good) as writer:
        writer.write([make_trajectory("a", [40.0, 90.0])])
    files = [load_scored_file(bad), load_scored_file(good)]
    table = leaderboard_markdown(leaderboard_rows(files))
    assert table.splitlines()[2:] == [
        "| good | 1 | 90.0 [90.0, 90.0] | 0 (0% [0%, 79%]) | 0 (0% [0%, 79%]) | 2.00 |",
        "| bad | 3 | 50.0 [0.0, 100.0] | 1 (33% [6%, 79%]) | 1 (33% [6%, 79%]) | 3.33 |",
    ]
    by = leaderboard_rows(files[:1], by="profile_id")
    assert [(row["profile_id"], row["score"]) for row in by] == [
        ("up", 100.0),
        ("short", 45.0),
        ("down", 5.0),
    ]


# --------------------------------------------------------------------------- SAGE records
@needs_sage_file
def test_sage_record_has_the_recorded_fields_and_message_keys():
    recorded = [json.loads(line) for line in SAGE_FILE.read_text(encoding="utf-8").splitlines()]
    recorded_user = {
        tuple(m) for r in recorded for i, m in enumerate(r["history"]) if m["role"] == "user" and i > 0
    }
    recorded_planning = {tuple(m["planning"]) for r in recorded for m in r["history"] if "planning" in m}
    recorded_assistant = {tuple(m) for r in recorded for m in r["history"] if m["role"] == "assistant"}

    record = to_sage_record(make_trajectory("t", [40.0, 50.0, 47.5], thinking="plan"))
    assert tuple(record) == tuple(recorded[0]) == SAGE_FIELDS
    assert (
        tuple(record["history"][0])
        == tuple(recorded[0]["history"][0])
        == ("role", "content", "emotion-point")
    )
    users = [m for m in record["history"][1:] if m["role"] == "user"]
    assistants = [m for m in record["history"] if m["role"] == "assistant"]
    assert {tuple(m) for m in users} <= recorded_user
    assert {tuple(m["planning"]) for m in users} <= recorded_planning  # same keys, same order
    assert {tuple(m) for m in assistants} == {("role", "content", "think")} <= recorded_assistant
    assert [m["role"] for m in record["history"]] == ["user", "assistant"] * 2 + ["user"]
    assert record["emo_point"] == 47.5 and record["emo_state"] == "Emotion-B"
    assert [m["emotion-point"] for m in record["history"] if m["role"] == "user"] == [40, 50, 47.5]
    assert isinstance(record["history"][0]["emotion-point"], int)
    assert [m["planning"]["change"] for m in users] == [10, -2.5]
    assert record["character"] == "passive" and record["topic"] == "family" and record["target"] == "eq"
    assert assistants[0] == {"role": "assistant", "content": "reply 0", "think": "plan"}


def test_sage_record_from_a_rubric_simulator_summarises_its_reason():
    rubric = {"signal": "met", "change": 10.0, "analysis": "deep_empathy: empathy +10"}
    trajectory = make_trajectory("r", [40.0, 50.0], reason=lambda change: dict(rubric))
    user = to_sage_record(trajectory)["history"][2]
    assert set(user) == {"role", "content", "emotion-point", "planning"}  # no thinking to report
    assert user["planning"]["change"] == 10
    assert json.loads(user["planning"]["analyse"]) == rubric
    assert "think" not in to_sage_record(trajectory)["history"][1]  # non-thinking policy


def test_sage_records_load_back_as_their_profiles(tmp_path):
    path = tmp_path / "sage.jsonl"
    path.write_text(
        "".join(json.dumps(to_sage_record(t)) + "\n" for t in synthetic_trajectories()), encoding="utf-8"
    )
    profiles = load_profiles(path)
    assert [p.id for p in profiles] == ["up", "down", "short"]
    first = profiles[0]
    original = make_profile("up")
    assert (first.player, first.scene, first.main_cha, first.task) == (
        original.player,
        original.scene,
        original.main_cha,
        original.task,
    )
    assert first.first_talk == "opening" and first.cha_group == () and first.extra == {"topic": "family"}


@needs_sage_file
def test_sentient_transcripts_load_as_the_100_test_profiles():
    recorded = [json.loads(line) for line in SAGE_FILE.read_text(encoding="utf-8").splitlines()]
    profiles = load_profiles(SAGE_FILE)
    assert len(profiles) == 100
    assert [p.id for p in profiles] == [r["id"] for r in recorded]
    assert [p.first_talk for p in profiles] == [r["history"][0]["content"] for r in recorded]
    assert all(p.first_talk and p.personality is not None and p.theme is not None for p in profiles)
    assert profiles[0].main_cha == recorded[0]["character"] and profiles[0].extra == {
        "topic": recorded[0]["topic"]
    }


def test_sage_record_without_a_user_message_is_a_profile_error(tmp_path):
    path = tmp_path / "sage.jsonl"
    record = to_sage_record(make_trajectory("a", [40.0, 50.0]))
    path.write_text(json.dumps(record) + "\n" + json.dumps({**record, "id": "b", "history": []}) + "\n")
    with pytest.raises(ProfileError, match=rf"^{path}:2: field 'history': no user message"):
        load_profiles(path)


# --------------------------------------------------------------------------- the command
@needs_sage_file
def test_score_command_reproduces_the_published_qwen_numbers(tmp_path):
    plot = tmp_path / "plots" / "sentient.png"
    result = run_cli("score", SAGE_FILE, "--plot", plot)
    assert result.returncode == 0, result.stderr
    row = table_row(result.stdout, "sage_transcripts_qwen2.5-72b")
    assert [cell.split()[0] for cell in row] == [
        "sage_transcripts_qwen2.5-72b",
        "100",
        "19.1",
        "4",
        "70",
        "7.41",
    ]
    low, high = map(float, re.findall(r"\[([\d.]+), ([\d.]+)\]", row[2])[0])
    assert low < 19.1 < high  # Score's 95% interval over the 100 dialogues
    assert row[3].startswith("4 (4% [") and row[4].startswith("70 (70% [")
    assert f"plot: {plot}" in result.stdout
    assert plot.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    assert matplotlib.image.imread(plot).shape[:2] == (600, 960)


def test_score_command_scores_both_formats_alike(tmp_path):
    own, sage = tmp_path / "own.jsonl", tmp_path / "as_sage.jsonl"
    with TranscriptWriter(own) as writer:
        writer.write(synthetic_trajectories(thinking="t"))
    sage.write_text(
        "".join(json.dumps(to_sage_record(t), ensure_ascii=False) + "\n" for t in synthetic_trajectories()),
        encoding="utf-8",
    )
    assert len(list(read_transcripts(own))) == 3
    result = run_cli("score", own, sage, "--plot", "none", "--by", "termination")
    assert result.returncode == 0, result.stderr
    assert [c.split()[0] for c in table_row(result.stdout, "own")[1:]] == ["3", "50.0", "1", "1", "3.33"]
    assert table_row(result.stdout, "as_sage")[1:] == table_row(result.stdout, "own")[1:]
    assert (
        "| own | success | 1 | 100.0 [100.0, 100.0] | 1 (100% [21%, 100%]) | 0 (0% [0%, 79%]) | 4.00 |"
        in (result.stdout)
    )
    assert "plot:" not in result.stdout


def test_score_command_names_the_bad_line(tmp_path):
    good = json.dumps(make_trajectory("a", [40.0, 50.0]).to_record())
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good + "\n\n{not json\n")
    result = run_cli("score", bad, "--plot", tmp_path / "x.png")
    assert result.returncode == 2, result.stdout
    assert f"rlver score: error: {bad}:3: invalid JSON" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_bad_files_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"emotions": [40]}) + "\n" + json.dumps({"emotions": [40, "high"]}) + "\n")
    with pytest.raises(ValueError, match=rf"^{bad}:2: field 'emotions\[1\]': expected a number, got 'high'$"):
        load_scored_file(bad)
    with pytest.raises(ValueError, match="missing.jsonl: transcript file not found"):
        load_scored_file(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no dialogues in file"):
        load_scored_file(tmp_path / "empty.jsonl")
