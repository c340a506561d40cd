"""python -m runners.serve (issue 39): the official `openai` client over loopback against the
server on the real SmolLM2 checkpoint, started once in this process (runners.serve's own flag
checks, plan and loading code) on a free port with an API key.

The references are runners.infer's own generation path, run separately (its main(), with
--output-json: the --chat and --prompt runs), and the library's solo `generate()`, one request
alone, for the concurrent requests: each request's tokens must equal them exactly."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import torch  # noqa: E402

from offload.infer.generate import generate  # noqa: E402
from runners import infer, serve  # noqa: E402
from tests.conftest import free_port  # noqa: E402

KEY = "test-key-39"
SYSTEM = "You are a concise assistant."
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    import uvicorn

    from runners.serve_api import build_app
    port = free_port()
    args = serve.build_parser().parse_args(
        ["--model", smollm2_gguf, "--max-context", "384", "--probe-seconds", "0", "--port", str(port),
         "--api-key", KEY, "--max-batch", "8", "--max-queue", "4"])
    serve.check_serve_flags(args)
    served, close = serve.load(args)
    app = build_app(served, api_key=KEY, slots=8, max_queue=4)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield {"port": port, "served": served, "engine": app.state.engine, "app": app}
    srv.should_exit = True
    thread.join(10)
    close()


def client(server, **kw):
    return openai.OpenAI(api_key=KEY, base_url=f"http://127.0.0.1:{server['port']}/v1", max_retries=0,
                         timeout=60, **kw)


def runner_ids(model: str, tmp_path, argv: list[str]) -> list[int]:
    out = tmp_path / f"ref{len(os.listdir(tmp_path))}.json"
    assert infer.main(["--model", model, "--probe-seconds", "0", "--output-json", str(out), *argv]) == 0
    return json.loads(out.read_text())["generated_ids"][0]


def visible(served, ids: list[int]) -> str:
    return served.tokenizer.decode([t for t in ids if t not in set(served.stop_ids)])


def test_chat_and_completions_equal_runners_infer(server, smollm2_gguf, tmp_path):
    """A greedy chat completion gives runners.infer --chat's tokens; streamed, the same text;
    /v1/completions gives runners.infer --prompt's tokens."""
    served, c = server["served"], client(server)
    want = runner_ids(smollm2_gguf, tmp_path, ["--chat", "--system", SYSTEM, "--prompt", QUESTION,
                                               "--max-new-tokens", "12"])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    r = c.chat.completions.create(model=served.name, messages=messages, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].message.content == visible(served, want)
    assert r.usage.completion_tokens == len(want) and r.usage.prompt_tokens == len(
        served.tokenizer.encode_chat(messages))
    assert r.choices[0].finish_reason == ("stop" if want[-1] in served.stop_ids else "length")
    chunks = list(c.chat.completions.create(model=served.name, messages=messages, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(want)

    prompt = "The three primary colors are"
    want = runner_ids(smollm2_gguf, tmp_path, ["--prompt", prompt, "--max-new-tokens", "10"])
    r = c.completions.create(model=served.name, prompt=prompt, max_tokens=10, temperature=0,
                             extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].text == visible(served, want)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=served.name, prompt=prompt, max_tokens=10, temperature=0, stream=True) if ch.choices)
    assert streamed == r.choices[0].text
    assert [m.id for m in c.models.list().data] == [served.name]


def test_stop_strings_seed_and_sampling(server):
    """A stop string ends the text before it; a seeded sampled request repeats itself and equals
    generate() with the same seed."""
    served, c = server["served"], client(server)
    r = c.completions.create(model=served.name, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                             stop=[" 6"])
    assert r.choices[0].finish_reason == "stop" and " 6" not in r.choices[0].text
    assert r.choices[0].text.startswith(" 4, 5,")
    messages = [{"role": "user", "content": "Tell me a story."}]
    got = [c.chat.completions.create(model=served.name, messages=messages, max_tokens=8, temperature=0.9,
                                     top_p=0.95, seed=7, extra_body={"return_token_ids": True})
           for _ in range(2)]
    ids = served.tokenizer.encode_chat(messages)
    from offload.infer.generate import SamplingParams
    want = generate(served.model, [ids], max_new_tokens=8, stop_ids=served.stop_ids,
                    sampling=SamplingParams(0.9, 0, 0.95, 7)).tokens[0]
    assert [g.choices[0].model_extra["token_ids"] for g in got] == [want, want]


def test_eight_concurrent_streams_each_equal_their_solo_run(server):
    served, engine = server["served"], server["engine"]
    topics = ["the sea", "a cat", "Paris", "gravity and the moon and the tides of the ocean", "bread",
              "a long walk in the mountains on a cold morning", "music", "the number seven"]
    lengths = [6, 14, 9, 12, 5, 16, 8, 11]
    messages = [[{"role": "user", "content": f"Write about {t}."}] for t in topics]
    solo = [generate(served.model, [served.tokenizer.encode_chat(m)], max_new_tokens=n,
                     stop_ids=served.stop_ids).tokens[0] for m, n in zip(messages, lengths)]
    results: list = [None] * 8
    barrier = threading.Barrier(8)
    steps_before = engine.steps

    def one(k):
        c = client(server)
        barrier.wait()
        chunks = list(c.chat.completions.create(model=served.name, messages=messages[k],
                                                max_tokens=lengths[k], temperature=0, stream=True,
                                                extra_body={"return_token_ids": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        ids = [ch.choices[0].model_extra.get("token_ids") for ch in chunks
               if ch.choices and ch.choices[0].finish_reason][0]
        results[k] = (text, ids)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for (text, ids), want in zip(results, solo):
        assert ids == want
        assert text == visible(served, want)
    # they shared decode steps: far fewer than one per token of every request
    assert engine.steps - steps_before < sum(len(s) for s in solo) - 8


def test_rows_joining_and_leaving_at_any_step_stay_exact(server):
    """The engine alone, stepped by hand: a longer prompt joining later (the cache shifts right),
    short requests ending early (it shifts left, the last row moves into the gap), a sampled row
    and a cancelled one; every finished row equals its solo generate()."""
    from offload.infer.batching import BatchEngine, Request
    from offload.infer.generate import SamplingParams
    served = server["served"]
    tok, stop = served.tokenizer, set(served.stop_ids)
    texts = ["Hi.", "Name a color.", "Describe a rainy afternoon in a small seaside town in detail.",
             "What is 3 + 4?", "Write a line about snow."]
    plan = [(0, 3, SamplingParams()), (0, 9, SamplingParams()), (2, 8, SamplingParams()),
            (3, 5, SamplingParams(0.8, 0, 0.9, 3)), (5, 6, SamplingParams())]  # (join step, tokens)
    engine = BatchEngine(served.model, slots=3, max_len=96)
    reqs = [Request(tok.encode_chat([{"role": "user", "content": t}]), n, sp, stop)
            for t, (_, n, sp) in zip(texts, plan)]
    doomed = Request(tok.encode_chat([{"role": "user", "content": "Tell me everything."}]), 40)
    engine.submit(doomed)
    for step in range(40):
        for req, (at, _, _) in zip(reqs, plan):
            if at == step:
                engine.submit(req)
        if step == 4:
            doomed.cancel()
        engine.step()
        if all(r.finish_reason for r in reqs) and engine.load() == (0, 0):
            break
    assert doomed.finish_reason == "cancelled" and engine.load() == (0, 0) and engine.length == 0
    for req, (_, n, sp) in zip(reqs, plan):
        want = generate(served.model, [req.prompt], max_new_tokens=n, stop_ids=stop, sampling=sp).tokens[0]
        assert req.tokens == want and req.finish_reason in ("stop", "length")


def _raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         key: str | None = KEY) -> tuple[int, dict | None]:
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body, headers=h)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, None


def test_hostile_requests_get_openai_errors_and_the_server_goes_on(server):
    name = server["served"].name
    ok_msg = [{"role": "user", "content": "hi"}]

    def chat(**fields):
        return json.dumps({"model": name, "messages": ok_msg, "max_tokens": 4, **fields}).encode()
    C, T = "/v1/chat/completions", "/v1/completions"
    cases = [
        ("POST", C, b"{not json", None), ("POST", C, b"[1, 2]", None), ("POST", C, b"", None),
        ("POST", C, json.dumps({"model": name}).encode(), None),
        ("POST", C, chat(messages=[]), None), ("POST", C, chat(messages="hi"), None),
        ("POST", C, chat(messages=[{"role": "user"}]), None),
        ("POST", C, chat(messages=[{"role": "wizard", "content": "hi"}]), None),
        ("POST", C, chat(messages=[{"role": "user", "content": 42}]), None),
        ("POST", C, chat(max_tokens=10 ** 9), None), ("POST", C, chat(max_tokens=-3), None),
        ("POST", C, chat(max_tokens="many"), None), ("POST", C, chat(temperature=-0.5), None),
        ("POST", C, chat(temperature="hot"), None), ("POST", C, chat(top_p=5), None),
        ("POST", C, chat(messages=[{"role": "user", "content": "word " * 200_000}]), None),
        ("POST", C, chat(model="gpt-9"), None), ("POST", C, chat(), {"key": None}),
        ("POST", C, chat(), {"key": "wrong"}), ("POST", C, chat(n=3), None),
        ("POST", C, chat(tools=[{"type": "function", "function": {"name": "f"}}]), None),
        ("POST", C, chat(logprobs=True), None), ("POST", C, chat(stop=list("abcde")), None),
        ("POST", C, chat(stream="yes"), None), ("POST", C, chat(seed=1.5), None),
        ("POST", C, b"[" * 100_000 + b"]" * 100_000, None),
        ("POST", C, chat(messages=[{"role": "tool", "content": "x"}]), None),
        ("POST", T, json.dumps({"model": name}).encode(), None),
        ("POST", T, json.dumps({"model": name, "prompt": [10 ** 7]}).encode(), None),
        ("POST", T, json.dumps({"model": name, "prompt": ["a", "b"]}).encode(), None),
        ("GET", C, None, None), ("GET", "/v1/nothing", None, None),
        ("POST", C, b"x" * (9 << 20), None),
    ]
    assert len(cases) >= 25
    for method, path, body, extra in cases:
        key = extra["key"] if extra else KEY
        status, err = _raw(server, method, path, body, key=key)
        assert 400 <= status < 500, (path, body[:80] if body else None, status, err)
        assert isinstance(err, dict) and isinstance(err["error"]["message"], str), (body[:80], err)
        assert set(err["error"]) == {"message", "type", "param", "code"}
    assert _raw(server, "POST", C, chat(max_tokens=10 ** 9))[1]["error"]["code"] == "context_length_exceeded"
    assert _raw(server, "POST", C, chat(), key=None)[0] == 401
    assert _raw(server, "POST", C, chat(model="gpt-9"))[0] == 404
    r = client(server).chat.completions.create(model=name, messages=ok_msg, max_tokens=4)
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    assert _raw(server, "GET", "/health", key=None) [1]["status"] == "ok"


def _idle(engine, seconds: float = 15) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if engine.load() == (0, 0):
            return True
        time.sleep(0.05)
    return False


def test_disconnect_frees_the_row_and_a_full_queue_answers_429(server):
    engine, name = server["engine"], server["served"].name
    assert _idle(engine)
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Write a long essay."}],
                       "max_tokens": 300, "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(4):  # the role chunk and a few tokens
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    assert engine.load()[0] == 1
    steps = engine.steps
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert _idle(engine, 10), engine.load()
    assert engine.steps - steps < 100  # freed long before its 300 tokens

    from offload.infer.batching import Request
    fillers = [Request(prompt=[1, 2, 3], max_new_tokens=300) for _ in range(8 + 4)]
    for f in fillers:
        engine.submit(f)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client(server).chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
        assert e.value.status_code == 429
    finally:
        for f in fillers:
            f.cancel()
    assert _idle(engine)


def test_a_failure_inside_generation_ends_that_request_and_serving_goes_on(server):
    """A forward that raises (injected once) ends the request in it with an error; the next one
    is served."""
    served, name = server["served"], server["served"].name
    model, real = served.model, served.model.forward
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step
            raise RuntimeError("injected failure")
        return real(*a, **k)
    model.forward = failing
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client(server).chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=6)
        assert "injected failure" in str(e.value)
    finally:
        del model.forward
    assert _idle(server["engine"])
    r = client(server).chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_flags_refused_before_loading(smollm2_gguf, capsys):
    from runners.common import run_main
    for argv, msg in ((["--prompt", "hi"], "--prompt is for runners.infer"),
                      (["--kv-cache", "host"], "--kv-cache host"),
                      (["--max-batch", "0"], "--max-batch"),
                      (["--max-context", "100000"], "--max-context must be in")):
        assert run_main(serve.main, ["--model", smollm2_gguf, "--probe-seconds", "0", *argv]) == 2
        assert msg in capsys.readouterr().err
    assert run_main(serve.main, ["--model", smollm2_gguf, "--probe-seconds", "0", "--dry-run"]) == 0
    assert "plan: latency mode, batch 8" in capsys.readouterr().err
    assert torch.get_num_threads() >= 1
