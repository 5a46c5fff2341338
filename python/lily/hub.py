"""Resolving a model argument to a local checkpoint directory (local path, ``lily:demo``, HF repo)."""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path

# Only what a text-only engine reads: weights, index, configs, tokenizer and chat template.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
]

BUNDLED_MODELS = ("demo",)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubError(ValueError):
    """A model argument that cannot be resolved to a checkpoint directory."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from HF_HUB_CACHE or HF_HOME as they are set now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _bundled(name: str) -> Path:
    if name not in BUNDLED_MODELS:
        raise HubError(
            f"unknown bundled model 'lily:{name}'; available: {', '.join('lily:' + n for n in BUNDLED_MODELS)}"
        )
    path = Path(str(importlib.resources.files("lily") / name))
    if not (path / "config.json").is_file():
        raise HubError(f"'lily:{name}' is not included in this installation of Lily (expected {path}/config.json)")
    return path


def resolve(path_or_repo: str | os.PathLike, *, revision: str | None = None, progress: bool = True) -> Path:
    """The local checkpoint directory for a model argument.

    * an existing local directory is returned as is;
    * ``"lily:demo"`` is the small demo model shipped inside the package;
    * anything else must be a Hugging Face repo id (``"org/name"``), downloaded (only the files
      Lily reads) into the HF cache with tqdm progress bars on stderr (``progress=False`` hides
      them), or taken from the cache when ``HF_HUB_OFFLINE=1``.
    """
    text = os.fspath(path_or_repo)
    if text.startswith("lily:"):
        if revision is not None:
            raise HubError(f"revision= does not apply to the bundled model {text!r}")
        return _bundled(text[len("lily:") :])
    local = Path(text).expanduser()
    if local.exists():
        if not local.is_dir():
            raise HubError(f"{local}: expected a checkpoint directory, got a file")
        return local
    if not _REPO_ID.match(text) or ".." in text:
        raise HubError(f"{text!r} is neither an existing directory nor a Hugging Face repo id ('org/name')")
    return _download(text, revision, progress)


def _silent_tqdm() -> type:
    """A tqdm class that draws nothing (huggingface_hub's default bars honour
    HF_HUB_DISABLE_PROGRESS_BARS; this is for ``progress=False``)."""
    from tqdm.auto import tqdm

    class SilentTqdm(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentTqdm


def _download(repo_id: str, revision: str | None, progress: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _offline()
    cache = hub_cache_dir()
    at = f"{repo_id}@{revision}" if revision else repo_id
    how = f"run `hf download {repo_id}{' --revision ' + revision if revision else ''}` while online"
    kwargs = {}
    if not progress:
        kwargs["tqdm_class"] = _silent_tqdm()
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
            **kwargs,
        )
    except LocalEntryNotFoundError:
        if offline:
            raise HubError(
                f"{at} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 forbids "
                f"downloading it; {how}, or unset HF_HUB_OFFLINE"
            ) from None
        raise HubError(
            f"cannot download {at} (no connection to the Hugging Face Hub?) and it is not cached in {cache}"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"revision {revision!r} of {repo_id} does not exist on the Hugging Face Hub") from None
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated: accept its terms on huggingface.co and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{repo_id} was not found on the Hugging Face Hub (or it is private: log in with `hf auth login`)"
        ) from None
    except HfHubHTTPError as exc:
        raise HubError(f"downloading {at} failed: {exc}") from None
    path = Path(snapshot)
    if not (path / "config.json").is_file():
        hint = f"; {how}" if offline else ""
        raise HubError(f"{at}: the snapshot in {path} has no config.json (incomplete download?){hint}")
    return path
