"""The playground tests' helpers: Debian's chromium under Playwright, `tformer serve` as a process, and the tiny
checkpoints it serves: a decoder trained to answer with a markdown code block, and a random translator.

Playwright's own browser download needs the internet, so the tests drive the chromium Debian packages (`make test`
installs it when it runs as root). Where it is missing, the tests that need it skip, and pytest's summary says how to
install it; with TFORMER_REQUIRE_BROWSER=1 in the environment (as in CI, `.ci/run`) they fail instead.
TFORMER_CHROMIUM names another chromium binary.

pytest-playwright's `playwright` and `browser` fixtures live for the whole session, and while Playwright's sync API
runs, its event loop is the thread's running loop: a later test's `asyncio.run` would fail. The two fixtures here
replace them per module, so the browser and its loop are gone before the next module starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import free_port
from serve_helpers import CHAT_TEMPLATE, TEXTS

from tformer import ModelConfig, build_model
from tformer.data.tokenizer import Tokenizer

try:
    from playwright.sync_api import Browser, Page, Playwright, sync_playwright
except ImportError as err:  # a clear failure, not a skip
    message = f"{err}: the browser tests need the test extra: pip install -e '.[test]' (or `make setup`)"
    raise ImportError(message) from err

CHROMIUM = Path(os.environ.get("TFORMER_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # no internet here: without these chromium keeps trying to reach its update and sync services
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 20_000  # for any one wait of a test; a page that stalls fails rather than hangs

# ---- the browser -----------------------------------------------------------------------------------------------


def chromium_path() -> Path:
    """Debian's chromium; where it is missing, a skip (a failure under TFORMER_REQUIRE_BROWSER=1) that says how to
    install it."""
    if not CHROMIUM.is_file():
        message = (
            f"{CHROMIUM} is missing: the browser tests drive Debian's chromium package. Install it with "
            "`sudo apt-get install -y chromium` (`make test` does it when run as root), then run the tests again"
        )
        if os.environ.get("TFORMER_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{message} (TFORMER_REQUIRE_BROWSER=1: a missing browser fails)", pytrace=False)
        pytest.skip(message)
    return CHROMIUM


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    """Playwright for one module (it replaces pytest-playwright's session-wide fixture; see the module doc)."""
    chromium_path()
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    """Headless Debian chromium; pytest-playwright's `page` fixture opens a fresh context on it for each test."""
    browser = playwright.chromium.launch(executable_path=str(chromium_path()), headless=True, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def browser_context_args() -> dict:
    """What each test's browser context gets (pytest-playwright's own version needs its session-wide Playwright)."""
    return {"viewport": {"width": 1280, "height": 860}}


def open_page(page: Page, url: str, api_key: str | None = None) -> list[str]:
    """Opens the playground at `url` (with `api_key` already in the browser's local storage, if given); returns the
    list the page's uncaught script errors go to, for the test to check that it stays empty."""
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    if api_key is not None:
        page.add_init_script(f"localStorage.setItem('tformer.apiKey', {json.dumps(api_key)})")
    page.goto(url)
    return errors


def set_input(page: Page, selector: str, value: str | bool) -> None:
    """Sets a range, number or checkbox input as a user would, firing its input and change events."""
    page.locator(selector).evaluate(
        """(el, value) => {
            if (el.type === "checkbox") el.checked = value; else el.value = value;
            el.dispatchEvent(new Event("input", { bubbles: true }));
            el.dispatchEvent(new Event("change", { bubbles: true }));
        }""",
        value,
    )


# ---- `tformer serve` as a process ------------------------------------------------------------------------------


class ServeProcess:
    """`python -m tformer serve --model MODEL [--runs RUNS] ARGS` on a free loopback port; started at once, waited
    for with `ready`."""

    def __init__(self, model: Path | None, args: list[str], log: Path, runs: Path | None = None) -> None:
        self.model, self.runs = model, runs
        args = (["--model", str(model)] if model else []) + (["--runs", str(runs)] if runs else []) + args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # one intra-op thread: a tiny model gains nothing from more, and on a busy 2-core machine threads that wait
        # on each other make each engine step, and so the time an abort waits for the step to end, 10x longer
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as out:
            command = [sys.executable, "-m", "tformer", "serve", "--port", str(self.port), *args]
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def ready(self, timeout: float = 120) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"`tformer serve` exited:\n{self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError(f"`tformer serve` did not come up:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a socket of this machine listens on at `port` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))  # little-endian
    return found


# ---- the checkpoints -------------------------------------------------------------------------------------------

CODE = "class Point:\n    def __init__(self, x):\n        self.x = x"
ANSWER = f"Here is a class:\n\n```python\n{CODE}\n```\n\nThe `__init__` method sets **x**."
CHAT_CONTEXT = 1024


def save_chat_checkpoint(directory: Path) -> Path:
    """A tiny LLaMA-style decoder trained until it answers any chat prompt with ANSWER (a code block, inline code and
    bold), greedily; its context is CHAT_CONTEXT tokens."""
    tokenizer = Tokenizer.train(TEXTS + [ANSWER] * 5, vocab_size=400)
    tokenizer.chat_template = CHAT_TEMPLATE
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "show me a class"}]))
    ids = torch.tensor([prompt + tokenizer.encode(ANSWER) + [tokenizer.eos_id]])  # (1, T)
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny-llama", vocab_size=len(tokenizer), dropout=0.0, max_seq_len=CHAT_CONTEXT)
    model = build_model(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 0.6 s; with 2 threads on a busy 2-core machine, 30 s
    try:
        for _ in range(150):  # the model learns the answer by heart
            logits = model(ids[:, :-1])[0, len(prompt) - 1 :]  # (answer length, vocab)
            loss = torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval().save(directory)
    tokenizer.save(directory)
    return directory


SENTENCE = "And God said, Let there be light: and there was light."
PARALLEL = [
    "In the beginning God created the heaven and the earth.",
    "Im Anfang schuf Gott die Himmel und die Erde.",
    "And God said, Let there be light: and there was light.",
    "Und Gott sprach: Es werde Licht! und es ward Licht.",
] * 5


def save_translator(directory: Path) -> Path:
    """A random tiny encoder-decoder (2 + 2 layers, 4 heads) with a BPE on a few verses; 48-token context."""
    tokenizer = Tokenizer.train(PARALLEL, vocab_size=300)
    vocab = len(tokenizer)
    config = ModelConfig.from_preset(
        "tiny-transformer",
        vocab_size=vocab,
        tgt_vocab_size=vocab,
        max_seq_len=48,
        dropout=0.0,
        attn_dropout=0.0,
        share_embeddings=False,
    )
    torch.manual_seed(2)
    build_model(config).eval().save(directory)
    tokenizer.save(directory)
    return directory


def fenced_code(markdown: str) -> list[str]:
    """The contents of the fenced code blocks of `markdown`, the reference for what the page renders."""
    return re.findall(r"^```[^\n]*\n(.*?)\n```$", markdown, flags=re.S | re.M)
