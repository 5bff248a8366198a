"""``--data`` through the CLI: every format trains, and bad records give one error line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECORDS = {
    "text": {"text": "the router sends each token to two experts"},
    "messages": {
        "messages": [
            {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "2 plus 2 is 4."},
        ]
    },
    "alpaca": {"instruction": "Add 2 and 2.", "input": "", "output": "2 plus 2 is 4."},
    "sharegpt": {
        "conversations": [
            {"from": "human", "value": "What is 2 plus 2?"},
            {"from": "gpt", "value": "2 plus 2 is 4."},
        ]
    },
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_format_trains_through_the_cli(tmp_path: Path, cli, name: str) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text((json.dumps(RECORDS[name]) + "\n") * 16)
    out = tmp_path / "run"
    proc = cli.run(
        [
            "--data",
            str(data),
            "--data-format",
            name,
            "--steps",
            "3",
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    log = cli.log(out)
    assert len(log) == 3
    assert log[0]["loss"] > 0  # a row of 65 tokens always holds one reply


@pytest.mark.timeout(120)
def test_bad_records_are_one_error_line_each(tmp_path: Path, cli) -> None:
    data = tmp_path / "bad.jsonl"
    good = json.dumps(RECORDS["messages"])
    data.write_text(
        "\n".join([good, '{"messages": [{"role": "user"}]}', good, "[1, 2]", good]) + "\n"
    )
    proc = cli.run(["--data", str(data), "--steps", "1"])
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {data}:2: messages field messages[0].content: expected a string, got NoneType",
        f"error: {data}:4: messages field (record): expected a JSON object, got list",
    ]
