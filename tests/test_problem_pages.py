"""The pages problem types lead to (service/problem_pages.py): following the ``type`` of any error answer, under a
proxy's path prefix too, reaches a page on the same server that names the problem and says what to do
(RFC 9457 §3.1.1)."""

from __future__ import annotations

import re
from http import HTTPStatus

import pytest
from fastapi.testclient import TestClient

from captioner.models.checkpoint import save_checkpoint
from captioner.service.app import create_app
from captioner.service.errors import PROBLEM_TYPES
from captioner.service.paths import uri_path
from captioner.service.problem_pages import PROBLEM_PAGES

from .serving_helpers import TINY_SPEC, VOCAB, parse_metrics, sent_problem_kinds, serving_settings, tiny_model

KEY = "problem-pages-key-0123456789"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("problem-pages-weights")
    save_checkpoint(root / "tiny", tiny_model("sat"), VOCAB, TINY_SPEC)
    return root


def serve(weights, root_path: str = "") -> TestClient:
    return TestClient(create_app(serving_settings(weights_dir=weights, default_model="tiny",
                                                  default_beam_size=1, default_max_len=4, api_keys=[KEY],
                                                  root_path=root_path)), root_path=root_path)


def test_every_problem_type_the_service_sends_has_a_page_and_no_page_is_for_one_it_never_sends():
    assert set(PROBLEM_PAGES) == sent_problem_kinds()
    for status, kind in PROBLEM_TYPES.values():
        assert PROBLEM_PAGES[kind].status == status, kind


@pytest.mark.parametrize("root_path", ["", "/vision"])
def test_the_type_of_each_answer_leads_to_its_page(weights, root_path):
    """Errors raised by a route, by FastAPI's validation, by Starlette's router and by a middleware (the API key):
    each answer's ``type`` is fetched as a browser following it would, and its page names the kind and status."""
    key = {"Authorization": f"Bearer {KEY}"}
    with serve(weights, root_path) as client:
        answers = [client.post(f"{root_path}/caption", content=b"x"),  # unauthorized
                   client.post(f"{root_path}/caption", content=b"", headers={**key, "content-type": "image/png"}),
                   client.post(f"{root_path}/caption", content=b"x", headers={**key, "content-type": "text/plain"}),
                   client.post(f"{root_path}/caption?beam_size=0", content=b"x",
                               headers={**key, "content-type": "image/png"}),
                   client.post(f"{root_path}/caption?model=nobody", content=b"x",
                               headers={**key, "content-type": "image/png"}),
                   client.get(f"{root_path}/captions/nothing-here", headers=key),
                   client.get(f"{root_path}/nowhere"), client.delete(f"{root_path}/models")]
        kinds = []
        for answer in answers:
            problem = answer.json()
            assert problem["type"].startswith(f"{root_path}/problems/"), problem
            kind = problem["type"].rsplit("/", 1)[1]
            page = client.get(problem["type"])
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), problem
            heading = re.search(r"<h1>(.*)</h1>", page.text).group(1)
            assert heading == f"<code>{kind}</code>: {answer.status_code} {HTTPStatus(answer.status_code).phrase}"
            assert "What to do" in page.text
            kinds.append(kind)
    assert kinds == ["unauthorized", "invalid-image", "unsupported-media-type", "invalid-request", "unknown-model",
                     "unknown-result", "not-found", "method-not-allowed"]


def test_the_index_links_every_page_and_an_unknown_kind_is_a_problem_of_its_own(weights):
    with serve(weights, "/vision") as client:
        index = client.get("/vision/problems")
        links = re.findall(r'href="([^"]+)"', index.text)
        assert links == [f"/vision/problems/{kind}" for kind in PROBLEM_PAGES]
        for link in links:
            page = client.get(link)
            assert page.status_code == 200 and 'href="/vision/problems"' in page.text, link
            # each heading is followed by its own paragraph: what happened, then what to do
            said = dict(re.findall(r"<h2>(.*?)</h2>\n<p>(.*?)</p>", page.text))
            described = PROBLEM_PAGES[link.rsplit("/", 1)[1]]
            assert said == {"What happened": described.meaning, "What to do": described.remedy}, link
            # plain HTML: the API's Content-Security-Policy (no script, no style) applies to it
            assert "<script" not in page.text and "style" not in page.text
            assert page.headers["content-security-policy"].startswith("default-src 'none'")
        missing = client.get("/vision/problems/no-such-kind")
        assert missing.status_code == 404 and missing.json()["type"] == "/vision/problems/not-found"
        assert "no-such-kind" in missing.json()["detail"]


def test_a_problems_instance_is_a_uri_reference_whatever_the_path_held(weights):
    """The instance was the decoded path: ``/captions/ûø£`` is no URI reference (found by the schema fuzzer, once
    the OpenAPI document said ``format: uri-reference``); it is percent-encoded again, ``%`` included."""
    with serve(weights) as client:
        for sent in ("/captions/%C3%BB%C3%B8%C2%A3", "/captions/100%25", "/captions/a%20b",
                     "/captions/a:b@c!$&'()*+,;=d"):  # RFC 3986's sub-delims, ":" and "@" stay as sent
            problem = client.get(sent, headers={"Authorization": f"Bearer {KEY}"}).json()
            assert problem["instance"] == sent and problem["type"] == "/problems/unknown-result"


def test_a_path_is_spelt_as_a_uri_reference_and_in_markup_without_what_html_or_a_script_would_read():
    """``uri_path``: RFC 3986's sub-delims, ":" and "@" stay as they are in a problem's JSON; written into HTML or a
    script's quoted string, "&" (an entity's start) and "'" (the docs page's string delimiter) are encoded too, and
    "%" always (a decoded "%" is data, not an escape)."""
    path = "/a:b@c!$&'()*+,;=d/e f%g\"ûø"
    assert uri_path(path) == "/a:b@c!$&'()*+,;=d/e%20f%25g%22%C3%BB%C3%B8"
    assert uri_path(path, in_markup=True) == "/a:b@c!$%26%27()*+,;=d/e%20f%25g%22%C3%BB%C3%B8"


def test_refusals_are_counted_under_the_kind_their_type_names(weights):
    """``captioner_rejects_total`` counts each refusal under its problem type's kind: the 404 and 405 of Starlette's
    router carry none of their own, and are counted under the kind their status names, as their ``type`` is; a typed
    failure's 404 (a result id that is not stored) under its own kind, or an operator could not tell clients asking
    for expired results from clients asking for paths that never existed."""
    with serve(weights) as client:
        assert client.get("/nowhere").json()["type"] == "/problems/not-found"
        assert client.delete("/models").json()["type"] == "/problems/method-not-allowed"
        expired = client.get("/captions/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
        assert expired.json()["type"] == "/problems/unknown-result"
        samples = parse_metrics(client.get("/metrics").text)
    assert samples['captioner_rejects_total{reason="not-found"}'] == 1, samples
    assert samples['captioner_rejects_total{reason="method-not-allowed"}'] == 1, samples
    assert samples['captioner_rejects_total{reason="unknown-result"}'] == 1, samples


def heading(page) -> str:
    return re.search(r"<h1>(.*)</h1>", page.text).group(1)


def test_the_prefix_is_written_into_pages_and_problems_as_a_client_must_read_it(weights):
    """The prefix comes from the server's configuration, not from this app: one holding ``&`` or ``"`` is escaped
    in the pages' attributes (unescaped, ``"`` ends the attribute and cuts every link short); one spelt with its
    slash (uvicorn ``--root-path /vision/``) is written without it, as the router reads it (``/vision//problems``
    is not the page the type names); and a problem's ``instance`` is the path the client asked for, prefix
    included, so that it resolves to that request's URL behind the proxy. No lifespan: no model is needed."""
    app = create_app(serving_settings(weights_dir=weights, default_model="tiny", api_keys=[KEY]))
    odd = '/r&d"x'
    client = TestClient(app, root_path=odd)
    encoded = "/r%26d%22x"  # in HTML: a URI's spelling, with nothing HTML or a script's quoted string would read
    links = re.findall(r'href="([^"]*)"', client.get(f"{odd}/problems").text)
    assert links == [f"{encoded}/problems/{kind}" for kind in PROBLEM_PAGES]
    assert client.get(links[0]).status_code == 200  # the server decodes it to the prefix
    page = client.get(f"{odd}/problems/not-found")
    assert page.status_code == 200 and re.search(r'href="([^"]*)"', page.text).group(1) == f"{encoded}/problems"
    # and in a problem, whose type and instance are URI references (the OpenAPI document says so): percent-encoded
    missing = client.get(f"{odd}/nowhere").json()
    assert missing["type"] == "/r&d%22x/problems/not-found" and missing["instance"] == "/r&d%22x/nowhere"
    assert client.get(missing["type"]).status_code == 200
    # the docs page, whose addresses FastAPI writes into attributes and a script's quoted string as it is given them
    docs = client.get(f"{odd}/docs").text
    assert f"url: '{encoded}/openapi.json'" in docs and f'href="{encoded}/docs/assets/swagger-ui.css"' in docs
    assert client.get(f"{encoded}/openapi.json").status_code == 200
    assert client.get(f"{encoded}/docs/assets/swagger-ui.css").status_code == 200
    # a "'" (which the settings accept too) would end that quoted string, and a "%" start an escape
    quoted = TestClient(app, root_path="/o'k%")
    assert "url: '/o%27k%25/openapi.json'" in quoted.get("/o'k%25/docs").text

    slashed = TestClient(app, root_path="/vision/")  # uvicorn joins it and the path: /vision//problems
    assert re.findall(r'href="([^"]*)"', slashed.get("/vision//problems").text)[0] == "/vision/problems/invalid-image"
    assert 'href="/vision/problems"' in slashed.get("/vision//problems/not-found").text
    assert slashed.get("/vision//nowhere").json()["type"] == "/vision/problems/not-found"

    missing = TestClient(app, root_path="/vision").get("/vision/nowhere").json()
    assert missing["type"] == "/vision/problems/not-found" and missing["instance"] == "/vision/nowhere"


def test_the_page_of_each_problem_names_the_status_it_is_sent_with(weights):
    """The problems no route raises, each answered by its own handler: a refused CORS pre-flight (400) and an
    unexpected error (500).  Their pages' status comes from the table, not from the code that sends them."""
    app = create_app(serving_settings(weights_dir=weights, default_model="tiny",
                                      cors_origins=["https://allowed.example"]))

    async def broken():
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken)
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: neither answer needs a model
    refused = client.options("/caption", headers={"Origin": "https://elsewhere.example",
                                                  "Access-Control-Request-Method": "POST"})
    for answer, kind in ((refused, "cors-refused"), (client.get("/broken"), "internal")):
        assert answer.json()["type"] == f"/problems/{kind}", answer.text
        page = client.get(answer.json()["type"])
        assert heading(page) == f"<code>{kind}</code>: {answer.status_code} {HTTPStatus(answer.status_code).phrase}"


def test_each_page_is_a_whole_document_titled_as_its_heading(weights):
    """A browser names the tab after the ``<title>`` and shows only what follows ``<body>``: a page whose head was
    left open shows blank, all its text read as the title."""
    document = re.compile(r'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>([^<]*)</title>'
                          r"</head>\n<body>\n<h1>(.*?)</h1>\n.*\n</body></html>\n", re.DOTALL)
    with serve(weights) as client:
        index = document.fullmatch(client.get("/problems").text)
        assert index is not None and index.groups() == ("Problem types", "Problem types")
        for kind, described in PROBLEM_PAGES.items():
            page = document.fullmatch(client.get(f"/problems/{kind}").text)
            assert page is not None, kind
            title, heading_html = page.groups()
            assert title.startswith(f"{kind}: {described.status} "), title
            assert heading_html.replace("<code>", "").replace("</code>", "") == title, kind


def test_the_client_gone_page_names_its_status_as_nginx_does(weights):
    """499 is no status Python's HTTPStatus knows: its page gives nginx's name for it, "Client Closed Request", the
    title the service's logs and metrics count it under. No lifespan: no model is needed."""
    page = serve(weights).get("/problems/client-gone")
    assert page.status_code == 200 and heading(page) == "<code>client-gone</code>: 499 Client Closed Request"


def test_the_index_names_the_status_each_type_is_sent_with_beside_its_link(weights):
    """``GET /problems`` is where a reader scans every problem type at once: each row says the status it comes
    with (``413 Content Too Large``), nginx's 499 under its own title, so telling a client's fault from a server's
    needs no click. No lifespan: no model is needed."""
    client = TestClient(create_app(serving_settings(weights_dir=weights, default_model="tiny", api_keys=[KEY])))
    rows = re.findall(r'<li><a href="/problems/([^"]+)"><code>\1</code></a>: (.*)</li>', client.get("/problems").text)
    titles = {kind: "Client Closed Request" if page.status == 499 else HTTPStatus(page.status).phrase
              for kind, page in PROBLEM_PAGES.items()}
    assert rows == [(kind, f"{page.status} {titles[kind]}") for kind, page in PROBLEM_PAGES.items()]
