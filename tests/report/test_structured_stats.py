"""The report's structured-output counts (issue 12): each completion of a
constrained row checked against its constraint."""

from __future__ import annotations

from bulkinfer.report.stats import RunStats
from bulkinfer.report.structured import StructuredStats
from bulkinfer.schema import Choice, Completion

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}


def test_each_kind_is_checked_and_a_cut_completion_counted_apart() -> None:
    stats = StructuredStats()
    schema = {"json": SCHEMA}
    stats.add(schema, '{"age": 3}', "stop")
    stats.add(schema, '{"age": "three"}', "stop")  # parses, fails the schema
    stats.add(schema, '{"age": ', "length")  # cut before the JSON closed
    stats.add({"json": '{"type": "array"}'}, "[1]", "stop")  # a schema given as JSON text
    stats.add({"json_object": True}, "[1]", "stop")
    stats.add({"choice": ["yes", "no"]}, "no", "stop")
    stats.add({"choice": ["yes", "no"]}, "n", "length")
    stats.add({"regex": "[0-9]{4}"}, "1945", "stop")
    stats.add({"regex": "[0-9]{4}"}, "19", "length")
    stats.add({"grammar": 'root ::= "a"'}, "a", "stop")
    report = stats.to_dict("xgrammar")
    assert report is not None and report["backend"] == "xgrammar"
    counts = {kind: tuple(c.values()) for kind, c in report["by_kind"].items()}
    # (completions, valid, cut_at_max_tokens, invalid, unchecked)
    assert counts == {
        "choice": (2, 1, 1, 0, 0),
        "grammar": (1, 0, 0, 0, 1),
        "json": (4, 2, 1, 1, 0),
        "json_object": (1, 0, 0, 1, 0),
        "regex": (2, 1, 1, 0, 0),
    }
    assert StructuredStats().to_dict("xgrammar") is None  # no constrained rows: no section


def test_finish_reasons_count_every_choice() -> None:
    stats = RunStats()
    stats.finished(Completion("a", "x", "stop", 3, 1))
    two = (Choice(0, "yes", "stop", 1), Choice(1, "ye", "length", 1))
    stats.finished(Completion("b", "yes", "stop", 3, 2, choices=two), {"choice": ["yes", "no"]})
    assert stats.finish_reasons == {"stop": 2, "length": 1}
    assert stats.structured.counts["choice"]["valid"] == 1
    assert stats.structured.counts["choice"]["cut_at_max_tokens"] == 1
