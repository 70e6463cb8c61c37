"""benchmarks.offline.structured, through ``benchmarks.offline.offline --structured-fraction``: the share of constrained
requests, their outputs, and a tiny run end to end."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from benchmarks.common.workloads import BenchRequest, request_params
from benchmarks.offline import offline, structured
from tests.engine.helpers import make_engine


@pytest.mark.parametrize("fraction, count", [(0.0, 0), (0.2, 2), (0.5, 5), (1.0, 10)])
def test_the_fraction_of_constrained_requests(fraction, count):
    requests = [BenchRequest([7, 8, 9], 4) for _ in range(10)] + [BenchRequest([7, 8], 0, "score")]
    mixed = structured.with_structured_fraction(requests, fraction)
    assert sum(r.kind == "structured" for r in mixed) == count
    assert mixed[-1].kind == "score"  # only generating requests are constrained


def test_a_structured_request_writes_the_schema():
    engine = make_engine()
    params = request_params(BenchRequest([7, 8, 9], 200, "structured")).replace(ignore_eos=False)
    engine.add_request("r", [7, 8, 9], params)
    text = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    Draft202012Validator(structured.SCHEMA).validate(json.loads(text))


def test_offline_runs_each_fraction_and_reports_the_cached_schema_ttft(tmp_path):
    out = tmp_path / "out.json"
    offline.main(["--model", "bench-random", "--workload", "seed", "--num-requests", "4", "--output-lens", "4", "8",
                  "--prompt-lens", "8", "16", "--structured-fraction", "0,1", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"structured-0", "structured-1"}
    for result in results.values():
        assert result["tokens_per_s"] > 0 and result["schema_ttft_ms"] > 0
    with pytest.raises(SystemExit):
        offline.parse_args(["--structured-fraction", "0,1.5"])
