"""The playground's translate and runs views and its API key, in Debian's chromium against `tformer serve --api-key
KEY --runs DIR` as a process on a tiny translator.

The heat map's cells are compared with the cross-attention weights of an explicit teacher-forced forward of the
same checkpoint on the math backend (not the server's step-by-step replay); the dashboard's points with what
`tformer.viz.plots.read_metrics` reads from the same metrics.jsonl, also while it grows.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import with_config
from playground_helpers import (
    SENTENCE,
    ServeProcess,
    browser,  # noqa: F401 -- fixtures: Debian's chromium, one per module
    browser_context_args,  # noqa: F401
    open_page,
    playwright,  # noqa: F401
    save_translator,
    set_input,
)

from tformer import load
from tformer.data.tokenizer import Tokenizer
from tformer.decoding import translate_ids
from tformer.viz.plots import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "playground-key"
BEAM, ALPHA = 3, 0.8


def loss_records(steps: range, scale: float = 1.0) -> list[dict]:
    return [{"step": s, "loss": scale * 9.0 / (1 + s / 40), "lr": 1e-3 * min(1.0, s / 30), "elapsed": s} for s in steps]


def write_records(path: Path, records: list[dict], tail: str = "") -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


@pytest.fixture(scope="module", autouse=True)
def _views_process(request, tmp_path_factory) -> Iterator[ServeProcess | None]:
    """Starts `tformer serve` with the module (if a selected test needs it), so its start overlaps other work."""
    if not any("views" in item.fixturenames for item in request.session.items):
        yield None
        return
    directory = tmp_path_factory.mktemp("views")
    runs = directory / "runs"
    (runs / "en-de").mkdir(parents=True)
    (runs / "lm" / "small" / "checkpoints").mkdir(parents=True)
    en_de = runs / "en-de" / "metrics.jsonl"
    write_records(en_de, [{"step": 0, "dev_bleu": 0.0, "dev_sentences": 8}, *loss_records(range(10, 51, 10))])
    write_records(en_de, [{"step": 50, "dev_bleu": 4.5, "dev_sentences": 8}])
    write_records(en_de, loss_records(range(40, 51, 10), scale=0.5))  # a resumed run logs 40 and 50 again
    lm = runs / "lm" / "small" / "metrics.jsonl"
    write_records(lm, [*loss_records(range(5, 21, 5)), {"step": 20, "dev_ppl": 812.5, "dev_sentences": 4}])
    os.utime(lm, (time.time() - 600, time.time() - 600))  # ten minutes old: listed second, not running
    model = save_translator(directory / "model")
    server = ServeProcess(model, ["--api-key", KEY, "--kv-cache-mb", "16"], directory / "serve.log", runs=runs)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def views(_views_process) -> ServeProcess:
    return _views_process.ready()


def test_the_page_gets_401_until_the_key_is_entered_then_keeps_it(page, views) -> None:
    answers: list[tuple[str, int]] = []
    page.on("response", lambda r: answers.append((r.url.removeprefix(views.url), r.status)) if "/v1/" in r.url else 0)
    errors = open_page(page, views.url)
    message = page.locator("#key-message")
    message.filter(has_text="401").wait_for()
    assert message.text_content() == (
        "The server wants an API key (401): an API key is required: send the header 'Authorization: Bearer <key>'"
    )
    assert page.locator("#tabs button:visible").count() == 0 and answers == [("/v1/playground", 401)]

    page.fill("#key-input", "not-the-key")
    page.click("#key-save")
    message.filter(has_text="the API key is wrong").wait_for()
    assert page.is_visible("#key-dialog") and answers[-1] == ("/v1/playground", 401)

    page.fill("#key-input", KEY)
    page.click("#key-save")
    page.wait_for_selector("#view-translate")
    assert page.is_hidden("#key-dialog") and answers[-1] == ("/v1/playground", 200)
    assert page.locator("#tabs button:visible").all_text_contents() == ["Translate", "Runs"]
    assert page.evaluate("localStorage.getItem('tformer.apiKey')") == KEY

    answers.clear()
    page.reload()  # entered once: the next visit sends the kept key
    page.wait_for_selector("#view-translate")
    assert answers == [("/v1/playground", 200)] and page.is_hidden("#key-dialog")
    assert not errors


def explicit_attention(model, source_ids: list[int], output_ids: list[int], bos_id: int) -> torch.Tensor:
    """Cross-attention weights (layers, heads, out_len, src_len) of one teacher-forced forward on the math backend."""
    reference = with_config(model, attention_backend="math").eval()
    for block in reference.decoder.layers:
        block.cross_attn.keep_weights = True
    src = torch.tensor([source_ids])
    tgt_in = torch.tensor([[bos_id, *output_ids[:-1]]])
    with torch.no_grad():
        reference(src, tgt_in, torch.ones_like(src), torch.ones_like(tgt_in))
    return torch.stack([block.cross_attn.last_weights[0] for block in reference.decoder.layers])


READ_MAP = """() => ({
    source: [...document.querySelectorAll("table.heatmap th.src")].map((th) => th.dataset.token),
    output: [...document.querySelectorAll("table.heatmap th.out")].map((th) => th.dataset.token),
    cells: [...document.querySelectorAll("table.heatmap tbody tr")].map(
        (tr) => [...tr.querySelectorAll("td.cell")].map((td) => Number(td.dataset.weight))),
    brightest: [...document.querySelectorAll("td.cell")].reduce(
        (a, b) => (Number(a.dataset.weight) >= Number(b.dataset.weight) ? a : b)).style.backgroundColor,
})"""


def test_the_attention_map_shows_the_models_cross_attention_weights(page, views) -> None:
    model, tokenizer = load(views.model).eval(), Tokenizer.load(views.model)
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    source_ids = [*tokenizer.encode(SENTENCE), eos]
    searched = translate_ids(model, [source_ids[:-1]], bos, eos, tokenizer.pad_id, BEAM, ALPHA)[0]
    limit = min(len(source_ids) + 50, model.config.max_seq_len)  # the search's longest output
    output_ids = searched + [eos] if len(searched) < limit else searched  # it ended by choosing </s>
    weights = explicit_attention(model, source_ids, output_ids, bos)  # (L, H, T, S)
    n_layers, n_heads = weights.shape[:2]

    errors = open_page(page, views.url, api_key=KEY)
    page.fill("#source", SENTENCE)
    set_input(page, "#beam-size", str(BEAM))
    set_input(page, "#alpha", str(ALPHA))
    page.click("#translate")
    page.wait_for_selector("table.heatmap")
    assert page.text_content("#translation") == (tokenizer.decode(searched) or "(an empty translation)")
    shown = page.evaluate(READ_MAP)
    labels = [tokenizer.decode([i], skip_special_tokens=False) for i in source_ids + output_ids]
    assert shown["source"] + shown["output"] == labels
    torch.testing.assert_close(
        torch.tensor(shown["cells"], dtype=torch.float64), weights.mean(dim=(0, 1)).double(), atol=1e-5, rtol=0
    )
    assert shown["brightest"] == "rgb(253, 231, 37)"  # the largest weight gets the top of the colour scale

    assert page.locator("#layer option").count() == n_layers + 1 and page.locator("#head option").count() == n_heads + 1
    for layer, head, expected in [
        ("1", "2", weights[1, 2]),
        ("0", "mean", weights[0].mean(dim=0)),
        ("mean", "3", weights[:, 3].mean(dim=0)),
    ]:
        page.select_option("#layer", layer)
        page.select_option("#head", head)
        torch.testing.assert_close(
            torch.tensor(page.evaluate(READ_MAP)["cells"], dtype=torch.float64), expected.double(), atol=1e-5, rtol=0
        )

    error = page.locator("#translate-error")
    page.fill("#source", "   ")
    page.click("#translate")
    assert error.text_content() == "The source sentence is empty: type the sentence to translate."
    too_long = " ".join([SENTENCE] * 4)
    page.fill("#source", too_long)
    page.click("#translate")
    error.filter(has_text="refused").wait_for()
    tokens = len(tokenizer.encode(too_long)) + 1
    assert error.text_content() == (
        f"The server refused the request (400) [input]: the input has {tokens} tokens with </s> but the model "
        f"reads at most {model.config.max_seq_len}; shorten it (or split it into sentences)"
    )
    assert not errors


READ_CHARTS = """() => Object.fromEntries([...document.querySelectorAll("#run-charts svg")].map((svg) => [
    svg.dataset.metric,
    { steps: JSON.parse(svg.dataset.steps), values: JSON.parse(svg.dataset.values),
      vertices: svg.querySelector("polyline").getAttribute("points").split(" ").length },
]))"""


def expected_charts(metrics_file: Path) -> dict[str, dict]:
    """Each chart's points as the project's own reader of metrics.jsonl gives them."""
    charts = {}
    for kind, keys in {"loss": ("loss", "lr"), "dev_bleu": ("dev_bleu",), "dev_ppl": ("dev_ppl",)}.items():
        records = read_metrics(metrics_file)[kind]
        for key in keys if records else ():
            steps, values = [r["step"] for r in records], [r[key] for r in records]
            charts[key] = {"steps": steps, "values": values, "vertices": len(steps)}
    return charts


def test_the_dashboard_draws_each_runs_metrics_and_follows_a_running_one(page, views) -> None:
    runs = views.runs
    en_de = runs / "en-de" / "metrics.jsonl"
    errors = open_page(page, views.url, api_key=KEY)
    page.click("#tabs button[data-view=runs]")
    page.wait_for_selector("#run-charts svg")
    assert page.locator("#run-list button").evaluate_all("bs => bs.map(b => b.dataset.run)") == ["en-de", "lm/small"]
    assert page.locator("#run-list button.active").get_attribute("data-run") == "en-de"
    assert page.evaluate(READ_CHARTS) == expected_charts(en_de)
    assert page.locator("#run-status").text_content().startswith("running: ")

    # the training logs on: two steps and an evaluation, and a line it is still writing
    write_records(en_de, [*loss_records(range(60, 71, 10)), {"step": 70, "dev_bleu": 6.25}], tail='{"step": 80, "lo')
    page.wait_for_function("() => document.querySelector('svg[data-metric=dev_bleu]').dataset.steps.includes('70')")
    shown = page.evaluate(READ_CHARTS)
    assert 80 not in shown["loss"]["steps"]  # half a line waits for the rest
    write_records(en_de, [], tail='ss": 1.5, "lr": 0.001}\n')
    page.wait_for_function("() => document.querySelector('svg[data-metric=loss]').dataset.steps.includes('80')")
    assert page.evaluate(READ_CHARTS) == expected_charts(en_de)
    assert page.text_content("#run-charts .chart[data-metric=loss] h4") == "training loss: 1.5 at step 80"

    page.click("#run-list button[data-run='lm/small']")
    page.wait_for_selector("svg[data-metric=dev_ppl]")
    assert page.evaluate(READ_CHARTS) == expected_charts(runs / "lm" / "small" / "metrics.jsonl")
    assert page.locator("#run-status").text_content().startswith("finished or stopped: ")
    assert not errors
