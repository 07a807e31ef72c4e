"""A Hugging Face Hub model id to a local snapshot folder and the commit it holds: downloaded when it is not in the
cache, read from the cache alone with ``HF_HUB_OFFLINE=1``.

huggingface_hub's own ``snapshot_download`` does the work (the cache layout, file locks, revision to commit), with
the Hub's standard variables read at each call rather than at import, so a process (or a test) that sets them late
is obeyed: ``HF_ENDPOINT`` (a mirror), ``HF_TOKEN`` (gated and private repos), ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` /
``HF_HOME`` and ``HF_HUB_DOWNLOAD_TIMEOUT``. huggingface_hub's shared HTTP client has no timeout, and
``snapshot_download`` asks the Hub for the repo's files without one, so a bounded ``model_info`` asks first: an
unreachable or silent Hub is a one-line error in seconds (or the cached copy, where there is one), not a hang. The
downloads that follow have huggingface_hub's own limits (``etag_timeout``, and its download timeout, 10 s a read).
Each failure the Hub can answer with is one line naming the model and what to do.

Only the weights one format needs are fetched: safetensors where the repo has them, else PyTorch ``.bin`` files;
never TensorFlow, Flax, ONNX or GGUF copies.

Inputs. May import: errors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                    RepositoryNotFoundError, RevisionNotFoundError)

from .errors import MaxoutError

try:  # the HTTP library huggingface_hub speaks: httpx2 from huggingface_hub 2, httpx before (the GPU image's 1.33)
    import httpx2 as httpx
except ImportError:
    import httpx

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_TIMEOUT_S = 10.0  # per connect / read step, huggingface_hub's own default for metadata requests
CONFIG_AND_TOKENIZER = ["*.json", "*.txt", "*.model", "*.tiktoken"]
SAFETENSORS, PYTORCH_BIN = ["*.safetensors"], ["*.bin"]
TRUE = {"1", "on", "yes", "true"}


class HubError(MaxoutError):
    """A model the Hub (or the local cache, offline) cannot give: exit 1, like any missing input."""


@dataclass(frozen=True)
class Snapshot:
    path: str  # a folder for from_pretrained
    commit: str  # the 40-hex commit of the repo that folder holds


_resolved: dict[tuple, Snapshot] = {}  # one Hub round trip per model and settings in a process


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def cache_dir() -> str:
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")


def timeout_s() -> float:
    return float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT") or DEFAULT_TIMEOUT_S)


def forget() -> None:
    """Drop what this process resolved, so that the next call asks the cache and the Hub again."""
    _resolved.clear()


def snapshot(repo_id: str, revision: Optional[str], what: str) -> Snapshot:
    """The local snapshot of ``repo_id`` at ``revision`` (a branch, tag or commit; None: main), downloaded when the
    cache lacks it; ``what`` names the model in errors (e.g. ``model 'bert_base'``)."""
    key = (repo_id, revision, endpoint(), cache_dir(), offline())
    if key in _resolved and Path(_resolved[key].path).is_dir():
        return _resolved[key]
    unreachable: Optional[Exception] = None
    try:
        unreachable = None if offline() else _ask(repo_id, revision)
        local_only = offline() or unreachable is not None
        path = _download(repo_id, revision, SAFETENSORS, local_only)
        if not any(Path(path).glob("*.safetensors")):
            path = _download(repo_id, revision, PYTORCH_BIN, local_only)
    except GatedRepoError:
        raise HubError(f"{what} ({repo_id}) is a gated repo: accept its license on {endpoint()}/{repo_id} while "
                       f"logged in, then set HF_TOKEN to an access token of that account (HF_TOKEN is "
                       f"{'set but not granted access' if os.environ.get('HF_TOKEN') else 'not set'})") from None
    except RevisionNotFoundError:
        raise HubError(f"model.revision={revision!r} is not a branch, tag or commit of {repo_id} on {endpoint()}; "
                       f"use one that exists, or null for main") from None
    except RepositoryNotFoundError:
        pinned = f" at revision {revision!r}" if revision else ""
        raise HubError(f"{what}: {repo_id}{pinned} is not a model on {endpoint()} (or it is private: set HF_TOKEN); "
                       f"check model.name_or_path{' and model.revision' if revision else ''}, or set "
                       f"model.path=/dir/with/config.json") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        raise _unavailable(repo_id, revision, what, unreachable or err) from None
    except (httpx.HTTPError, OSError) as err:  # a refused connection, a timeout, a cut download, a full disk
        raise HubError(f"cannot download {what} ({repo_id}) from {endpoint()}: {_first_line(err)}; check the "
                       f"network and HF_ENDPOINT, or set model.path=/dir/with/config.json") from None
    result = Snapshot(path, Path(path).name)
    _resolved[key] = result
    return result


def _ask(repo_id: str, revision: Optional[str]) -> Optional[Exception]:
    """Ask the Hub for ``revision``, within the timeout (huggingface_hub's own client has none, and
    ``snapshot_download`` asks without one); the error where the Hub cannot be reached (only the cache is read
    then), None where it answers. An answer that is an error (gated, not found) raises here."""
    try:
        HfApi(endpoint=endpoint(), token=_token()).model_info(repo_id, revision=revision, timeout=timeout_s())
    except httpx.TransportError as err:  # refused, reset, timed out: the cache may still hold it
        return err
    return None


def _token() -> Optional[str]:
    return os.environ.get("HF_TOKEN") or None


def _download(repo_id: str, revision: Optional[str], weights: list[str], local_only: bool) -> str:
    return snapshot_download(repo_id, revision=revision, allow_patterns=CONFIG_AND_TOKENIZER + weights,
                             cache_dir=cache_dir(), endpoint=endpoint(), local_files_only=local_only,
                             token=_token(), etag_timeout=timeout_s())


def _unavailable(repo_id: str, revision: Optional[str], what: str, err: Exception) -> HubError:
    pinned = f" at revision {revision!r}" if revision else ""
    if offline():
        return HubError(f"{what} ({repo_id}{pinned}) is not available offline: HF_HUB_OFFLINE=1 and it is not in "
                        f"the local Hugging Face cache ({cache_dir()}); unset HF_HUB_OFFLINE to download it, run "
                        f"`hf download {repo_id}` where there is network, or set model.path=/dir/with/config.json")
    return HubError(f"cannot reach the Hugging Face Hub at {endpoint()} to download {what} ({repo_id}{pinned}), and "
                    f"it is not in the local cache ({_first_line(err)}); check the network and HF_ENDPOINT, or set "
                    f"model.path=/dir/with/config.json")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:200]
