"""The emulator's reading of logit_bias and min_tokens (tandem/emulator/sampling.py)."""

from __future__ import annotations

from tandem.emulator.sampling import TokenRule

VOCABULARY = [10, 11, 12, 13]


def test_no_rule_when_nothing_is_decisive() -> None:
    assert TokenRule.of({10: 5.0, 11: -99.0}, (), 0) is None
    assert TokenRule.of({}, (2,), 0) is None
    assert TokenRule.of({}, (), 4) is None


def test_plus_100_selects_the_lowest_such_token_and_minus_100_bans() -> None:
    rule = TokenRule.of({13: 100.0, 12: 100.0, 10: -100.0}, (), 0)
    assert rule is not None
    assert rule.choose(11, 0, VOCABULARY) == 12
    banning = TokenRule.of({10: -100.0, 11: -100.0}, (), 0)
    assert banning is not None
    assert banning.choose(10, 0, VOCABULARY) == 12  # the first allowed of the vocabulary
    assert banning.choose(13, 0, VOCABULARY) == 13


def test_stop_tokens_are_masked_until_min_tokens() -> None:
    rule = TokenRule.of({11: 100.0}, (11,), 3)
    assert rule is not None
    assert [rule.choose(11, produced, VOCABULARY) for produced in range(5)] == [10, 10, 10, 11, 11]
    masked_stream = TokenRule.of({}, (10,), 2)
    assert masked_stream is not None
    assert masked_stream.choose(10, 1, VOCABULARY) == 11
    assert masked_stream.choose(10, 2, VOCABULARY) == 10
