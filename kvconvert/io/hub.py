"""Publishing an output directory to the Hugging Face Hub."""

from __future__ import annotations

import os
from pathlib import Path

from kvconvert.errors import KVConvertError


def upload_list(directory: Path) -> list[tuple[str, int]]:
    """(relative path, bytes) of every file ``push`` would upload; hidden files are never uploaded."""
    files = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            files.append((relative.as_posix(), path.stat().st_size))
    return files


def push(directory: Path, repo_id: str, private: bool = False, revision: str | None = None) -> str:
    """Create (or reuse) ``repo_id`` and upload ``directory`` in one commit; return the commit URL.

    The token comes from the usual places (``HF_TOKEN``, ``hf auth login``) through huggingface_hub
    and is never printed; ``HF_ENDPOINT`` is honoured.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if not (directory / "kvconvert.json").exists():
        raise KVConvertError(f"{directory} is not a kvconvert output directory (no kvconvert.json)")
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(directory),
            repo_id=repo_id,
            revision=revision,
            commit_message=f"kvconvert: upload {directory.name}",
            ignore_patterns=[".*", "**/.*"],
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise KVConvertError(
                f"the Hub refused access to {repo_id!r} (HTTP {status}); log in with `hf auth login` or set HF_TOKEN "
                "to a token with write access"
            ) from None
        raise KVConvertError(f"upload to {repo_id!r} failed: {str(exc).splitlines()[0]}") from None
    except (OSError, ValueError, KeyError) as exc:  # network errors, or a reply huggingface_hub cannot parse
        raise KVConvertError(f"upload to {repo_id!r} failed: {type(exc).__name__}: {exc}") from None
    return str(commit)
