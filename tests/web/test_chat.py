"""The chat page in Chromium against `tokenfleet serve --auth`: a reply streams token by token; Stop keeps the text
so far, Continue goes on after it, Regenerate gives the greedy reply again; a reload mid-reply shows the text so
far and then the rest, and a cut connection resumes, both ending with exactly the uninterrupted reply; markup in
model output and titles stays text; a wrong key is refused."""

from __future__ import annotations

import re
import time

from tests.web.conftest import (
    LONG,
    PROMPT,
    last_reply,
    reply_text,
    send,
    set_options,
    sign_in,
    wait_status,
    wait_until,
)
from tests.web.proxy import CuttableProxy


def test_a_reply_streams_token_by_token_and_shows_its_tokens_and_ttft(site, context):
    key = site.new_key()
    reference = site.reference_reply()
    page = context.new_page()
    sign_in(page, site.base, key)
    set_options(page, LONG)
    send(page, PROMPT)
    lengths = []
    while last_reply(page).get_attribute("data-status") in ("streaming", "", None):
        lengths.append(len(reply_text(page)))
        time.sleep(0.01)
    wait_status(page, "complete")
    growing = sorted(set(lengths) - {0})
    assert len(growing) >= 5, f"the text arrived in {len(growing)} step(s): {growing}"
    assert reply_text(page) == reference
    stats = last_reply(page).locator(".stats").text_content()
    assert re.fullmatch(r"1,500 tokens · first token \d+(\.\d+)? (ms|s)", stats), stats
    assert last_reply(page).get_attribute("data-saved-differs") is None
    # the conversation is listed under the first message's words, and the model picker shows the model
    page.get_by_role("navigation", name="Conversations").get_by_text(PROMPT).wait_for()
    assert page.get_by_label("Model").input_value() == "tiny"


def test_stop_then_continue_then_regenerate(site, context):
    key = site.new_key()
    reference = site.reference_reply()
    page = context.new_page()
    sign_in(page, site.base, key)
    set_options(page, LONG)
    send(page, PROMPT)
    wait_until(lambda: len(reply_text(page)) > 100, what="some text")
    page.get_by_role("button", name="Stop").click()
    wait_status(page, "stopped")
    stopped = reply_text(page)
    assert 0 < len(stopped) < len(reference) and reference.startswith(stopped)
    assert last_reply(page).locator(".note").text_content() == "Stopped."
    assert page.get_by_role("button", name="Stop").is_hidden()

    page.get_by_label("Max tokens").fill("200")  # the continuation: 200 more tokens
    page.get_by_role("button", name="Continue").click()
    wait_status(page, "complete")
    continued = reply_text(page)
    assert continued.startswith(stopped) and len(continued) > len(stopped)
    assert last_reply(page).locator(".note").text_content() == "Cut off at the token limit."
    saved = site_message(site, key, last_reply(page).get_attribute("data-id"))
    assert saved["content"] == continued and saved["tokens"] > 200  # its tokens before, and 200 more
    assert last_reply(page).locator(".stats").text_content().startswith(f"{saved['tokens']:,} tokens")

    page.get_by_label("Max tokens").fill(str(LONG["max_tokens"]))
    page.get_by_role("button", name="Regenerate").click()
    wait_until(lambda: last_reply(page).get_attribute("data-status") == "streaming", what="the regeneration")
    wait_status(page, "complete")
    assert reply_text(page) == reference  # greedy: the first reply again, from scratch
    assert page.locator("li.message.assistant").count() == 1


def test_reload_mid_reply_shows_the_text_so_far_then_the_rest(site, context):
    key = site.new_key()
    reference = site.reference_reply()
    page = context.new_page()
    sign_in(page, site.base, key)
    set_options(page, LONG)
    send(page, PROMPT)
    wait_until(lambda: len(reply_text(page)) > 200, what="some text")
    page.reload()
    reply = last_reply(page)
    reply.wait_for()
    assert reply.get_attribute("data-status") == "streaming"  # it came back mid-reply ...
    so_far = wait_until(lambda: reply_text(page), what="the text so far")
    assert reference.startswith(so_far) and len(so_far) < len(reference)
    wait_status(page, "complete")
    assert reply_text(page) == reference  # ... and ended with exactly the uninterrupted reply
    assert page.get_by_label("Message").is_enabled()


def test_a_cut_connection_resumes_without_lost_or_repeated_text(site, context):
    key = site.new_key()
    reference = site.reference_reply()
    with CuttableProxy(int(site.base.rsplit(":", 1)[1])) as proxy:
        page = context.new_page()
        sign_in(page, proxy.base, key)
        set_options(page, LONG)
        reconnects = []

        def refuse_first_reconnects(route):  # the first two reconnections fail too, as on a flaky network
            reconnects.append(route.request.headers.get("last-event-id"))
            route.abort("internetdisconnected") if len(reconnects) <= 2 else route.continue_()

        page.route(re.compile(r".*/v1/messages/[^/]+/stream$"), refuse_first_reconnects)
        send(page, PROMPT)
        wait_until(lambda: len(reply_text(page)) > 50, what="some text")
        context.set_offline(True)
        assert proxy.cut() >= 1
        wait_until(lambda: "reconnecting" in (last_reply(page).locator(".note").text_content() or ""), 10, "notice")
        time.sleep(0.3)
        context.set_offline(False)
        wait_status(page, "complete")
        assert reply_text(page) == reference
        assert len(reconnects) >= 3 and all(int(last) > 1 for last in reconnects), reconnects
        assert last_reply(page).locator(".note").text_content() == "Cut off at the token limit."  # not reconnecting


def test_markup_in_model_output_and_titles_stays_text(site, context):
    key = site.new_key()
    page = context.new_page()
    sign_in(page, site.base, key)
    set_options(page, {"max_tokens": 8, "temperature": 0})
    markup = '<img src=x onerror="document.title=\'owned\'"><script>document.title="owned"</script><b>bold</b>'

    def with_markup(route):  # the model's tokens, each with markup around it, as a hostile model could write
        response = route.fetch()
        body = re.sub(r'"type": "token", "text": "', lambda m: m.group(0) + markup.replace('"', '\\"'), response.text())
        route.fulfill(response=response, body=body)

    page.route(re.compile(r".*/v1/conversations/[^/]+/messages$"), with_markup)
    send(page, "Hi")
    wait_status(page, "complete")
    assert markup in reply_text(page)
    page.unroute(re.compile(r".*/v1/conversations/[^/]+/messages$"))

    sidebar = page.get_by_role("navigation", name="Conversations")
    sidebar.get_by_role("button", name=re.compile("^Rename")).first.click()
    sidebar.get_by_label("New title").fill(markup)
    sidebar.get_by_role("button", name="Save").click()
    sidebar.get_by_text(markup).wait_for()
    wait_until(lambda: page.locator("#conversation-title").text_content() == markup, what="the new title")
    page.reload()
    page.get_by_role("navigation", name="Conversations").get_by_text(markup).wait_for()
    assert page.locator("main img, main script, main b, nav img, nav script, nav b").count() == 0
    assert page.title() == "tokenfleet chat"


def test_conversations_can_be_renamed_deleted_and_started_with_a_system_prompt(site, context):
    key = site.new_key()
    page = context.new_page()
    sign_in(page, site.base, key)
    set_options(page, {"max_tokens": 4, "temperature": 0})
    page.get_by_label("System prompt").fill("You are terse.")
    send(page, "First chat")
    wait_status(page, "complete")
    page.locator("summary", has_text="System prompt").click()
    assert page.locator("#system-prompt-text").text_content() == "You are terse."
    page.get_by_role("button", name="New chat").click()
    send(page, "Second chat")
    wait_status(page, "complete")
    sidebar = page.get_by_role("navigation", name="Conversations")
    wait_until(lambda: sidebar.locator("li").count() == 2, what="two conversations")

    sidebar.get_by_role("button", name="Rename First chat").click()
    sidebar.get_by_label("New title").fill("Renamed")
    sidebar.get_by_label("New title").press("Enter")
    sidebar.get_by_role("button", name="Renamed", exact=True).wait_for()
    sidebar.get_by_role("button", name="Delete Second chat").click()
    sidebar.get_by_role("button", name="Delete", exact=True).click()
    wait_until(lambda: sidebar.locator("li").count() == 1, what="one conversation left")
    assert page.locator("#conversation-title").text_content() == "New chat"  # it showed the deleted one

    sidebar.get_by_role("button", name="Renamed", exact=True).click()
    wait_until(lambda: page.locator("li.message").count() == 2, what="its messages")
    assert page.locator("li.message.user .text").text_content() == "First chat"


def test_refusals_are_told_in_words_and_leave_the_conversation_unchanged(site, context):
    key = site.new_key()
    page = context.new_page()
    sign_in(page, site.base, key)
    set_options(page, {"max_tokens": 4, "temperature": 0})
    banner = page.locator("#banner-text")
    cases = [
        ("Tell me something forbidden", "The safety check blocked this message."),
        ("word " * 3000, "This message is too long for the model's context window."),
    ]
    for content, told in cases:
        send(page, content)
        wait_until(lambda told=told: (banner.text_content() or "").startswith(told), 10, told)
        assert page.locator("li.message").count() == 0  # nothing was written
        assert page.get_by_label("Message").input_value() == content  # the draft is back, to edit
        page.get_by_role("button", name="Dismiss").click()

    assert site.admin("POST", "/replicas/drain", json={"replica": "local", "draining": True}).status_code == 200
    try:
        send(page, "Anyone there?")
        wait_until(lambda: (banner.text_content() or "").startswith("No model server is available"), 10, "no replica")
    finally:
        site.admin("POST", "/replicas/drain", json={"replica": "local", "draining": False})
    page.get_by_role("button", name="Send").click()  # the same draft, now that a replica serves again
    wait_status(page, "complete")
    assert page.locator("#banner").is_hidden()


def test_the_page_works_by_keyboard_at_phone_width(site, browser):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    try:
        page = context.new_page()
        page.goto(f"{site.base}/")
        page.get_by_label("API key").focus()
        page.keyboard.type(site.new_key())
        page.keyboard.press("Enter")
        page.get_by_label("Message").wait_for()
        page.get_by_label("Message").focus()
        page.keyboard.type("Hello from a phone")
        page.keyboard.press("Enter")
        wait_status(page, "complete")
        width = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1], f"the page is wider than the screen: {width}"
        for control in ("Message", "Model", "Max tokens", "Temperature", "Ignore end of sequence"):
            assert page.get_by_label(control).count() == 1, f"no control labelled {control!r}"
    finally:
        context.close()


def test_a_wrong_key_is_refused_and_the_page_asks_again(site, context):
    page = context.new_page()
    page.goto(f"{site.base}/chat")
    page.get_by_label("API key").fill("tf-not-a-key")
    page.get_by_role("button", name="Sign in").click()
    page.get_by_text("Your API key was not accepted").wait_for()
    assert page.get_by_label("Message").is_hidden()


def site_message(site, key: str, message_id: str) -> dict:
    import httpx

    response = httpx.get(f"{site.base}/v1/messages/{message_id}", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()
