import pytest

from mlxd.core.errors import InvalidRequest
from mlxd.core.keepalive import FOREVER, parse_keep_alive


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300),
        ("1h", 3600),
        ("1h30m", 5400),
        ("10s", 10),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        (0, 0),
        ("0", 0),
        (30, 30),
        ("30", 30),
        (-1, FOREVER),
        ("-1", FOREVER),
        ("-5m", FOREVER),
        (None, None),
        (2.5, 2.5),
    ],
)
def test_parse(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m5", "", "5mx", True])
def test_invalid(value):
    with pytest.raises(InvalidRequest):
        parse_keep_alive(value)
