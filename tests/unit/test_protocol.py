"""The wire protocol shared by the model servers and their clients (aligner.clients.protocol)."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from aligner.clients import protocol

ROOT = Path(__file__).resolve().parents[2]


def test_padded_width_is_the_next_power_of_two_from_eight():
    assert [protocol.padded_width(n) for n in (1, 8, 9, 16, 17, 100)] == [8, 8, 16, 16, 32, 128]


def test_right_padded_sends_integer_ids_as_int64_and_anything_else_as_it_is():
    tokens = protocol.right_padded([np.array([3, 4], dtype=np.int32), np.array([5], dtype=np.uint8)], 4)
    assert tokens.dtype == np.int64 and tokens.tolist() == [[3, 4, 0, 0], [5, 0, 0, 0]]
    floats = protocol.right_padded([np.array([1.5])], 2)
    assert floats.dtype == np.float64 and floats.tolist() == [[1.5, 0.0]]
    assert protocol.right_padded([np.array([], dtype=np.int64)], 3).dtype == np.int64


@pytest.mark.parametrize("longest, multiple, max_length, expected", [(5, 8, 64, 8), (8, 8, 64, 8), (9, 8, 64, 16),
                                                                      (60, 8, 62, 62), (7, 1, 64, 7)])
def test_packed_width_rounds_up_to_the_multiple_within_the_model_length(longest, multiple, max_length, expected):
    assert protocol.packed_width(longest, multiple, max_length) == expected


def test_token_outside_vocabulary_names_the_first_bad_position():
    assert protocol.token_outside_vocabulary(np.array([0, 29, 3]), 30) == ""
    assert protocol.token_outside_vocabulary(np.array([1, 40, -1]), 30) == (
        "token id 40 at position 1 is outside the vocabulary [0, 30)")
    assert protocol.token_outside_vocabulary(np.array([-2]), 30).startswith("token id -2 at position 0")


def test_errors_round_trip_through_the_error_output():
    encoded = protocol.encode_errors(["", "bad row", "ünïcode"])
    assert encoded.shape == (3, 1) and encoded.dtype == object
    assert protocol.decode_errors({protocol.ERROR: encoded}) == ["", "bad row", "ünïcode"]


def test_request_size_cap_counts_numbers_and_byte_strings():
    request = {protocol.TOKENS: np.zeros((2, 4), dtype=np.int64),
               protocol.SENTENCES: np.array([[b"abc"], [b"de"]], dtype=object)}
    assert protocol.request_bytes(request) == 64 + 5
    assert protocol.request_over_size_cap(request, None) == ""
    assert protocol.request_over_size_cap(request, 69) == ""
    assert "carries 69 bytes, more than the server accepts (68 bytes" in protocol.request_over_size_cap(request, 68)


def _string_literals(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_clients_and_the_reward_server_spell_no_wire_name_themselves():
    names = {value for name, value in vars(protocol).items()
             if name.isupper() and isinstance(value, str)}
    assert {"tokens", "sequence_lengths", "error", "critic_train", "reward_model"} <= names
    files = [ROOT / "aligner/clients/reward.py", ROOT / "aligner/clients/critic.py", ROOT / "servers/reward_model.py",
             ROOT / "servers/critic.py"]
    spelled = {path.name: sorted(_string_literals(path) & names) for path in files}
    assert spelled == {path.name: [] for path in files}


@pytest.mark.parametrize("call, field", [
    (lambda client: client.infer_text_async(["fine", "bad \ud800"]), r"texts\[1\]"),
    (lambda client: client.infer_conversations_async(["fine", [{"role": "user", "content": "bad \udc00"}]],
                                                     ["a", "b"]), r"prompts\[1\]"),
    (lambda client: client.infer_conversations_async(["fine"], [{"role": "assistant", "content": "\ud800"}]),
     r"responses\[0\]"),
])
def test_the_reward_client_refuses_text_utf8_cannot_encode_as_its_own_error_naming_the_field(call, field):
    """A lone surrogate is a Python (and JSON) string but not UTF-8: refused before anything is sent, as a
    ClientError (one line at an entry point), not a UnicodeEncodeError."""
    from aligner.clients import ClientError
    from aligner.clients.reward import RequestError, RewardClient

    with RewardClient("127.0.0.1", 9, ready_timeout_s=0.1) as client:  # nothing listens: nothing is sent
        with pytest.raises(RequestError, match=rf"^{field} holds text that cannot be encoded as UTF-8") as error:
            call(client)
    assert isinstance(error.value, ClientError)
