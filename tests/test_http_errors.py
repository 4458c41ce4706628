"""Every failure the server can name is an OpenAI-style error, never a bare
500 or a cut stream: a chat template that refuses the messages and a content
part that is not text are 400s naming the field; a batch that aborts under a
stream ends it with an error event and `[DONE]`, and under a plain request is
a 503. `usage.completion_tokens` (and the journal's `request.finished`) count
exactly the tokens emitted, on both lanes. Real hypercorn on 127.0.0.1: the
`kvcellar serve` subprocess of tests/test_serve.py, and in-process servers
where a test needs a seam (a failing engine) or the system's journal."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from functools import partial

import httpx
import openai
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from test_serve import Server, _free_port

from kvcellar.actors.gateway_core import LANE_BATCH
from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.engine.engine import EngineThread, SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.http.app import HttpSettings, build_app

REFUSE_SYSTEM_ROLE = (
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{{- raise_exception('System role not supported') }}{%- endif %}{%- endfor %}"
)


class InProcessServer:
    """`open_system(config, seams)` and hypercorn serving `build_app` on
    127.0.0.1, in one `trio.run` on a background thread, so a test can hand the
    system a seam (`SystemSeams.engine`) and look at its state on its own thread."""

    def __init__(
        self, config: SystemConfig, seams: SystemSeams | None = None, settings: HttpSettings | None = None
    ) -> None:
        self.config = config
        self.seams = seams
        self.settings = settings
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.system = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._token = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="test-http-server", daemon=True)

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        assert self._ready.wait(120), "the in-process server did not start"
        if self._failure is not None:
            raise self._failure
        return self

    def __exit__(self, *_: object) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(120)
        assert not self._thread.is_alive(), "the in-process server did not stop"
        if self._failure is not None:
            raise self._failure

    def run(self, async_fn, *args):
        """Run `async_fn(system, *args)` on the server's Trio thread; its result."""
        return trio.from_thread.run(async_fn, self.system, *args, trio_token=self._token)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:
            self._failure = e
        finally:
            self._ready.set()

    async def _main(self) -> None:
        async with open_system(self.config, self.seams) as system:
            self.system = system
            self._stop = trio.Event()
            config = Config()
            config.bind = [f"127.0.0.1:{self.port}"]
            config.accesslog = None
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    partial(serve, build_app(system, self.settings), config, shutdown_trigger=self._stop.wait)
                )
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()


class FailingBatchEngine:
    """A real `EngineThread` whose first `batches_failing` batch jobs raise on
    the engine thread right after their first decode step, as an MLX error
    would: the rows of that batch get `BatchAborted`; later batches run."""

    def __init__(self, model_dir, *, batches_failing: int) -> None:
        self._engine = EngineThread(model_dir)
        self._batches_failing = batches_failing

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def start(self):
        return await self._engine.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._engine.stop(timeout_s)

    async def stream(self, job, cancelled, *, label: str = "stream"):
        if label == LANE_BATCH and self._batches_failing > 0:
            self._batches_failing -= 1
            job = partial(_fail_after_first_decode, job)
        async for item in self._engine.stream(job, cancelled, label=label):
            yield item


def _fail_after_first_decode(job, loaded):
    with contextlib.closing(job(loaded)) as steps:
        for step in steps:
            yield step
            if step.decode_rows:
                raise RuntimeError("injected failure of the batch job on the engine thread")


def _client(base: str) -> openai.OpenAI:
    # No retries: a 503 must reach the test as it was answered.
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _sse_lines(base: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line.startswith("data: ")]


# -- the 400s: the kvcellar serve subprocess ------------------------------------


@pytest.fixture(scope="module")
def refusing_server(model_dir_factory, tmp_path_factory):
    """`kvcellar serve` on a copy of the demo llama whose chat template refuses a system message."""
    model_dir = tmp_path_factory.mktemp("refusing") / "llama-refusing"
    shutil.copytree(model_dir_factory("llama"), model_dir)
    config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = REFUSE_SYSTEM_ROLE + tokenizer_config["chat_template"]
    config_path.write_text(json.dumps(tokenizer_config))
    running = Server(model_dir)
    yield running
    running.kill()


def test_a_chat_template_that_raises_is_a_400_naming_messages(refusing_server):
    client = _client(refusing_server.base)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=refusing_server.model_id,
            max_tokens=4,
            temperature=0,
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        )
    assert refused.value.status_code == 400
    error = refused.value.body
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert "System role not supported" in error["message"]
    reply = client.chat.completions.create(
        model=refusing_server.model_id, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "image", "image": "x"},
        {"type": "audio", "audio": "x"},
    ],
)
def test_an_image_or_audio_part_is_a_400_naming_the_part(refusing_server, part):
    client = _client(refusing_server.base)
    messages = [
        {"role": "user", "content": "first turn"},
        {"role": "user", "content": [part, {"type": "text", "text": "what is this?"}]},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=refusing_server.model_id, max_tokens=4, messages=messages)
    error = refused.value.body
    assert error["param"] == "messages[1].content[0]", error
    assert part["type"] in error["message"]


def test_content_as_a_list_of_text_parts_keeps_working(refusing_server):
    client = _client(refusing_server.base)
    parts = client.chat.completions.create(
        model=refusing_server.model_id,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}],
    )
    joined = client.chat.completions.create(
        model=refusing_server.model_id,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": "hello there"}],
    )
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert parts.choices[0].message.content == joined.choices[0].message.content


# -- an aborted batch: an in-process server with a failing engine ---------------


def test_a_batch_aborted_mid_stream_ends_with_an_error_event_and_done(model_dir_factory):
    model_dir = model_dir_factory("llama")
    config = SystemConfig(model_dir=model_dir, demote_idle_s=0, shutdown_timeout_s=60, batch_rows_max=4)
    body = {"prompt": "The cellar keeps", "max_tokens": 40, "temperature": 0}
    with InProcessServer(config, SystemSeams(engine=FailingBatchEngine(model_dir, batches_failing=3))) as server:
        lines = _sse_lines(server.base, "/v1/completions", {**body, "stream": True})
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert "error" in events[-1] and all("error" not in event for event in events[:-1])
        error = events[-1]["error"]
        assert error["type"] == "server_unavailable" and "the batch job failed" in error["message"]
        assert all(event["choices"][0]["finish_reason"] is None for event in events[:-1]), "no finish was claimed"

        client = _client(server.base)
        with pytest.raises(openai.APIError) as streamed:
            for _ in client.chat.completions.create(
                model=model_dir.name,
                max_tokens=40,
                temperature=0,
                stream=True,
                messages=[{"role": "user", "content": "hi"}],
            ):
                pass
        assert "the batch job failed" in streamed.value.message

        with pytest.raises(openai.APIStatusError) as plain:
            client.completions.create(model=model_dir.name, **body)
        assert plain.value.status_code == 503
        assert plain.value.body["type"] == "server_unavailable" and "RuntimeError" in plain.value.body["message"]

        after = client.completions.create(model=model_dir.name, **body)
        assert after.usage.completion_tokens >= 1, "the next batch runs"


# -- completion_tokens: both lanes, in-process, against the journal -------------


async def _generate_counting(system, prompt_ids):
    """Tokens emitted by `system.generate` (closing text is no token) and its done."""
    emitted, done = 0, None
    request = GenerationRequest(prompt_ids=tuple(prompt_ids), params=SamplingParams(temperature=0.0, max_tokens=8))
    async for item in system.generate(request):
        if isinstance(item, GenerationDone):
            done = item
        elif item.token_id >= 0:
            emitted += 1
    return emitted, done


async def _lane(system):
    return system.stats()["scheduler"]["lane"]


async def _journaled_completion_tokens(system):
    return [record.event.completion_tokens for record in system.store.journal.events(kind="request.finished")]


@pytest.mark.parametrize("batch_rows_max", [1, 4], ids=["serial", "batch"])
def test_completion_tokens_count_exactly_the_emitted_tokens(model_dir_factory, tmp_path, batch_rows_max):
    model_dir = model_dir_factory("llama")
    config = SystemConfig(
        model_dir=model_dir, ssd_dir=tmp_path, demote_idle_s=0, shutdown_timeout_s=60, batch_rows_max=batch_rows_max
    )
    with InProcessServer(config) as server:
        lane = server.run(_lane)
        assert lane == ("serial" if batch_rows_max == 1 else "batch")
        client = _client(server.base)
        reply = client.completions.create(model=model_dir.name, prompt="The cellar keeps", max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        chunks = list(
            client.completions.create(
                model=model_dir.name,
                prompt="The cellar keeps",
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
        assert chunks[-1].usage.completion_tokens == 8

        emitted, done = server.run(_generate_counting, range(3, 40))
        assert done.finish_reason == "length" and emitted == done.completion_tokens == 8
        assert server.run(_journaled_completion_tokens) == [8, 8, 8]


# -- tokenization happens off the Trio thread ------------------------------------


def test_rendering_and_tokenizing_run_on_a_worker_thread_not_the_trio_thread(model_dir_factory):
    model_dir = model_dir_factory("llama")
    config = SystemConfig(model_dir=model_dir, demote_idle_s=0, shutdown_timeout_s=60)
    with InProcessServer(config) as server:
        threads: list[str] = []

        async def observe_the_tokenizer(system):
            tokenizer = system.loaded.tokenizer
            render, encode = tokenizer.apply_chat_template, tokenizer.encode

            def observed(work, *args, **kwargs):
                threads.append(threading.current_thread().name)
                return work(*args, **kwargs)

            tokenizer.apply_chat_template = partial(observed, render)
            tokenizer.encode = partial(observed, encode)
            return threading.current_thread().name

        trio_thread = server.run(observe_the_tokenizer)
        client = _client(server.base)
        long_prompt = "many cellars keep many casks " * 3500  # ~100k characters, past the tiny model's context
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=model_dir.name, max_tokens=2, temperature=0, messages=[{"role": "user", "content": long_prompt}]
            )
        assert refused.value.body["param"] == "messages" and "context" in refused.value.body["message"]
        reply = client.chat.completions.create(
            model=model_dir.name, max_tokens=2, temperature=0, messages=[{"role": "user", "content": "a short one"}]
        )
        assert reply.usage.completion_tokens >= 1
        # Each request renders and encodes its prompt, and renders and encodes again
        # for the template probe: however many calls, none on the Trio thread.
        assert len(threads) >= 4 and trio_thread not in threads, (trio_thread, threads)
