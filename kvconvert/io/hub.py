"""Publishing an output directory to the Hugging Face Hub: exactly the files kvconvert wrote there."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvconvert.errors import KVConvertError
from kvconvert.io.outdir import ADDED_LATER, read_marker

# what a conversion directory holds besides its weights, runtime and tokenizer (for outputs written
# before the marker listed its files)
_LEGACY_NAMES = ("config.json", "kvconvert.json", "recipe.yaml", "README.md", "model.safetensors.index.json")


def check_repo_id(repo_id: str) -> None:
    """The Hub's own rules for a repository id (NAME or ORG/NAME), checked before anything else."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise KVConvertError(f"--repo-id {repo_id!r} is not a valid Hub repository id: {reason}") from None
    if repo_id.count("/") > 1 or not repo_id.strip("/"):
        raise KVConvertError(f"--repo-id {repo_id!r} is not a valid Hub repository id: use NAME or ORG/NAME")


def _written_by_kvconvert(directory: Path) -> list[str]:
    """Relative paths kvconvert wrote into ``directory``: its marker's list, or, for an output written
    before the marker existed, what a conversion writes (its report names the weight files)."""
    marker = read_marker(directory)
    if marker is not None:
        return [str(name) for name in marker.get("files", [])]
    from kvconvert.io.source import TOKENIZER_FILES, read_json

    report = read_json(directory / "kvconvert.json", "conversion report")
    if not isinstance(report, dict):
        raise KVConvertError(f"{directory / 'kvconvert.json'} is not a kvconvert conversion report")
    runtime = [p.name for p in directory.glob("*.py")]  # the runtime shims, top level only
    return sorted({*report.get("weight_files", []), *_LEGACY_NAMES, *TOKENIZER_FILES, *runtime})


def upload_plan(directory: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """(files to upload as (relative path, bytes), files left out). Uploaded: regular files kvconvert
    wrote there, never a link (it could point anywhere on this machine) and never a hidden file; left
    out: everything else in the directory (stray files, caches, links), for the user to see."""
    if not (directory / "kvconvert.json").is_file():
        raise KVConvertError(f"{directory} is not a kvconvert output directory (no kvconvert.json)")
    ours = {*_written_by_kvconvert(directory), *ADDED_LATER}
    files, skipped = [], []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode) or any(part.startswith(".") for part in path.relative_to(directory).parts):
            continue
        if relative in ours and stat.S_ISREG(mode):
            files.append((relative, path.lstat().st_size))
        else:
            skipped.append(relative + (" (a link)" if stat.S_ISLNK(mode) else ""))
    return files, skipped


def push(
    directory: Path, repo_id: str, files: list[str], card: str | None, private: bool = False,
    revision: str | None = None,
) -> str:  # fmt: skip
    """Create (or reuse) ``repo_id`` and upload ``files`` of ``directory`` in one commit, with ``card``
    as README.md when given; return the commit URL. Nothing local is changed.

    The token comes from the usual places (``HF_TOKEN``, ``hf auth login``) through huggingface_hub
    and is never printed; ``HF_ENDPOINT`` is honoured.
    """
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(directory / name))
                  for name in files if not (card is not None and name == "README.md")]  # fmt: skip
    if card is not None:
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()))
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.create_commit(
            repo_id, operations, commit_message=f"kvconvert: upload {directory.name}", revision=revision
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise KVConvertError(
                f"the Hub refused access to {repo_id!r} (HTTP {status}); log in with `hf auth login` or set HF_TOKEN "
                "to a token with write access"
            ) from None
        raise KVConvertError(f"upload to {repo_id!r} failed: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # no network, a proxy, a reply it cannot parse: whatever the HTTP stack raises
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise KVConvertError(f"upload to {repo_id!r} failed ({type(exc).__name__}: {reason}); nothing was changed "
                             "locally") from None  # fmt: skip
    return str(commit.commit_url)


def publish(
    directory: Path, repo_id: str, private: bool = False, revision: str | None = None, dry_run: bool = False
) -> tuple[str | None, list[tuple[str, int]], list[str]]:  # fmt: skip
    """``kvconvert push``: (commit URL or None for a dry run, files with their bytes, files left out).
    The model card is refreshed from kvconvert.json and eval.json and uploaded; the local README.md is
    rewritten only after the upload succeeded. A card the user edited since kvconvert wrote it
    (``card_edited``) is uploaded as it is and left alone."""
    from kvconvert.io.model_card import is_eval_result, model_card
    from kvconvert.io.outdir import card_edited, record_card, write_text_atomic
    from kvconvert.io.source import read_json

    check_repo_id(repo_id)
    files, skipped = upload_plan(directory)
    if card_edited(directory):
        if dry_run:
            return None, files, skipped
        return push(directory, repo_id, [name for name, _ in files], None, private, revision), files, skipped
    report = read_json(directory / "kvconvert.json", "conversion report")
    evaluation = read_json(directory / "eval.json", "eval result") if (directory / "eval.json").is_file() else None
    if evaluation is not None and not is_eval_result(evaluation):
        raise KVConvertError(f"{directory / 'eval.json'} is not a kvconvert eval result; move it away or rewrite it "
                             "with kvconvert eval --json")  # fmt: skip
    card = model_card(report, repo_id, evaluation)
    sizes = dict(files) | {"README.md": len(card.encode())}
    listed = sorted(sizes.items())
    if dry_run:
        return None, listed, skipped
    url = push(directory, repo_id, [name for name, _ in listed], card, private=private, revision=revision)
    write_text_atomic(directory / "README.md", card)
    record_card(directory)
    return url, listed, skipped
