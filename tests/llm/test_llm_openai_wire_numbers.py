"""Chat Completions sampling numbers: NaN and Infinity (which ``json.loads`` accepts) are a 400
naming the field, never a 500 or a NaN sent on to the backend."""
from __future__ import annotations

import json

import pytest

from rolloutd.endpoint.shapes.chat import parse_sampling
from rolloutd.endpoint.wire import EndpointError


@pytest.mark.parametrize("key", ["max_tokens", "temperature", "top_p", "top_k", "seed"])
@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_sampling_numbers_are_refused_naming_the_field(key, raw):
    body = json.loads('{"%s": %s}' % (key, raw))
    with pytest.raises(EndpointError) as e:
        parse_sampling(body)
    assert e.value.status == 400
    assert key in str(e.value)


def test_finite_numbers_still_pass():
    s = parse_sampling({"max_tokens": 8, "temperature": 0.5, "top_p": 0.9})
    assert s.max_tokens == 8 and s.temperature == 0.5 and s.top_p == 0.9
