"""Hugging Face repositories: ``localllm pull hf.co/ORG/REPO[:TAG]`` and ``run ORG/REPO:TAG``
(llama.cpp's ``-hf``), through the ``huggingface_hub`` client.

The quant tag picks the file as llama.cpp does (:mod:`.select`); every part of a split model
is fetched. Files go to the standard Hugging Face cache (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``: the layout of ``models--ORG--REPO/``
with ``blobs/``, ``snapshots/COMMIT/`` and ``refs/main``), so a file pulled once is shared
with transformers, llama.cpp (which now keeps its ``-hf`` downloads there too), mlx-lm and
the other tools of that cache. ``hf_hub_download`` does the transfer: an etag-keyed cache,
retries that resume a cut connection with a ``Range`` request, Xet storage where the Hub uses
it, a lock per blob against concurrent pulls, and a temporary file renamed into place (an
interrupted pull leaves nothing under the final name). ``HF_ENDPOINT``, ``HF_TOKEN`` and
``HF_HUB_OFFLINE`` are read when a pull starts.

Each file is then checked against the Hub's metadata: the sha256 of its LFS pointer (the
git blob sha1 for a small non-LFS file). The check is remembered as a stamp
(:mod:`.integrity`) in localllm's cache, with the repository's listing, so a later ``run``
uses the cached files without the network and picks the same file the Hub would; a file
changed since is hashed again and refused if it no longer matches. A snapshot entry whose
link leaves the repository's ``blobs/`` folder is refused.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptModelError, LocalLLMError, ModelNotFoundError, ParameterError, PullError
from . import LocalModel, dir_size
from .integrity import read_record, record_for, transfer_bars, verify_file, write_record
from .select import check_relative, check_text, models_in, name_for, select

PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")
DEFAULT_ENDPOINT = "https://huggingface.co"
# llama.cpp's is_valid_repo_id: [A-Za-z0-9_] runs joined by single '.', '-'; one '/'.
_PART = r"[A-Za-z0-9_]+(?:[.-][A-Za-z0-9_]+)*"
_REPO = re.compile(rf"{_PART}/{_PART}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_FILES = 100_000  # entries of one repository listing or snapshot walk
STORE = "Hugging Face"


@dataclass(frozen=True)
class HFRef:
    """A repository (``ORG/REPO``) and an optional tag (quant tag or file path)."""

    repo: str
    tag: str | None = None

    @property
    def where(self) -> str:
        return f"hf.co/{self.repo}"

    @property
    def name(self) -> str:
        return self.where + (f":{self.tag}" if self.tag else "")


# ---- names --------------------------------------------------------------------------------
def looks_like(text: str) -> bool:
    """True for ``hf.co/...`` / ``huggingface.co/...`` names and for a bare ``ORG/REPO[:TAG]``
    (checked by the caller not to be an existing file)."""
    if text.startswith(PREFIXES):
        return True
    repo = text.split(":", 1)[0]
    return bool(_REPO.fullmatch(repo)) and not text.lower().endswith(".gguf")


def parse(text: str) -> HFRef:
    """``[hf.co/]ORG/REPO[:TAG]`` -> :class:`HFRef`.

    Raises:
        ParameterError: not a valid repository id (llama.cpp's rule: letters, digits and
            ``_`` joined by single ``.`` or ``-``, one ``/``, at most 96 characters per part)
            or a malformed tag (``..``, ``/`` where not a file path, control characters).
    """
    check_text(text)
    for prefix in PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    repo, _, tag = text.partition(":")
    repo = repo.rstrip("/")
    if not _REPO.fullmatch(repo) or any(len(p) > 96 for p in repo.split("/")):
        raise ParameterError(f"{repo!r} is not a Hugging Face repository id (ORG/REPO: letters, "
                             "digits and _ joined by single '.' or '-')")
    if not tag:
        return HFRef(repo)
    if tag.lower().endswith(".gguf"):
        check_relative(tag, "file name")
    elif not _TAG.fullmatch(tag) or ".." in tag:
        raise ParameterError(f"{tag!r} is not a quant tag (Q4_K_M, Q8_0 ...) or a .gguf file name")
    return HFRef(repo, tag)


# ---- environment ----------------------------------------------------------------------------
def endpoint() -> str:
    """``$HF_ENDPOINT`` or https://huggingface.co (read at each call)."""
    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or DEFAULT_ENDPOINT


def hub_cache() -> Path:
    """The Hugging Face cache, resolved as huggingface_hub does (at each call)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def offline() -> bool:
    """``$HF_HUB_OFFLINE`` set to a true value (1, ON, YES, TRUE)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None  # None: the token `hf auth login` stored


def repo_dir(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


# ---- what the cache holds -------------------------------------------------------------------
def _listing_record(repo: str) -> Path:
    from ..paths import cache_dir

    return cache_dir() / "huggingface" / f"models--{repo.replace('/', '--')}.json"


def _remembered(repo: str, commit: str) -> dict | None:
    """The Hub's listing of ``repo`` at ``commit`` saved by the last pull: path -> {size,
    sha256, blob_id}."""
    data = read_record(_listing_record(repo), limit=64 << 20)
    if not data or data.get("commit") != commit or not isinstance(data.get("files"), dict):
        return None
    return data["files"]


def _cached_commit(repo: str) -> str | None:
    try:
        with open(repo_dir(repo) / "refs" / "main", encoding="ascii") as f:
            commit = f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if _COMMIT.fullmatch(commit) else None


def _snapshot_files(snapshot: Path) -> list[str]:
    out: list[str] = []
    for root, dirs, files in os.walk(snapshot):
        rel = Path(root).relative_to(snapshot)
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
        out += [(rel / f).as_posix() for f in files]
        if len(out) > _MAX_FILES:
            break
    return out


def _blob_of(repo: str, snapshot_file: Path) -> Path:
    """The blob behind a snapshot entry: the link's target, which must be a file in the
    repository's ``blobs/``; a regular file stands for itself (a cache written without
    symlinks).

    Raises:
        CorruptModelError: a link that leaves ``blobs/`` or dangles.
    """
    if not snapshot_file.is_symlink():
        return snapshot_file
    blobs = (repo_dir(repo) / "blobs").resolve()
    target = snapshot_file.resolve()
    if target.parent != blobs:
        raise CorruptModelError(f"{snapshot_file} links outside the cache's blobs folder "
                                f"({target}): remove it, then pull again")
    return target


def _verify_part(repo: str, path: Path, meta: dict | None, fix: str) -> None:
    """Check one cached file against the Hub's sha256 (``meta``) or, without a listing,
    against the digest its blob is named by."""
    blob = _blob_of(repo, path)
    digest, algorithm, git_blob = None, "sha256", False
    if meta and meta.get("sha256"):
        digest = meta["sha256"]
    elif meta and meta.get("blob_id"):
        digest, algorithm, git_blob = meta["blob_id"], "sha1", True
    elif _SHA256.fullmatch(blob.name):  # an LFS blob is named by its sha256
        digest = blob.name
    elif _COMMIT.fullmatch(blob.name):  # a small file's blob by its git blob sha1
        digest, algorithm, git_blob = blob.name, "sha1", True
    if meta and meta.get("size") is not None:
        try:
            size = blob.stat().st_size
        except OSError:
            raise CorruptModelError(f"{path}: its blob is missing: {fix}") from None
        if size != meta["size"]:
            raise CorruptModelError(f"{path} has {size} bytes, the Hub's file {meta['size']}: "
                                    f"{fix}")
    if digest is None:
        return  # nothing to check against: a file another tool wrote without a known hash
    from ..paths import cache_dir

    try:
        verify_file(blob, digest=digest, record=record_for(cache_dir(), blob, digest), fix=fix,
                    algorithm=algorithm, git_blob=git_blob, label=f"verify {path.name}")
    except FileNotFoundError:
        raise CorruptModelError(f"{path}: its blob is missing: {fix}") from None


def cached(ref: HFRef) -> LocalModel | None:
    """The model ``ref`` names if the cache holds all its files (checked: see the module
    docstring), else None.

    Raises:
        CorruptModelError: a cached file fails its check.
    """
    commit = _cached_commit(ref.repo)
    if commit is None:
        return None
    snapshot = repo_dir(ref.repo) / "snapshots" / commit
    listing = _remembered(ref.repo, commit)
    files = list(listing) if listing is not None else _snapshot_files(snapshot)
    try:
        model = select(files, ref.tag, ref.where)
    except ModelNotFoundError:
        return None  # not cached (or ambiguous): the Hub's listing decides, and says why
    parts = tuple(snapshot / p for p in model.parts)
    if not all(p.exists() for p in parts):
        return None
    fix = f"run `localllm pull {ref.name}` to fetch it again"
    for rel, p in zip(model.parts, parts, strict=True):
        _verify_part(ref.repo, p, (listing or {}).get(rel), fix)
    return LocalModel(name_for(ref.where, model, files), parts, dir_size(parts), STORE)


def list_models() -> list[LocalModel]:
    """The GGUF models in the Hugging Face cache (no hashing, no network)."""
    root = hub_cache()
    try:
        dirs = sorted(d for d in root.iterdir() if d.name.startswith("models--"))
    except OSError:
        return []
    out = []
    for d in dirs:
        repo = d.name[len("models--"):].replace("--", "/")
        if not _REPO.fullmatch(repo):
            continue
        commit = _cached_commit(repo)
        if commit is None:
            continue
        snapshot = d / "snapshots" / commit
        try:
            present = _snapshot_files(snapshot)
        except OSError:
            continue
        listing = _remembered(repo, commit)
        names = list(listing) if listing is not None else present
        have = set(present)
        for model in models_in(present):
            if all(p in have for p in model.parts):
                parts = tuple(snapshot / p for p in model.parts)
                out.append(LocalModel(name_for(f"hf.co/{repo}", model, names), parts,
                                      dir_size(parts), STORE))
    return out


# ---- pulling ----------------------------------------------------------------------------------
def resolve(text: str, *, pull: bool = True, progress: bool = True) -> LocalModel:
    """The cached model ``text`` names, pulled first when it is not cached.

    Raises:
        ParameterError: a malformed name.
        ModelNotFoundError: not cached and ``pull`` is False.
        PullError: not cached and the pull fails (offline, no such repository or tag ...).
        CorruptModelError: a cached file fails its check.
    """
    ref = parse(text)
    found = cached(ref)
    if found is not None:
        return found
    if not pull:
        raise ModelNotFoundError(f"{ref.name} is not in the Hugging Face cache ({hub_cache()})")
    if offline():
        raise PullError(f"{ref.name} is not in the Hugging Face cache ({hub_cache()}) and "
                        "HF_HUB_OFFLINE is set")
    print(f"pulling {ref.name} from {endpoint()} into {hub_cache()}", file=sys.stderr,
          flush=True)
    return pull_model(ref, progress=progress)


def pull_model(ref: HFRef, *, force: bool = False, progress: bool = True) -> LocalModel:
    """Fetch the model ``ref`` names into the Hugging Face cache, check every part's sha256
    against the Hub's LFS metadata, and return it.

    A cached file that fails its check is fetched again; ``force`` fetches every part again.
    Offline (``HF_HUB_OFFLINE``) only the cache is looked at.

    Raises:
        PullError: no such repository, branch, tag or file; a private or gated repository
            without a token that gives access; the Hub unreachable; a download whose sha256
            differs from the Hub's (nothing is kept under its name); several files match.
        LocalLLMError: the cache directory is not writable or is full.
    """
    if offline():
        found = cached(ref)
        if found is None:
            raise PullError(f"{ref.name} is not in the Hugging Face cache ({hub_cache()}) "
                            "and HF_HUB_OFFLINE is set")
        return found
    with _quiet_client():
        return _pull(ref, force, progress)


_quiet = {"depth": 0, "level": logging.NOTSET}
_quiet_lock = threading.Lock()


@contextmanager
def _quiet_client():
    """huggingface_hub's warnings (a retried chunk, a tree cache it could not write) stay
    off stderr while it works for us: the outcome is one line, or the model. (Pulls in
    several threads share it: the first in sets the level, the last out restores it.)"""
    import huggingface_hub.file_download
    import huggingface_hub.hf_api  # noqa: F401 - configures its loggers on first import

    logger = logging.getLogger("huggingface_hub")
    with _quiet_lock:
        if _quiet["depth"] == 0:
            _quiet["level"] = logger.level
            logger.setLevel(logging.ERROR)
        _quiet["depth"] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet["depth"] -= 1
            if _quiet["depth"] == 0:
                logger.setLevel(_quiet["level"])


def _pull(ref: HFRef, force: bool, progress: bool) -> LocalModel:
    info = _model_info(ref)
    files = {}
    for s in (info.siblings or [])[:_MAX_FILES]:
        lfs = s.lfs
        files[s.rfilename] = {"size": lfs.size if lfs else s.size,
                              "sha256": str(lfs.sha256).lower() if lfs else None,
                              "blob_id": s.blob_id}
    commit = str(info.sha or "")
    if not _COMMIT.fullmatch(commit):
        raise PullError(f"{endpoint()} gave no commit for {ref.where}")
    try:
        model = select(list(files), ref.tag, ref.where)
    except ModelNotFoundError as e:
        raise PullError(str(e)) from None
    for rel in model.parts:
        check_relative(rel, "file name the Hub lists")
    write_record(_listing_record(ref.repo), {"commit": commit, "files": files})
    snapshot = repo_dir(ref.repo) / "snapshots" / commit
    with transfer_bars(show=progress) as bars:
        for rel in model.parts:
            _fetch(ref, commit, rel, files[rel], force=force, bars=bars)
    _write_ref(ref.repo, commit)
    parts = tuple(snapshot / p for p in model.parts)
    return LocalModel(name_for(ref.where, model, list(files)), parts, dir_size(parts), STORE)


def _model_info(ref: HFRef):
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=endpoint(), token=_token()).model_info(
            ref.repo, revision="main", files_metadata=True)
    except Exception as e:  # noqa: BLE001 - the client's errors (HTTP, network) become one line
        raise _hub_error(e, ref) from None


def _fetch(ref: HFRef, commit: str, rel: str, meta: dict, *, force: bool, bars) -> Path:
    """Download one file (unless cached and intact) and check it; returns its snapshot path."""
    from huggingface_hub import hf_hub_download

    snapshot_file = repo_dir(ref.repo) / "snapshots" / commit / rel
    fix = f"run `localllm pull {ref.name}` to fetch it again"
    was_cached = snapshot_file.exists() and not force
    if was_cached:
        try:
            _verify_part(ref.repo, snapshot_file, meta, fix)
            return snapshot_file
        except CorruptModelError:
            _remove_entry(ref.repo, snapshot_file)
    etag = meta.get("sha256") or meta.get("blob_id")
    if etag:
        _remove_stale_incomplete(ref.repo, etag)
    try:
        path = Path(hf_hub_download(
            ref.repo, rel, revision=commit, cache_dir=str(hub_cache()), endpoint=endpoint(),
            token=_token(), force_download=force or was_cached,
            tqdm_class=_rich_tqdm(bars, rel.rsplit("/", 1)[-1])))
    except Exception as e:  # noqa: BLE001 - the client's errors (HTTP, network, disk) become one line
        raise _hub_error(e, ref, rel) from None
    try:
        _verify_part(ref.repo, path, meta, fix)
    except CorruptModelError:
        _remove_entry(ref.repo, path)
        digest = meta.get("sha256") or meta.get("blob_id")
        raise PullError(f"{ref.where}: the download of {rel} does not match the Hub's "
                        f"{'sha256' if meta.get('sha256') else 'git blob sha1'} {digest}: "
                        "removed; pull again") from None
    return path


def _remove_entry(repo: str, snapshot_file: Path) -> None:
    """Remove a bad file: its snapshot entry and the blob behind it (if in ``blobs/``)."""
    try:
        blob = _blob_of(repo, snapshot_file)
    except CorruptModelError:
        blob = None
    for p in (snapshot_file, blob):
        if p is not None:
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass


def _remove_stale_incomplete(repo: str, etag: str) -> None:
    """Remove ``blobs/ETAG.XXXXXXXX.incomplete`` files left by a killed download (each
    download writes its own, never resumed by another process), when nobody holds the
    blob's lock (huggingface_hub's ``.locks/models--ORG--REPO/ETAG.lock``)."""
    from filelock import FileLock, Timeout

    folder = repo_dir(repo)
    blobs = folder / "blobs"
    try:
        leftovers = [p for p in blobs.iterdir()
                     if re.fullmatch(re.escape(etag) + r"\.[0-9a-f]{8}\.incomplete", p.name)]
    except OSError:
        return
    if not leftovers:
        return
    lock = FileLock(str(hub_cache() / ".locks" / folder.name / f"{etag}.lock"))
    try:
        lock.acquire(timeout=0)
    except (Timeout, OSError):
        return  # a download of that blob is running
    try:
        for p in leftovers:
            p.unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        lock.release()


def _write_ref(repo: str, commit: str) -> None:
    """``refs/main`` -> ``commit``, so that the cache resolves the branch offline (what
    huggingface_hub writes for a branch; never through a symlink)."""
    path = repo_dir(repo) / "refs" / "main"
    tmp = path.with_name(f".main.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o644)
        try:
            os.write(fd, commit.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LocalLLMError(f"cannot write to the Hugging Face cache {path.parent}: "
                            f"{e.strerror or e}") from None


def _hub_error(e: Exception, ref: HFRef, rel: str | None = None) -> LocalLLMError:
    """One line for an exception of the Hub client."""
    from huggingface_hub import errors as E

    status = getattr(getattr(e, "response", None), "status_code", None)
    where = ref.where + (f" {rel}" if rel else "")
    if isinstance(e, E.GatedRepoError):
        return PullError(f"{ref.where} is gated: accept its conditions on the Hub and set "
                         "HF_TOKEN to a token of that account")
    if isinstance(e, E.RepositoryNotFoundError):
        why = "private or gated: set HF_TOKEN" if status == 401 else "check the name"
        return PullError(f"{ref.where}: no such repository on {endpoint()} (or it is {why})"
                         if status == 401 else
                         f"{ref.where}: no such repository on {endpoint()} ({why})")
    if isinstance(e, E.RevisionNotFoundError):
        return PullError(f"{ref.where} has no branch 'main'")
    if isinstance(e, E.EntryNotFoundError) and not isinstance(e, E.LocalEntryNotFoundError):
        return PullError(f"{where}: no such file in the repository")
    if isinstance(e, E.LocalEntryNotFoundError):
        return PullError(f"cannot reach {endpoint()} to fetch {where} (no network?)")
    if isinstance(e, E.HfHubHTTPError):
        if status == 401:
            return PullError(f"{endpoint()} refused the token (HTTP 401): check HF_TOKEN")
        return PullError(f"{endpoint()} answered HTTP {status} for {where}")
    if isinstance(e, OSError) and e.errno is not None:
        return LocalLLMError(f"cannot write to the Hugging Face cache {hub_cache()}: "
                             f"{e.strerror or e}")
    text = " ".join(str(e).split())[:200]
    if isinstance(e, OSError):  # e.g. huggingface_hub's size consistency check
        return PullError(f"{where}: download failed: {text}")
    return PullError(f"cannot reach {endpoint()} for {where}: {type(e).__name__}: {text}")


# ---- progress ----------------------------------------------------------------------------------
def _rich_tqdm(bars, label: str):
    """A tqdm class for ``hf_hub_download(tqdm_class=)`` that draws on ``bars`` (a rich
    Progress: size, speed, ETA) instead of printing."""
    from tqdm.auto import tqdm

    class RichTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # huggingface_hub's own tqdm takes a name; tqdm does not
            kwargs["disable"] = True  # tqdm itself prints nothing
            super().__init__(*args, **kwargs)
            self._task = bars.add_task(f"pull {label}", total=kwargs.get("total"),
                                       completed=kwargs.get("initial") or 0)

        def update(self, n=1):
            bars.advance(self._task, n or 0)
            return super().update(n)

    return RichTqdm


# ---- removing -------------------------------------------------------------------------------------
def remove(text: str) -> list[Path]:
    """Delete the model ``text`` names from the Hugging Face cache: its snapshot entries, and
    the blobs no other entry of the repository still uses. Returns the entries removed.

    Raises:
        ModelNotFoundError: the cache does not hold that model.
    """
    ref = parse(text)
    commit = _cached_commit(ref.repo)
    snapshot = repo_dir(ref.repo) / "snapshots" / (commit or "-")
    files = _snapshot_files(snapshot) if commit else []
    try:
        model = select(files, ref.tag, ref.where)
    except ModelNotFoundError:
        raise ModelNotFoundError(f"{ref.name} is not in the Hugging Face cache "
                                 f"({hub_cache()})") from None
    entries = [snapshot / p for p in model.parts]
    blobs = set()
    for p in entries:
        try:
            blobs.add(_blob_of(ref.repo, p))
        except CorruptModelError:
            pass
        p.unlink(missing_ok=True)
    still = set()
    for root, _, names in os.walk(repo_dir(ref.repo) / "snapshots"):
        for n in names:
            q = Path(root) / n
            if q.is_symlink():
                still.add(q.resolve())
    for b in blobs - still:
        if b.parent.name == "blobs":
            b.unlink(missing_ok=True)
    return entries


__all__ = ["HFRef", "cached", "endpoint", "hub_cache", "list_models", "looks_like", "offline",
           "parse", "pull_model", "remove", "resolve"]
