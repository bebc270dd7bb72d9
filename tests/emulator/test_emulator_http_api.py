"""The OpenAI surface over real HTTP: completions, chat, streaming, errors, ids, disconnects."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from emu_harness import MODEL_DIR, Emulator, emulator

pytestmark = pytest.mark.timeout(60)

PROMPT = "The quick brown fox jumps over the lazy dog. hello world"


def sse_events(body: str) -> list[str]:
    assert body.endswith("data: [DONE]\n\n")
    return [part[len("data: ") :] for part in body.split("\n\n") if part]


def test_completion_non_streaming(tiny: Emulator) -> None:
    r = httpx.post(
        tiny.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8}
    )
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-")
    assert body["usage"] == {
        "prompt_tokens": 12,
        "total_tokens": 20,
        "completion_tokens": 8,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["kv_transfer_params"] is None


def test_same_prompt_gives_same_tokens(tiny: Emulator) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "return_token_ids": True}
    first = httpx.post(tiny.url + "/v1/completions", json=body).json()["choices"][0]
    second = httpx.post(tiny.url + "/v1/completions", json=body).json()["choices"][0]
    assert first["token_ids"] == second["token_ids"]
    assert len(first["token_ids"]) == 6
    assert first["prompt_token_ids"] == [266, 316, 311, 306, 313, 315, 299, 314, 312, 15, 324, 318]


def test_chat_streaming_with_usage(tiny: Emulator) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", tiny.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        text = r.read().decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 16, "total_tokens": 21, "completion_tokens": 5}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_x_request_id_names_the_completion(tiny: Emulator) -> None:
    r = httpx.post(
        tiny.url + "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
        headers={"X-Request-Id": "abc-123"},
    )
    assert r.json()["id"] == "cmpl-abc-123"


def test_stop_string_ends_with_stop(tiny: Emulator) -> None:
    full = httpx.post(
        tiny.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 20}
    ).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = httpx.post(
        tiny.url + "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "stop": stop},
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert choice["text"] == text[: text.find(stop)]


def test_a_forced_stop_token_ends_the_answer_right_after_min_tokens(tiny: Emulator) -> None:
    """vLLM's way to end an answer at a chosen length without announcing it in max_tokens: the
    stop token is masked until min_tokens tokens exist, then a bias of +100 makes it the next."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 20,
        "min_tokens": 6,
        "stop_token_ids": [0],
        "logit_bias": {"0": 100},
        "return_token_ids": True,
    }
    choice = httpx.post(tiny.url + "/v1/completions", json=body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 0)
    assert len(choice["token_ids"]) == 7
    assert 0 not in choice["token_ids"][:6]
    assert choice["token_ids"][-1] == 0
    without_min = httpx.post(tiny.url + "/v1/completions", json={**body, "min_tokens": 0})
    assert without_min.json()["choices"][0]["token_ids"] == [0]


def test_a_bias_of_minus_100_bans_a_token(tiny: Emulator) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "return_token_ids": True}
    plain = httpx.post(tiny.url + "/v1/completions", json=body).json()["choices"][0]["token_ids"]
    banned = {str(t): -100 for t in plain[:3]}
    biased = httpx.post(tiny.url + "/v1/completions", json={**body, "logit_bias": banned}).json()[
        "choices"
    ][0]["token_ids"]
    assert len(biased) == 12
    assert not set(plain[:3]) & set(biased)


@pytest.mark.parametrize(
    ("logit_bias", "message"),
    [
        (
            {"x": 1},
            "logit_bias contains key(s) that cannot be converted to integer token IDs: ['x']",
        ),
        (
            {"1000000000": 1},
            "token_id(s) [1000000000] in logit_bias contain out-of-vocab token ids.",
        ),
        ([1, 2], "logit_bias must map token ids to numbers"),
    ],
)
def test_logit_bias_is_checked_as_vllm_checks_it(
    tiny: Emulator, logit_bias: object, message: str
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "logit_bias": logit_bias}
    r = httpx.post(tiny.url + "/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(message)


@pytest.mark.parametrize(
    ("body", "status", "type_"),
    [
        ({"model": "nope", "prompt": "hi", "max_tokens": 4}, 404, "NotFoundError"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, "BadRequestError"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 5000}, 400, "BadRequestError"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 1024}, 400, "BadRequestError"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 2}, 400, "BadRequestError"),
    ],
)
def test_errors(tiny: Emulator, body: dict[str, object], status: int, type_: str) -> None:
    r = httpx.post(tiny.url + "/v1/completions", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert error["code"] == status


def test_client_disconnect_aborts_the_request(tiny: Emulator) -> None:
    def metric(name: str) -> float:
        for line in httpx.get(tiny.url + "/metrics").text.splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(name)

    aborted = 'vllm:request_success_total{engine="0",finished_reason="abort"'
    before = metric(aborted)
    body = json.dumps(
        {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "stream": True}
    ).encode()
    with socket.create_connection(("127.0.0.1", tiny.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 10
    while metric(aborted) == before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert metric('vllm:num_requests_running{engine="0"') == 0


def test_vllm_flags_are_accepted_and_positional_model_works() -> None:

    args = [
        "serve",
        str(MODEL_DIR),
        "--served-model-name",
        "tiny",
        "--dtype",
        "bfloat16",
        "--trust-remote-code",
        "--gpu-memory-utilization",
        "0.9",
        "--max_model_len",
        "512",
        "--speedup",
        "50",
    ]
    with emulator(args) as proc:
        models = httpx.get(proc.url + "/v1/models").json()
        assert models["data"][0]["id"] == "tiny"
        assert models["data"][0]["max_model_len"] == 512
        assert "ignoring vLLM flags" in proc.output()


def test_stop_string_while_streaming_never_leaks_the_stop(tiny: Emulator) -> None:
    full = httpx.post(
        tiny.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 20}
    ).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "stop": [stop], "stream": True}
    with httpx.stream("POST", tiny.url + "/v1/completions", json=body) as r:
        chunks = [json.loads(e) for e in sse_events(r.read().decode())[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == full[: full.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
