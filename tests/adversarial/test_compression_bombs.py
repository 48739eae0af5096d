"""Issue 12: a bomb of every codec is refused by the client and by the broker in bounded memory.

Each bomb is a batch of about 1 MB or less that inflates to 1 GiB (snappy, which inflates 21-fold at
most: 6 MB to 128 MiB; and a raw snappy block declaring 1 GiB in 13 bytes). The client's reader
(records_of with max_inflated_batch_bytes 16 MiB) and the broker's Produce check (validate_records
with one request's 64 MiB budget) each run in a fresh interpreter, which reports its peak resident
memory (VmHWM, reset through /proc/self/clear_refs after the bomb is built) and what it raised. The
peak may exceed the bound by a constant: the output buffer's slack and, for zstd, its window, which
holds what was inflated (the zstd bomb asks for the largest window libzstd takes by default, 128 MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adversarial.crafted import GZIP, LZ4, SNAPPY, ZSTD

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
CLIENT_BOUND = 16 * MIB
BROKER_BOUND = 64 * MIB  # twophase.broker.storage.validation.REQUEST_INFLATION_LIMIT
BOMBS = {
    "gzip": (GZIP, "gzip_bomb"),
    "snappy": (SNAPPY, "snappy_bomb"),
    "snappy declaring 1 GiB": (SNAPPY, "snappy_declaring"),
    "lz4": (LZ4, "lz4_bomb"),
    "zstd": (ZSTD, "zstd_bomb"),
}
PROBE = """
import json, sys
from tests.adversarial import crafted
from twophase.broker.storage.validation import InflationBudget, validate_records
from twophase.client.consumer import records_of
from twophase.wire.errors import KafkaError

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

codec, payload, reader, bound = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
data = crafted.raw_batch(getattr(crafted, payload)(), count=1, codec=codec)
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
if reader == "client":
    read = records_of("t", 0, data, 0, [], read_committed=False, max_inflated_bytes=bound)
    outcome = {"messages": len(read.messages), "error": read.corrupt and read.corrupt.reason}
else:
    try:
        validate_records(data, InflationBudget())
        outcome = {"error": None}
    except KafkaError as exc:
        outcome = {"error": str(exc), "code": exc.code}
outcome["growth"] = status("VmHWM") - before
print(json.dumps(outcome))
"""


def _inflate_in_a_fresh_interpreter(codec: int, payload: str, reader: str, bound: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", PROBE, str(codec), payload, reader, str(bound)], env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _allowed_growth(codec: int, bound: int) -> int:
    """The bound, the output buffer's growth slack, zstd's window (as full as what was inflated) and
    the decoders' own buffers."""
    return bound * 3 // 2 + (bound if codec == ZSTD else 0) + 8 * MIB


@pytest.mark.parametrize("bomb", list(BOMBS))
def test_client_refuses_the_bomb_in_bounded_memory(bomb):
    codec, payload = BOMBS[bomb]
    outcome = _inflate_in_a_fresh_interpreter(codec, payload, "client", CLIENT_BOUND)
    assert outcome["messages"] == 0
    assert f"inflate to more than {CLIENT_BOUND} bytes" in outcome["error"]
    assert outcome["growth"] < _allowed_growth(codec, CLIENT_BOUND), f"peaked {outcome['growth'] / MIB:.0f} MiB higher"


@pytest.mark.parametrize("bomb", list(BOMBS))
def test_broker_refuses_the_bomb_in_bounded_memory(bomb):
    codec, payload = BOMBS[bomb]
    outcome = _inflate_in_a_fresh_interpreter(codec, payload, "broker", BROKER_BOUND)
    assert outcome["code"] == 10 and f"inflate to more than {BROKER_BOUND} bytes" in outcome["error"]  # MESSAGE_TOO_LARGE
    assert outcome["growth"] < _allowed_growth(codec, BROKER_BOUND), f"peaked {outcome['growth'] / MIB:.0f} MiB higher"
