"""The chat page at `/` (baton/server/page.py, baton/server/static/) in headless Chromium, Debian's
`chromium` driven by Playwright pointed at that executable (nothing downloads a browser), against
a real `baton serve --api-key`: a wrong key is refused, a reply streams in and equals the API's
greedy answer, Stop aborts the request on the server (no blocks held), Regenerate replaces the
reply, reasoning shows apart, and the settings reach the request. A screenshot is left in pytest's
temporary directory (or $BATON_TEST_ARTIFACTS), never in the repository."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import requests

from tests.server_util import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium executable (make install installs Debian's)")
KEY = "page-test-key"
ASSISTANT = ".msg.assistant:last-child"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--api-key", KEY)
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1000, "height": 700})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.base_url}/")
    yield page
    context.close()
    assert not errors, errors  # no script error on the page


def expect(locator):
    from playwright.sync_api import expect

    return expect(locator)


def _connect(page, key: str = KEY) -> None:
    page.click("#toggle-settings")
    page.fill("#api-key", key)
    page.dispatch_event("#api-key", "change")


def _ask(page, text: str, temperature: str, max_tokens: str) -> None:
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _metric(server, name: str) -> float:
    try:
        return server.metric(name)
    except KeyError:
        return 0.0


def _artefacts(tmp_path_factory) -> Path:
    where = os.environ.get("BATON_TEST_ARTIFACTS")
    path = Path(where) if where else tmp_path_factory.mktemp("artefacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_the_page_is_served_from_the_package_with_a_strict_policy(server):
    r = requests.get(f"{server.base_url}/", timeout=10)  # public, as llama-server's: the API behind it is keyed
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    policy = r.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy
    assert "//" not in r.text.replace("<!doctype html>", "")  # no CDN: every file is this server's
    assert (
        requests.get(f"{server.base_url}/static/chat.js", timeout=10)
        .headers["content-type"]
        .startswith("text/javascript")
    )
    for name in ("..%2Fapp.py", "../page.py", "secret", "index.html"):
        assert requests.get(f"{server.base_url}/static/{name}", timeout=10).status_code == 404
    assert requests.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401


def test_a_wrong_key_is_refused_then_the_reply_streams_as_the_api_answers(page, server, tmp_path_factory):
    expect(page.locator("#notice")).to_contain_text("API key")
    assert page.text_content("#model") == "(not connected)"
    _connect(page, "wrong-key")
    _ask(page, "Hello", "0", "8")
    page.wait_for_selector(f'{ASSISTANT}[data-status="error"]')
    assert "invalid or missing API key" in page.text_content(f"{ASSISTANT} .content")
    _connect(page)
    expect(page.locator("#model")).to_have_text("smollm2-135m")
    page.click("#new-chat")
    # every text the reply shows on its way, to see that it streams in
    page.evaluate(
        """() => { window.seen = [];
        new MutationObserver(() => { const c = document.querySelector('.msg.assistant:last-child .content');
          if (c) window.seen.push(c.textContent); })
        .observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true}); }"""
    )
    question = "What is the capital of France?"
    _ask(page, question, "0", "32")
    page.wait_for_selector(f'{ASSISTANT}[data-status="done"]', timeout=60_000)
    reply = page.text_content(f"{ASSISTANT} .content")
    seen = [t for t in dict.fromkeys(page.evaluate("window.seen")) if t]
    assert len(seen) >= 3 and all(reply.startswith(t) for t in seen), seen  # grew in steps to the reply
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": question}]}
    body |= {"temperature": 0, "max_tokens": 32}
    api = requests.post(
        f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ).json()
    assert reply == api["choices"][0]["message"]["content"]  # the same greedy reply the API gives
    assert "tokens" in page.text_content(f"{ASSISTANT} .meta")
    # Regenerate: the reply replaced, not added to
    page.click(f"{ASSISTANT} .regenerate")
    page.wait_for_selector(f'{ASSISTANT}[data-status="done"]', timeout=60_000)
    assert page.locator(".msg").count() == 2 and page.text_content(f"{ASSISTANT} .content") == reply
    shot = _artefacts(tmp_path_factory) / "chat_page.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")


def test_stop_aborts_the_request_on_the_server(page, server):
    _connect(page)
    expect(page.locator("#model")).to_have_text("smollm2-135m")
    aborted = _metric(server, 'baton_requests_total{outcome="abort"}')
    _ask(page, "Tell me a very long story about a dragon and a knight.", "0.8", "4000")
    long = f"() => document.querySelector('{ASSISTANT} .content')?.textContent.length > 40"
    page.wait_for_function(long, timeout=60_000)
    assert server.metric("baton_num_requests_running") == 1
    page.click("#stop")
    page.wait_for_selector(f'{ASSISTANT}[data-status="stopped"]')
    assert "stopped" in page.text_content(f"{ASSISTANT} .meta")
    deadline = time.time() + 15
    while time.time() < deadline:
        if server.metric("baton_num_requests_running") == 0 and server.metric("baton_kv_blocks_used") == 0:
            break
        time.sleep(0.2)
    assert server.metric("baton_num_requests_running") == 0 and server.metric("baton_kv_blocks_used") == 0
    assert _metric(server, 'baton_requests_total{outcome="abort"}') == aborted + 1
    assert page.is_visible("#send") and not page.is_visible("#stop")


def test_reasoning_shows_apart_and_the_settings_reach_the_request(page, server):
    sent = []
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "", "reasoning_content": "Two and two "}}]},
        {"choices": [{"index": 0, "delta": {"content": "", "reasoning_content": "make four."}}]},
        {"choices": [{"index": 0, "delta": {"content": "It is 4."}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}},
    ]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def answer(route):  # the model does not think; this stream does, as a reasoning parser sends it
        sent.append(route.request.post_data_json)
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=stream)

    page.route("**/v1/chat/completions", answer)
    _connect(page)
    page.fill("#system", "You are terse.")
    page.dispatch_event("#system", "change")
    _ask(page, "What is 2 + 2?", "0.3", "77")
    page.wait_for_selector(f'{ASSISTANT}[data-status="done"]')
    assert page.text_content(f"{ASSISTANT} .reasoning pre") == "Two and two make four."
    assert page.text_content(f"{ASSISTANT} .content") == "It is 4."
    assert "7 tokens" in page.text_content(f"{ASSISTANT} .meta")
    (body,) = sent
    assert body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    assert (body["temperature"], body["max_tokens"], body["stream"], body["model"]) == (0.3, 77, True, "smollm2-135m")
    # the settings outlive a reload (kept in the browser, the key typed once)
    page.reload()
    expect(page.locator("#model")).to_have_text("smollm2-135m")
    assert page.input_value("#system") == "You are terse."
