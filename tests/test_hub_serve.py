"""Several models in one ``localllm serve``, with the ``openai`` client over 127.0.0.1: the
request's ``model`` picks the model (loaded on first use), least-recently-used eviction past
``--max-models``, keep-alive expiry, 404 ``model_not_found``, ``/v1/models``, ``/metrics``,
``/api/ps`` and ``localllm ps``; the manager's memory policy with a loader that runs out.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from cli_helpers import assert_one_line_error, run_cli
from tiny_model import write_tiny_gguf

from localllm.errors import InsufficientMemoryError, ModelNotFoundError
from localllm.server.models import ModelManager, parse_duration

KEY = "k"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """Three tiny models of different weights; a registry naming two of them; a HOME."""
    d = tmp_path_factory.mktemp("serve")
    paths = {n: write_tiny_gguf(d / f"{n}.gguf", "llama", seed=s, context_length=512)
             for s, n in enumerate(("alpha", "beta", "gamma"))}
    registry = d / "models.toml"
    registry.write_text("".join(f'[models.{n}]\npath = "{paths[n]}"\n'
                                for n in ("beta", "gamma")))
    (d / "home").mkdir()
    return {"paths": paths, "registry": registry, "home": d / "home"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, setup: dict, *args: str) -> None:
        self.port = _port()
        env = {k: v for k, v in os.environ.items()
               if k not in ("OLLAMA_MODELS", "LLAMA_CACHE", "HF_HUB_CACHE", "HF_HOME")}
        # HOME without other tools' stores; the user cache dir kept (XDG_CACHE_HOME) where
        # the native CPU kernels are already built, the stores that live there moved away
        from platformdirs import user_cache_dir

        env.update(LOCALLLM_MODELS=str(setup["registry"]), HOME=str(setup["home"]),
                   XDG_CONFIG_HOME=str(setup["home"] / "config"), PYTHONUNBUFFERED="1",
                   XDG_CACHE_HOME=str(Path(user_cache_dir()).expanduser()),
                   HF_HUB_CACHE=str(setup["home"] / "hf"),
                   LLAMA_CACHE=str(setup["home"] / "llama.cpp"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from localllm.cli import main; main()", "serve",
             str(setup["paths"]["alpha"]), "--port", str(self.port), "--device", "cpu",
             "-t", "1", "-c", "256", "--api-key", KEY, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + 300  # a loaded machine
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read().decode())
            try:
                with socket.create_connection(("127.0.0.1", self.port), 1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY,
                             max_retries=0, timeout=120)

    def get(self, path: str) -> str:
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        text = self.get("/metrics")
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert m, text
        return float(m.group(1))

    def ps(self) -> list[dict]:
        return json.loads(self.get("/api/ps"))["models"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt="the and", max_tokens=6,
                                     temperature=0).choices[0].text


@pytest.fixture(scope="module")
def expected(setup) -> dict:
    """The oracle: each model's greedy continuation through the Python API, alone."""
    from localllm import LLM

    out = {}
    for name, path in setup["paths"].items():
        llm = LLM(str(path), device="cpu", ctx_size=256)
        out[name] = llm.create_completion("the and", max_tokens=6, temperature=0)[
            "choices"][0]["text"]
    assert len(set(out.values())) == 3  # the models can be told apart
    return out


def test_two_models_alternating(setup, expected):
    server = Server(setup, "--max-models", "2")
    try:
        client = server.client()
        for _ in range(2):
            assert complete(client, "alpha") == expected["alpha"]  # the file's stem
            assert complete(client, "beta") == expected["beta"]  # a registry name
        assert complete(client, "alpha.gguf") == expected["alpha"]
        chat = client.chat.completions.create(model="beta", max_tokens=2,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.model == "beta"
        assert server.metric("localllm_model_loads_total") == 1  # beta, once
        assert {m["name"] for m in server.ps()} == {"alpha.gguf", "beta"}
        ids = [m.id for m in client.models.list().data]
        assert ids[:2] == ["alpha.gguf", "beta"] and "gamma" in ids  # what can be served
        # an unknown model, and a path (never opened for a client)
        for name in ("nope", str(setup["paths"]["gamma"]), "../gamma"):
            with pytest.raises(openai.NotFoundError) as e:
                complete(client, name)
            assert e.value.code == "model_not_found", name
        assert complete(client, "gamma") == expected["gamma"]  # evicts alpha (least recent)
        assert {m["name"] for m in server.ps()} == {"beta", "gamma"}
        assert server.metric('localllm_model_unloads_total{reason="lru"}') == 1
        assert complete(client, "alpha") == expected["alpha"]  # the started model reloads
        assert server.metric("localllm_model_loads_total") == 3
    finally:
        server.stop()


def test_one_model_at_a_time_and_keep_alive(setup, expected, monkeypatch, capsys):
    server = Server(setup, "--max-models", "1", "--keep-alive", "1s")
    try:
        client = server.client()
        assert complete(client, "beta") == expected["beta"]
        assert [m["name"] for m in server.ps()] == ["beta"]
        assert server.metric('localllm_model_unloads_total{reason="lru"}') == 1
        [row] = server.ps()
        assert row["size"] > 0 and row["expires_at"] is not None and row["device"] == "cpu"
        code, out, err = run_cli(monkeypatch, capsys, "ps", "--port", str(server.port),
                                 "--api-key", KEY)
        assert code == 0, err
        assert out.splitlines()[0].split() == ["NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
        assert out.splitlines()[1].startswith("beta ") and " cpu " in out
        deadline = time.monotonic() + 30
        while server.ps() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.ps() == []  # expired
        assert server.metric('localllm_model_unloads_total{reason="keep_alive"}') == 1
        assert complete(client, "alpha") == expected["alpha"]
        time.sleep(2.5)
        assert [m["name"] for m in server.ps()] == ["alpha.gguf"]  # the started model stays
    finally:
        server.stop()
    code, _, err = run_cli(monkeypatch, capsys, "ps", "--port", str(server.port))
    assert_one_line_error(code, err, "no localllm server")


@pytest.mark.parametrize(("flag", "value", "fragment"), [
    ("--keep-alive", "soon", "--keep-alive"),
    ("--max-models", "0", "--max-models"),
])
def test_bad_serve_flags(setup, monkeypatch, capsys, flag, value, fragment):
    code, _, err = run_cli(monkeypatch, capsys, "serve", str(setup["paths"]["alpha"]), flag,
                           value)
    assert_one_line_error(code, err, fragment)


def test_parse_duration():
    assert [parse_duration(t) for t in ("5m", "30s", "1h", "300", "0", "-1", "1.5m")] == [
        300, 30, 3600, 300, 0, None, 90]
    for bad in ("", "m", "5x", "nan", "inf"):
        with pytest.raises(ValueError):
            parse_duration(bad)


# ---- the manager's policy, with loaders that stand for models --------------------------------
class Stub:
    """What the manager needs of a model: a name, a KV-cache allocation, its memory."""

    def __init__(self, name: str, memory: int) -> None:
        self.model_name, self.memory, self.path = name, memory, Path(f"/{name}.gguf")

    def reserve(self) -> None:
        pass


def test_memory_eviction_and_in_use_models_stay():
    """A loader that refuses past a memory budget counting the models still alive: the
    manager must evict the idle one and drop every reference to it."""
    import weakref

    budget, alive = 10, weakref.WeakValueDictionary()

    def load(name: str) -> Stub:  # what check_memory does when free memory runs out
        if sum(m.memory for m in alive.values()) + 6 > budget:
            raise InsufficientMemoryError(f"{name}: needs 6, {budget} free")
        model = Stub(name, 6)
        alive[name] = model
        return model

    def resolve(name: str) -> str:
        if name not in ("a", "b", "c"):
            raise ModelNotFoundError(name)
        return name

    now = [0.0]
    mm = ModelManager(None, resolve=resolve, loader=load, max_models=3, keep_alive=60,
                      clock=lambda: now[0])
    with mm.use("a"):
        pass
    now[0] = 1
    with mm.use("b"):  # a is idle: evicted for memory, and gone
        assert [m["name"] for m in mm.status()] == ["b"] and list(alive) == ["b"]
        assert mm.unloads["memory"] == 1
        with pytest.raises(InsufficientMemoryError), mm.use("c"):  # b in use: no room
            pass
    with pytest.raises(ModelNotFoundError), mm.use("zzz"):
        pass
    now[0] = 100  # past b's keep-alive
    assert mm.sweep() == 1 and mm.status() == [] and list(alive) == []
