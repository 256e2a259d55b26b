"""Push an export directory to the Hugging Face Hub with `huggingface_hub`.

The token comes from the usual places (HF_TOKEN, the login cache) and is never printed or
written. A failed upload leaves the local export as it was; push it again with
`llmtrain export --push-only DIR --push-to-hub ORG/NAME`.
"""

from __future__ import annotations

from pathlib import Path

from llmtrain.errors import LlmtrainError


class HubError(LlmtrainError, RuntimeError):
    pass


def _check_complete(folder: Path) -> None:
    """Every weight file the export names is there, whole: a push deletes the Hub's earlier
    weight files (delete_patterns), so an incomplete folder would break a good repository."""
    from llmtrain.tensor_io import TensorFileError, check_whole, tensor_files

    try:
        for f in sorted(set(tensor_files(folder, "model").values())):
            check_whole(folder / f)
    except (TensorFileError, OSError) as e:
        raise HubError(
            f"{folder} is not a complete export ({e}); nothing was pushed; export "
            "again with `llmtrain export ... --overwrite`"
        ) from None


def push(folder: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
         token: str | None = None, commit_message: str | None = None) -> str:  # fmt: skip
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise HubError(f"{folder} is not an export (no config.json); run `llmtrain export` first")
    _check_complete(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"repository name {repo_id!r} is invalid: {e}") from None
    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login`, then push again with "
                       f"`llmtrain export --push-only {folder} --push-to-hub {repo_id}`")  # fmt: skip
    api = HfApi(token=token)
    retry = f"the export in {folder} is untouched; retry with `llmtrain export --push-only {folder} --push-to-hub {repo_id}`"
    try:
        user = api.whoami()
        # private=None leaves an existing repo, or an organisation's default, as it is
        url = api.create_repo(repo_id, private=True if private else None, exist_ok=True,
                              repo_type="model")  # fmt: skip
        if private and not api.repo_info(repo_id).private:
            raise HubError(f"{repo_id} exists and is public: --private cannot make it private, "
                           "so nothing was pushed; make it private on the Hub, or push without "
                           "--private")  # fmt: skip
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            revision=revision,
            commit_message=commit_message or f"Upload {folder.name} with llmtrain",
            # an earlier push's weights (one file then, shards now, or the reverse) would stay
            # beside the new ones, and transformers may load the old ones
            delete_patterns=["*.safetensors", "*.safetensors.index.json"],
        )
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", "?")
        reason = str(e).splitlines()[0].replace(token, "***")
        raise HubError(f"the Hub refused the push (HTTP {status}: {reason}); {retry}") from None
    except HubError:
        raise
    except Exception as e:  # httpx transport errors are not OSErrors; hub's own RuntimeErrors
        reason = " ".join(str(e).split())[:200].replace(token, "***")
        raise HubError(
            f"the upload failed ({type(e).__name__}: {reason}); nothing was committed "
            f"to {repo_id}; {retry}"
        ) from None
    return f"{url}" + (f"/tree/{revision}" if revision else "") + f" (as {user.get('name', '?')})"
