"""Judge pools: Krippendorff's alpha checked by hand and against the library, a pool of two fake
judges that agree or disagree (through `rlver score --judge` and `rlver test`'s judging), and bad
pool specs refused by their flag."""

from __future__ import annotations

import json

import krippendorff
import pytest

from rlver import hookimpl
from rlver.cli import main
from rlver.core.interfaces import DialogueJudge
from rlver.core.plugins import PluginError, get_registry, reset_registry
from rlver.evaluate.judge_pool import agreement_text, judge_labels, krippendorff_alpha, pool_cell
from rlver.evaluate.judging import (
    check_judge_spec,
    dimension_lines,
    judge_test_records,
    read_judge_specs,
)

NAMES = ("Avery", "Blake", "Casey", "Devon")
# What the first judge gives each user's dialogue (Devon's insight: no usable answer).
FIRST = {
    "Avery": {"empathy": 8.0, "insight": 6.0},
    "Blake": {"empathy": 6.0, "insight": 5.0},
    "Casey": {"empathy": 3.0, "insight": 7.0},
    "Devon": {"empathy": 5.0, "insight": None},
}


def agreeing(scores):  # the same order, half a point more generous
    return {k: None if v is None else v + 0.5 for k, v in scores.items()}


def disagreeing(scores):  # empathy read the other way round; insight agreed on
    return {"empathy": 10.0 - scores["empathy"], "insight": scores["insight"]}


class FakeJudge(DialogueJudge):
    """Scores each dialogue as `by_name` says for the user named in its first message."""

    def __init__(self, model: str, by_name: dict[str, dict[str, float | None]]) -> None:
        self.model = model
        self.by_name = by_name
        self.dimensions = tuple(next(iter(by_name.values())))
        self.closed = False

    def judge(self, dialogues):
        return [dict(self.by_name[_user(messages)]) for messages in dialogues]


def _user(messages):
    return next(name for name in NAMES if name in messages[0]["content"])


class FakeJudges:
    @hookimpl
    def rlver_register_judges(self, register):
        register("fake", FakeJudge)


@pytest.fixture
def fake_judges():
    reset_registry()
    get_registry().add(FakeJudges(), name="fake_judges")
    yield
    reset_registry()  # the next test loads the installed plugins afresh


def spec(model, by_name):
    return {"name": "fake", "model": model, "by_name": by_name}


FIRST_SPEC = spec("judge-a", FIRST)
AGREEING_SPEC = spec("judge-b", {n: agreeing(s) for n, s in FIRST.items()})
DISAGREEING_SPEC = spec("judge-c", {n: disagreeing(s) for n, s in FIRST.items()})


def transcripts(path):
    with path.open("w") as handle:
        for index, name in enumerate(NAMES):
            history = [
                {"role": "user", "content": f"I'm {name}.", "emotion-point": 40},
                {"role": "assistant", "content": "Tell me more."},
                {"role": "user", "content": "Work again.", "emotion-point": 50 + index},
            ]
            handle.write(json.dumps({"id": name, "emo_point": 50 + index, "history": history}) + "\n")
    return path


# --------------------------------------------------------------------------- alpha
def test_alpha_of_a_tiny_matrix_by_hand_and_by_the_library():
    # Two judges, three dialogues: 1 2 3 / 1 2 4. Interval metric (c - k)^2, n = 6 values.
    # Observed: only dialogue 3 differs: 2 ordered pairs x 1^2 / (2 - 1) = 2, over n: D_o = 1/3.
    # Expected: all ordered pairs of the 6 values: 2 * (n * sum x^2 - (sum x)^2) = 2 * (210 - 169)
    # = 82, over n (n - 1) = 30: D_e = 41/15. alpha = 1 - D_o / D_e = 1 - 5/41 = 36/41.
    matrix = [[1, 2, 3], [1, 2, 4]]
    assert krippendorff_alpha(matrix) == pytest.approx(36 / 41)
    assert krippendorff.alpha(reliability_data=matrix, level_of_measurement="interval") == pytest.approx(
        36 / 41
    )
    # Missing scores: three judges, dialogue 1 by two, 2 by three, 3 by two; n = 7.
    # D_o = (0 + 2 * (1 + 1 + 0) / (3 - 1) + 0) / 7 = 2/7; D_e = 2 * (7 * 74 - 20^2) / 42 = 236/42;
    # alpha = 1 - (2/7) / (236/42) = 1 - 3/59 = 56/59.
    missing = [[1, 2, None], [1, 3, 5], [None, 3, 5]]
    nan = float("nan")
    library = krippendorff.alpha(
        reliability_data=[[1, 2, nan], [1, 3, 5], [nan, 3, 5]], level_of_measurement="interval"
    )
    assert krippendorff_alpha(missing) == pytest.approx(56 / 59) == pytest.approx(library)


def test_alpha_where_it_is_undefined_and_how_it_reads():
    assert krippendorff_alpha([[1, 2, 3]]) is None  # one judge
    assert krippendorff_alpha([[7, 7], [7, 7]]) is None  # no variation to agree on
    assert krippendorff_alpha([[1, None], [None, 2]]) is None  # no dialogue scored twice
    assert krippendorff_alpha([[1, 9, 4], [9, 1, 4]]) < 0  # systematic disagreement
    assert agreement_text(0.84) == "alpha 0.84"
    assert agreement_text(0.31) == "alpha 0.31: judges disagree"
    assert agreement_text(0.667) == "alpha 0.67"  # the threshold itself is tentatively reliable
    assert agreement_text(None) == "alpha -"
    assert pool_cell(6.42, 0.31) == "6.4 (alpha 0.31: judges disagree)"
    assert pool_cell(None, None) == "- (alpha -)"
    assert judge_labels(
        ["dimensions", {"name": "dimensions", "model": "m"}, {"name": "x", "model": "m"}]
    ) == [
        "dimensions",
        "m#2",
        "m#3",
    ]


# --------------------------------------------------------------------------- specs
def test_a_pool_spec_is_a_list_a_repeated_flag_or_a_file(tmp_path, fake_judges):
    listed = tmp_path / "pool.yaml"
    listed.write_text(json.dumps([FIRST_SPEC, AGREEING_SPEC]))
    forms = [
        [json.dumps(FIRST_SPEC), json.dumps(AGREEING_SPEC)],  # --judge given twice
        json.dumps([FIRST_SPEC, AGREEING_SPEC]),  # one YAML/JSON list
        str(listed),  # a file holding one
        [FIRST_SPEC, AGREEING_SPEC],  # a list from a recipe
    ]
    for form in forms:
        assert read_judge_specs(form, "--judge") == [
            (FIRST_SPEC, "--judge[0]"),
            (AGREEING_SPEC, "--judge[1]"),
        ]
        check_judge_spec(form, "--judge")
    assert read_judge_specs([json.dumps(FIRST_SPEC)], "--judge") == [(FIRST_SPEC, "--judge")]


def test_bad_pool_specs_are_refused_naming_the_flag(tmp_path, fake_judges):
    with pytest.raises(PluginError, match=r"^--judge\[1\]\.colour: unknown option"):
        check_judge_spec([json.dumps(FIRST_SPEC), '{"name": "fake", "colour": "red"}'], "--judge")
    with pytest.raises(PluginError, match=r"^--model\.judge\[0\]: unknown judge 'mood'"):
        check_judge_spec('["mood", "fake"]', "--model.judge")
    with pytest.raises(ValueError, match=r"^--judge: an empty list of judges"):
        check_judge_spec("[]", "--judge")
    with pytest.raises(ValueError, match=r"^--judge: a judge is a name or a mapping with 'name', got 3"):
        check_judge_spec("[fake, 3]", "--judge")
    with pytest.raises(ValueError, match=r"^--judge: .*pool\.yaml not found"):
        check_judge_spec([json.dumps(FIRST_SPEC), str(tmp_path / "pool.yaml")], "--judge")


# --------------------------------------------------------------------------- rlver score --judge
def _leaderboard_row(lines):
    header = next(line for line in lines if line.startswith("| model | N |"))
    row = next(line for line in lines if line.startswith("| records | 4 |"))
    return header, row.split(" | ")[-3:]


def test_rlver_score_with_a_pool_that_agrees_and_one_that_disagrees(tmp_path, capsys, fake_judges):
    records = transcripts(tmp_path / "records.jsonl")
    common = ["score", str(records), "--plot", "none"]

    assert main([*common, "--judge", json.dumps(FIRST_SPEC), "--judge", json.dumps(AGREEING_SPEC)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, cells = _leaderboard_row(lines)
    assert header.endswith("| empathy | insight | judge missing |")
    # Pool means: empathy (8.25 + 6.25 + 3.25 + 5.25) / 4, insight over the three scored.
    alpha_empathy = krippendorff_alpha([[8, 6, 3, 5], [8.5, 6.5, 3.5, 5.5]])
    assert cells[0] == f"{5.75:.1f} (alpha {alpha_empathy:.2f})" and "disagree" not in cells[0]
    alpha_insight = krippendorff_alpha([[6, 5, 7, None], [6.5, 5.5, 7.5, None]])
    assert cells[1] == f"6.2 (alpha {alpha_insight:.2f})" and alpha_insight > 0.667 and cells[2] == "1 |"
    assert any(line.startswith("judges: judge-a, judge-b; each dimension is their mean") for line in lines)
    judged = [json.loads(line) for line in (tmp_path / "records.judged.jsonl").read_text().splitlines()]
    assert judged[0]["judges"] == {"judge-a": FIRST["Avery"], "judge-b": agreeing(FIRST["Avery"])}
    assert judged[0]["scores"] == {"empathy": 8.25, "insight": 6.25}
    assert judged[3]["scores"] == {"empathy": 5.25, "insight": None}  # no judge scored it

    assert main([*common, "--judge", json.dumps([FIRST_SPEC, DISAGREEING_SPEC])]) == 0
    _, cells = _leaderboard_row(capsys.readouterr().out.splitlines())
    assert cells[0] == f"5.0 (alpha {krippendorff_alpha([[8, 6, 3, 5], [2, 4, 7, 5]]):.2f}: judges disagree)"
    assert cells[1] == "6.0 (alpha 1.00)"

    # One judge: the columns as they always were, and no `judges` in the judged file.
    assert main([*common, "--judge", json.dumps(FIRST_SPEC)]) == 0
    output = capsys.readouterr().out
    _, cells = _leaderboard_row(output.splitlines())
    assert cells == ["5.5", "6.0", "1 |"] and "alpha" not in output
    judged = [json.loads(line) for line in (tmp_path / "records.judged.jsonl").read_text().splitlines()]
    assert judged[0] == {"file": "records", "index": 0, "id": "Avery", "scores": FIRST["Avery"]}


def test_a_bad_pool_member_stops_rlver_score_before_any_judging(tmp_path, capsys, fake_judges):
    records = transcripts(tmp_path / "records.jsonl")
    bad = json.dumps({"name": "fake", "model": "x", "colour": "red"})
    code = main(["score", str(records), "--plot", "none", "--judge", json.dumps(FIRST_SPEC), "--judge", bad])
    assert code != 0
    assert "rlver score: error: --judge[1].colour: unknown option" in capsys.readouterr().err
    assert not (tmp_path / "records.judged.jsonl").exists()


# --------------------------------------------------------------------------- rlver test's judging
def test_rlver_tests_judging_returns_the_pools_agreement_and_prints_it(tmp_path, fake_judges):
    records = [json.loads(line) for line in transcripts(tmp_path / "r.jsonl").read_text().splitlines()]
    parts = [(tmp_path / "policy_rank0.jsonl", records[:2]), (tmp_path / "policy_rank1.jsonl", records[2:])]

    means, names = judge_test_records(parts, FIRST_SPEC, flag="--model.judge", write=False)
    assert names == ("empathy", "insight") and set(means) == {"empathy", "insight", "judge missing"}
    # One judge prints exactly the lines `rlver test` always printed.
    assert dimension_lines(means, names) == "empathy  5.5\ninsight  6.0\njudge missing  1\n"

    means, names = judge_test_records(parts, [FIRST_SPEC, DISAGREEING_SPEC], flag="--model.judge", write=True)
    assert means["empathy"] == 5.0 and means["judge missing"] == 1
    assert means["agreement"]["empathy"] < 0 and means["agreement"]["insight"] == pytest.approx(1.0)
    assert dimension_lines(means, names).splitlines() == [
        f"empathy  5.0  (alpha {means['agreement']['empathy']:.2f}: judges disagree)",
        "insight  6.0  (alpha 1.00)",
        "judge missing  1",
        "judges   judge-a, judge-c (agreement: Krippendorff's alpha)",
    ]
    rank1 = [json.loads(line) for line in (tmp_path / "policy_rank1.judged.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rank1] == ["Casey", "Devon"]
    assert rank1[0]["judges"]["judge-c"] == disagreeing(FIRST["Casey"])


def test_a_recipe_may_give_rlver_test_a_pool_of_judges(tmp_path, fake_judges):
    """`--model.judge` takes a list in a recipe (the module's type admits it), and the module keeps
    the whole pool for the test's judging."""
    import yaml

    from rlver.cli import parse_recipe
    from rlver.train.module import RLVERModule
    from tests.conftest import REPO

    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    recipe["model"]["judge"] = [FIRST_SPEC, DISAGREEING_SPEC]
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert [dict(member) for member in parse_recipe(str(path)).model.judge] == [FIRST_SPEC, DISAGREEING_SPEC]
    module = RLVERModule(judge=[FIRST_SPEC, DISAGREEING_SPEC])
    assert module.evaluator.judge == [FIRST_SPEC, DISAGREEING_SPEC]
    module.evaluator.start_test()  # checks every member before any dialogue
