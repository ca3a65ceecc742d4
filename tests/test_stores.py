"""Models other tools downloaded, used where they are: Ollama's store, llama.cpp's cache and
LM Studio's folder, each built by the test in a temporary HOME with the tool's real layout
(manifests, digests, names); split GGUFs from local paths; llama.cpp's tag rule.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli
from tiny_model import write_tiny_gguf

from localllm.errors import GGUFError, ModelNotFoundError
from localllm.stores.select import select


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", "llama").read_bytes()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty HOME; the tools' variables unset; localllm's cache and config inside."""
    for var in ("OLLAMA_MODELS", "LLAMA_CACHE", "HF_HOME", "HF_HUB_CACHE", "LOCALLLM_MODELS",
                "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


# ---- Ollama -------------------------------------------------------------------------------
def ollama_blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def ollama_model(root: Path, name: tuple[str, str, str, str], gguf: bytes, *,
                 params: dict | None = None, system: str | None = None,
                 template: str | None = None, license_: str | None = None) -> Path:
    """A model as `ollama pull` leaves it: blobs by digest, an OCI manifest naming them."""
    layers = [{"mediaType": "application/vnd.ollama.image.model", **ollama_blob(root, gguf)}]
    for kind, text in (("template", template), ("system", system), ("license", license_),
                       ("params", json.dumps(params) if params else None)):
        if text is not None:
            layers.append({"mediaType": f"application/vnd.ollama.image.{kind}",
                           **ollama_blob(root, text.encode())})
    config = ollama_blob(root, json.dumps({"model_format": "gguf"}).encode())
    manifest = {"schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           **config}, "layers": layers}
    path = root / "manifests" / Path(*name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def test_ollama_models_resolve_by_name_with_their_params(home, gguf, monkeypatch, capsys):
    root = home / ".ollama" / "models"
    ollama_model(root, ("registry.ollama.ai", "library", "tiny", "1b"), gguf,
                 params={"temperature": 0.25, "top_k": 7, "stop": ["<end>"], "num_ctx": 64},
                 system="Answer briefly.", template="{{ .Prompt }}", license_="MIT License")
    ollama_model(root, ("hf.co", "org", "Tiny-GGUF", "Q4_K_M"), gguf)
    code, out, err = run_cli(monkeypatch, capsys, "models")
    assert code == 0, err
    assert "ollama:tiny:1b" in out and "ollama:hf.co/org/Tiny-GGUF:Q4_K_M" in out
    code, out, err = run_cli(monkeypatch, capsys, "run", "ollama:tiny:1b", "the", "-n", "3")
    assert code == 0, err
    from localllm import LLM

    llm = LLM("ollama:tiny:1b", device="cpu", ctx_size=64)
    assert llm.model_name == "ollama:tiny:1b"
    params = llm.sampling_params()
    assert (params.temp, params.top_k) == (0.25, 7)  # Ollama's names, llama.cpp's fields
    assert llm.entry.system == "Answer briefly."
    assert llm.path.parent == root / "blobs"  # nothing copied
    code, out, err = run_cli(monkeypatch, capsys, "show", "ollama:tiny:1b")
    assert code == 0, err
    for text in ("architecture        llama", "temp                0.25", "'<end>'",
                 "Answer briefly.", "{{ .Prompt }}", "MIT License"):
        assert text in out, (text, out)
    code, out, _ = run_cli(monkeypatch, capsys, "show", "ollama:tiny:1b", "--license")
    assert out == "MIT License\n"
    # names are matched case-insensitively, as Ollama does; the default tag is latest
    assert run_cli(monkeypatch, capsys, "show", "ollama:HF.CO/org/tiny-gguf:q4_k_m")[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "run", "ollama:tiny", "the")
    assert_one_line_error(code, err, "ollama:tiny:latest is not in Ollama's store")


def test_ollama_respects_ollama_models_and_checks_blobs(home, gguf, tmp_path, monkeypatch,
                                                       capsys):
    root = tmp_path / "elsewhere"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    ollama_model(root, ("registry.ollama.ai", "library", "tiny", "latest"), gguf)
    assert run_cli(monkeypatch, capsys, "run", "ollama:tiny", "the", "-n", "2")[0] == 0
    [blob] = [p for p in (root / "blobs").iterdir() if p.stat().st_size == len(gguf)]
    st = blob.stat()
    data = bytearray(gguf)
    data[-5] ^= 0x10  # a flipped bit, same size and mtime
    blob.write_bytes(bytes(data))
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, _, err = run_cli(monkeypatch, capsys, "run", "ollama:tiny", "the", "-n", "2")
    assert_one_line_error(code, err, "sha256", "ollama pull")
    blob.unlink()
    code, _, err = run_cli(monkeypatch, capsys, "run", "ollama:tiny", "the", "-n", "2")
    assert_one_line_error(code, err, "is missing")


@pytest.mark.parametrize(("name", "fragment"), [
    ("ollama:../passwd", "not a valid part"),
    ("ollama:../../etc/passwd", "not an Ollama model name"),
    ("ollama:a/b/c/d", "not an Ollama model name"),
    ("ollama:tiny:..", "not a valid part"),
    ("ollama:ti\x07ny", "control characters"),
    ("ollama:", "not an Ollama model name"),
])
def test_bad_ollama_names_are_one_line(home, monkeypatch, capsys, name, fragment):
    code, _, err = run_cli(monkeypatch, capsys, "run", name, "the")
    assert_one_line_error(code, err, fragment)


def test_a_corrupt_ollama_manifest_is_one_line(home, gguf, monkeypatch, capsys):
    root = home / ".ollama" / "models"
    path = ollama_model(root, ("registry.ollama.ai", "library", "tiny", "latest"), gguf)
    path.write_text("{not json")
    code, _, err = run_cli(monkeypatch, capsys, "run", "ollama:tiny", "the")
    assert_one_line_error(code, err, "not an Ollama manifest")
    code, out, _ = run_cli(monkeypatch, capsys, "models")  # listing skips it
    assert code == 0 and "ollama:tiny" not in out


# ---- llama.cpp --------------------------------------------------------------------------------
def test_llamacpp_cache_manifests_and_files(home, gguf, monkeypatch, capsys):
    cache = home / ".cache" / "llama.cpp"
    cache.mkdir(parents=True)
    (cache / "org_Tiny-GGUF_Tiny-Q4_K_M.gguf").write_bytes(gguf)
    (cache / "org_Tiny-GGUF_Tiny-Q4_K_M.gguf.etag").write_text(
        f'"{hashlib.sha256(gguf).hexdigest()}"')
    (cache / "manifest=org=Tiny-GGUF=Q4_K_M.json").write_text(json.dumps(
        {"ggufFile": {"rfilename": "Tiny-Q4_K_M.gguf", "size": len(gguf)}}))
    (cache / "loose.gguf").write_bytes(gguf)
    code, out, err = run_cli(monkeypatch, capsys, "models")
    assert code == 0, err
    assert "llamacpp:org/Tiny-GGUF:Q4_K_M" in out and "llamacpp:loose.gguf" in out
    for name in ("llamacpp:org/Tiny-GGUF:Q4_K_M", "llamacpp:loose.gguf"):
        code, _, err = run_cli(monkeypatch, capsys, "run", name, "the", "-n", "2")
        assert code == 0, err
    # the etag is the Hub's sha256: a tampered file is refused
    target = cache / "org_Tiny-GGUF_Tiny-Q4_K_M.gguf"
    target.write_bytes(gguf[:-1] + bytes([gguf[-1] ^ 1]))
    code, _, err = run_cli(monkeypatch, capsys, "run", "llamacpp:org/Tiny-GGUF:Q4_K_M", "the")
    assert_one_line_error(code, err, "sha256")
    code, _, err = run_cli(monkeypatch, capsys, "run", "llamacpp:../x.gguf", "the")
    assert_one_line_error(code, err, "not a plain .gguf file name")


def test_llama_cache_variable_is_respected(home, gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "lc"))
    (tmp_path / "lc").mkdir()
    (tmp_path / "lc" / "m.gguf").write_bytes(gguf)
    assert run_cli(monkeypatch, capsys, "run", "llamacpp:m.gguf", "the", "-n", "2")[0] == 0


# ---- LM Studio --------------------------------------------------------------------------------
def test_lmstudio_models_folder(home, gguf, tmp_path, monkeypatch, capsys):
    folder = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    (folder / "Tiny-Q4_K_M.gguf").write_bytes(gguf)
    (folder / "Tiny-Q8_0.gguf").write_bytes(gguf)
    (folder / "mmproj-Tiny-F16.gguf").write_bytes(gguf)
    code, out, err = run_cli(monkeypatch, capsys, "models")
    assert code == 0, err
    assert "lmstudio:lmstudio-community/Tiny-GGUF:Q4_K_M" in out
    assert "lmstudio:lmstudio-community/Tiny-GGUF:Q8_0" in out and "mmproj" not in out
    code, _, err = run_cli(monkeypatch, capsys, "run", "lmstudio:lmstudio-community/Tiny-GGUF",
                           "the", "-n", "2")
    assert code == 0, err
    # a relocated home (LM Studio's pointer file)
    other = tmp_path / "lms-home"
    (other / "models" / "pub" / "R").mkdir(parents=True)
    (other / "models" / "pub" / "R" / "r-Q8_0.gguf").write_bytes(gguf)
    (home / ".lmstudio-home-pointer").write_text(str(other))
    assert run_cli(monkeypatch, capsys, "run", "lmstudio:pub/R:Q8_0", "the", "-n", "2")[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "run", "lmstudio:pub/../R", "the")
    assert_one_line_error(code, err, "lmstudio:PUBLISHER/REPO")


# ---- split models from local paths --------------------------------------------------------------
def test_a_split_model_opens_from_its_first_part(tmp_path, monkeypatch, capsys):
    first = write_tiny_gguf(tmp_path / "m.gguf", "llama", seed=3, split_max_tensors=6)
    (tmp_path / "whole").mkdir()
    whole = write_tiny_gguf(tmp_path / "whole" / "m.gguf", "llama", seed=3)
    from localllm import LLM
    from localllm.gguf.file import open_gguf

    g = open_gguf(first)
    assert len(g.files) == 4 and g.metadata["split.count"] == 4
    assert set(g.tensors) == set(open_gguf(whole).tensors)
    a, b = LLM(str(first), device="cpu", ctx_size=64), LLM(str(whole), device="cpu", ctx_size=64)
    ids = a.tokenize("the and")
    assert (a.logits(ids) == b.logits(ids)).all()
    second = tmp_path / "m-00002-of-00004.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "run", str(second), "the")
    assert_one_line_error(code, err, "is part 2 of 4", "m-00001-of-00004.gguf")
    second.rename(tmp_path / "aside.gguf")
    with pytest.raises(GGUFError, match="m-00002-of-00004.gguf is missing"):
        open_gguf(first)
    (tmp_path / "aside.gguf").rename(second)
    renamed = tmp_path / "renamed.gguf"
    first.rename(renamed)
    code, _, err = run_cli(monkeypatch, capsys, "run", str(renamed), "the")
    assert_one_line_error(code, err, "must be named PREFIX-00001-of-00004.gguf")


# ---- tag selection (llama.cpp's rule, stricter on ambiguity) -----------------------------------
FILES = ["Model-Q4_K_M.gguf", "Model-Q8_0.gguf", "Model-BF16.gguf", "Model-F16.gguf",
         "mmproj-Model-F16.gguf", "README.md", "big/Model-Q6_K-00001-of-00002.gguf",
         "big/Model-Q6_K-00002-of-00002.gguf", "part/Model-Q5_K_M-00001-of-00002.gguf"]


@pytest.mark.parametrize(("tag", "parts"), [
    (None, ("Model-Q4_K_M.gguf",)),  # the default
    ("q8_0", ("Model-Q8_0.gguf",)),  # case-insensitive
    ("F16", ("Model-F16.gguf",)),  # not BF16, not the projector
    ("Q6_K", ("big/Model-Q6_K-00001-of-00002.gguf", "big/Model-Q6_K-00002-of-00002.gguf")),
    ("model-bf16.gguf", ("Model-BF16.gguf",)),  # a file name
])
def test_tag_selection(tag, parts):
    assert select(FILES, tag, "r").parts == parts


@pytest.mark.parametrize(("files", "tag", "message"), [
    (FILES, "Q5_K_M", "no file for tag"),  # its split is incomplete
    (FILES, "Q2_K", "no file for tag"),
    (["a-7b.Q4_K_M.gguf", "a-13b.Q4_K_M.gguf"], "Q4_K_M", "matches 2 models"),
    (["a.Q5_0.gguf", "b.Q6_K.gguf"], None, "several GGUF models"),
    (["README.md"], None, "no GGUF model"),
])
def test_tag_selection_refusals(files, tag, message):
    with pytest.raises(ModelNotFoundError, match=message):
        select(files, tag, "r")


# ---- create / cp / show / rm ---------------------------------------------------------------------
def test_create_cp_show_rm(home, gguf, tmp_path, monkeypatch, capsys):
    model = tmp_path / "tiny.gguf"
    model.write_bytes(gguf)
    config = tmp_path / "config" / "localllm" / "models.toml"
    config.parent.mkdir(parents=True)
    config.write_text("# my models\n[models.mine]\npath = \"/nowhere.gguf\"  # keep me\n")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    code, out, err = run_cli(monkeypatch, capsys, "create", "helper", "--from", str(model),
                             "--system", 'Say "hi"\nthen stop.', "--temp", "0.3",
                             "--template", str(template))
    assert code == 0, err
    text = config.read_text()
    assert "# my models" in text and "# keep me" in text  # the rest of the file is kept
    from localllm import LLM
    from localllm.registry import load_registry

    entry = load_registry().models["helper"]
    assert entry.system == 'Say "hi"\nthen stop.' and entry.sampling == {"temp": 0.3}
    llm = LLM("helper", device="cpu", ctx_size=64)
    assert llm.model_name == "helper" and llm.sampling_params().temp == 0.3
    reply = llm.create_chat_completion([{"role": "user", "content": "x"}], max_tokens=1)
    assert reply["usage"]["prompt_tokens"] == len(llm.tokenize(
        '<system>Say "hi"\nthen stop.<user>x', add_bos=True, special=True))
    code, out, _ = run_cli(monkeypatch, capsys, "show", "helper", "--system")
    assert out == 'Say "hi"\nthen stop.\n'
    # create again replaces; cp copies the entry
    assert run_cli(monkeypatch, capsys, "create", "helper", "--from", str(model),
                   "--temp", "0.5")[0] == 0
    assert load_registry().models["helper"].sampling == {"temp": 0.5}
    assert run_cli(monkeypatch, capsys, "cp", "helper", "helper2")[0] == 0
    assert load_registry().models["helper2"].base == str(model)
    code, _, err = run_cli(monkeypatch, capsys, "run", "helper2", "the", "-n", "2")
    assert code == 0, err
    assert run_cli(monkeypatch, capsys, "rm", "helper")[0] == 0
    assert "helper" not in load_registry().models and "helper2" in load_registry().models
    assert "# keep me" in config.read_text()


@pytest.mark.parametrize(("args", "fragment"), [
    (("create", "../x", "--from", "gemma3-270m"), "model name"),
    (("create", "a/b", "--from", "gemma3-270m"), "model name"),
    (("create", "x\x1b", "--from", "gemma3-270m"), "model name"),
    (("create", "gemma3-270m", "--from", "gemma3-270m"), "packaged model's name"),
    (("create", "x", "--from", "no-such-model"), "neither a name"),
    (("create", "x", "--from", "MODEL", "--top-p", "2"), "--top-p"),
    (("create", "x", "--from", "MODEL", "--temp", "nan"), "--temp"),
    (("create", "x", "--from", "MODEL", "--template", "TEMPLATE"), "syntax error"),
    (("cp", "no-such-model", "x"), "neither a name"),
    (("create", "x", "--from", "MODEL", "--system", "a\x1b[2Jb"), "control character"),
])
def test_create_and_cp_refusals_are_one_line(home, gguf, tmp_path, monkeypatch, capsys, args,
                                             fragment):
    (tmp_path / "m.gguf").write_bytes(gguf)
    (tmp_path / "bad.jinja").write_text("{% for %}")
    args = [str(tmp_path / "m.gguf") if a == "MODEL" else str(tmp_path / "bad.jinja")
            if a == "TEMPLATE" else a for a in args]
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "config" / "localllm" / "models.toml").exists()


def test_entries_built_from_each_other_in_a_cycle(home, monkeypatch, capsys, tmp_path):
    config = tmp_path / "config" / "localllm" / "models.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[models.a]\nfrom = "b"\n[models.b]\nfrom = "a"\n')
    code, _, err = run_cli(monkeypatch, capsys, "run", "a", "the")
    assert_one_line_error(code, err, "a -> b -> a", "cycle")


def test_a_directory_is_not_a_model(home, tmp_path, monkeypatch, capsys):
    (tmp_path / "org" / "repo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(monkeypatch, capsys, "run", "org/repo", "the")  # not tried on the Hub
    assert_one_line_error(code, err, "org/repo is a directory")
