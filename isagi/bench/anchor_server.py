"""llama.cpp's ``llama-server`` running as ISAGI's engine would run the model: the anchor's process.

Owns starting the anchor (:mod:`isagi.bench.anchor_build`) on ISAGI's model
with ISAGI's engine settings, so that the two servers differ only in what runs
around llama.cpp: the same GGUF, the same threads (for a prompt's batch and for
decoding), the same context per slot and attention kernel (the engine's plain
attention, :data:`isagi.engines.llamacpp.load.FLASH_ATTN`), ``slots`` sequence
slots of continuous batching (``-np``), the GGUF's own chat template rendered
by its Jinja engine (``--jinja``, as ISAGI renders that template), no web UI, on
a free loopback port; then waiting for its ``/health``. Also
:func:`isagi_prompt_text`, the prompt ISAGI's engine renders for a chat, to
check the anchor's (``POST /apply-template``) against it.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from isagi.bench.live_server import free_port
from isagi.errors import AnchorError


@dataclass
class AnchorServer:
    """A running ``llama-server``: its process, URL, log, command line and time to ready."""

    proc: subprocess.Popen
    url: str
    log: Path
    args: list[str]
    ready_s: float = 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def arguments(gguf: Path, *, threads: int, ctx_per_slot: int, slots: int, port: int) -> list[str]:
    """``llama-server``'s arguments for ISAGI's engine settings (the module's docstring)."""
    from isagi.engines.llamacpp.load import FLASH_ATTN

    return [
        "-m", str(gguf),
        "-t", str(threads), "-tb", str(threads),
        # the context of every slot as ISAGI's (one KV stream each; -c is all slots' together)
        "-c", str(ctx_per_slot * slots), "-np", str(slots), "--no-kv-unified",
        "-b", "512", "-ub", "512",
        "-fa", "on" if FLASH_ATTN == 1 else "off",
        "--jinja",
        "--no-webui",
        "--host", "127.0.0.1", "--port", str(port),
    ]


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def start(binary: Path, gguf: Path, *, threads: int, ctx_per_slot: int, slots: int,
          timeout_s: float = 300.0, poll_s: float = 0.2) -> AnchorServer:
    """Spawn ``binary`` on ``gguf`` and wait for its ``/health`` to answer 200; an
    :class:`AnchorError` naming the log when it exits or is not ready in time."""
    port = free_port()
    args = arguments(gguf, threads=threads, ctx_per_slot=ctx_per_slot, slots=slots, port=port)
    log = Path(tempfile.mkstemp(prefix="isagi-anchor-", suffix=".log")[1])
    t0 = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen([str(binary), *args], stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    server = AnchorServer(proc, f"http://127.0.0.1:{port}", log, [binary.name, *args])
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AnchorError(f"llama-server exited with status {proc.returncode} at start; its log: {log}")
        if _health(server.url) == 200:
            server.ready_s = time.monotonic() - t0
            return server
        time.sleep(poll_s)
    server.stop()
    raise AnchorError(f"llama-server was not ready after {timeout_s:.0f} s; its log: {log}")


def applied_template(url: str, messages: list[dict[str, str]]) -> str | None:
    """The prompt llama-server renders for ``messages`` (``POST /apply-template``), None if it cannot say."""
    request = urllib.request.Request(url + "/apply-template", data=json.dumps({"messages": messages}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            prompt = json.loads(r.read()).get("prompt")
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None
    return prompt if isinstance(prompt, str) else None


@dataclass
class ModelFacts:
    """What the bench needs to know of a GGUF: its chat template, its BOS and EOS tokens' text and
    its trained context in tokens (ISAGI's engine caps its context to it)."""

    template: str
    bos: str
    eos: str
    trained_context: int


def model_facts(gguf: Path) -> ModelFacts:
    """:class:`ModelFacts` of ``gguf``, read by llama.cpp from its vocabulary alone (no weights);
    an :class:`AnchorError` when it cannot be read or has no chat template."""
    import ctypes

    import llama_cpp as ll

    from isagi.engines.llamacpp.load import start_backend

    start_backend(ll)
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise AnchorError(f"llama.cpp could not read {gguf}; give a complete .gguf file.")
    try:
        template = ll.llama_model_chat_template(model, None)
        if not template:
            raise AnchorError(f"{gguf} has no chat template; the bench needs a chat model.")
        vocab = ll.llama_model_get_vocab(model)

        def text(token: int) -> str:
            buf = ctypes.create_string_buffer(256)
            n = ll.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
            return buf.raw[:max(n, 0)].decode("utf-8", "replace")

        def meta(key: str) -> str | None:
            """A metadata value (the architecture's own keys: a vocabulary-only load reads no hyperparameters)."""
            buf = ctypes.create_string_buffer(1024)
            if ll.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf)) < 0:
                return None
            name = f"{buf.value.decode()}.{key}".encode()
            return buf.value.decode() if ll.llama_model_meta_val_str(model, name, buf, len(buf)) >= 0 else None

        return ModelFacts(template.decode("utf-8") if isinstance(template, bytes) else str(template),
                          text(ll.llama_vocab_bos(vocab)), text(ll.llama_vocab_eos(vocab)),
                          int(meta("context_length") or 0))
    finally:
        ll.llama_model_free(model)


def isagi_prompt_text(facts: ModelFacts, messages: list[dict[str, str]]) -> str:
    """The prompt text ISAGI's llama.cpp engine renders for ``messages`` (its
    :meth:`~isagi.engines.llamacpp.text.ChatText.chat_text`: the GGUF's template as the engine
    compiles it, with a generation prompt)."""
    from isagi.engines.llamacpp.text import compile_template

    return str(compile_template(facts.template).render(messages=messages, add_generation_prompt=True,
                                                       bos_token=facts.bos, eos_token=facts.eos))
