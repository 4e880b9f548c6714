"""``hf://ORG/REPO[@REVISION][/SUBFOLDER]``: a Hugging Face Hub model repository, read through
the Hub's HTTP endpoint (``{endpoint}/ORG/REPO/resolve/REVISION/...``) with the HTTP store.

The token (``token=``, else ``HF_TOKEN``) goes only to the endpoint's own host: it is a header of
this store's client, whose requests all go to that host; the client drops it on a redirect to
another host (the Hub's file storage, whose URLs are signed). ``HF_ENDPOINT`` names a mirror."""

from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import quote, urlsplit

import obstore

from ..errors import CheckpointError, UsageError
from .remote import RemoteStore, _translate, bounded

DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _parts(url: str) -> tuple[str, str, str, str]:
    """(org, repo, revision, path) of ``hf://ORG/REPO[@REVISION][/PATH]``, checked."""
    rest = url.split("://", 1)[1]
    parts = rest.split("/")
    if len(parts) < 2 or not all(_REPO.fullmatch(p) for p in (parts[0], parts[1].split("@", 1)[0])):
        raise UsageError("a Hub URL is hf://ORG/REPO[@REVISION][/SUBFOLDER]", url=url)
    repo, _, revision = parts[1].partition("@")
    path = "/".join(parts[2:])
    if revision == "" and "@" in parts[1]:
        raise UsageError("an empty revision after '@'", url=url)
    if any(p in (".", "..") for p in path.split("/")):
        raise UsageError("a Hub path may not hold '.' or '..'", url=url)
    return parts[0], repo, revision or "main", path


def resolve_url(url: str, endpoint: str) -> str:
    """The Hub's HTTP URL for ``hf://ORG/REPO[@REVISION][/PATH]``."""
    org, repo, revision, path = _parts(url)
    base = f"{endpoint.rstrip('/')}/{org}/{repo}/resolve/{quote(revision, safe='')}"
    return f"{base}/{path}" if path else base


#: A repository's file list (the Hub's tree API) larger than this is refused.
MAX_TREE_BYTES = 16 << 20


class HubStore(RemoteStore):
    """A Hub repository (or a subfolder, or one file of it), as an HTTP folder or file."""

    def __init__(
        self,
        url: str,
        concurrency: int,
        *,
        token: str | None = None,
        endpoint: str | None = None,
        client_options: dict[str, Any] | None = None,
        retry_config: dict[str, Any] | None = None,
        timeout: float | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        endpoint = endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
        if urlsplit(endpoint).scheme not in ("http", "https") or not urlsplit(endpoint).hostname:
            raise UsageError(f"the Hub endpoint must be an http(s) URL, not {endpoint!r}", url=url)
        token = token or os.environ.get("HF_TOKEN") or None
        options = dict(client_options or {})
        if token:
            if not token.isascii() or not token.isprintable():
                raise UsageError("the Hub token holds characters a header cannot carry: check HF_TOKEN", url=url)
            options["default_headers"] = {**options.get("default_headers", {}), "Authorization": f"Bearer {token}"}
        org, repo, revision, path = _parts(url)
        kwargs: dict[str, Any] = dict(client_options=options, retry_config=retry_config, timeout=timeout, ca_bundle=ca_bundle)
        super().__init__(resolve_url(url, endpoint), concurrency, **kwargs)
        self.scheme = "hf"
        self.secrets += (token,) if token else ()
        # The tree API, on the same host with the same policy: where a folder without an index is listed.
        self._tree = RemoteStore(f"{endpoint.rstrip('/')}/api/models/{org}/{repo}/tree", 1, **kwargs)
        self._tree_path = "/".join(p for p in (quote(revision, safe=""), path) if p)
        self._folder = path

    def list(self, suffix: str) -> list[str]:
        """The files directly in the repository's folder that end in ``suffix``, from the Hub's
        tree API (a mirror without it: the usual single file)."""
        try:
            raw = bounded(obstore.get(self._tree.client, self._tree_path), MAX_TREE_BYTES)
        except FileNotFoundError:
            return super().list(suffix)
        except Exception as exc:
            raise _translate(exc, self.url, "hf", None, self.secrets) from None
        if len(raw) > MAX_TREE_BYTES:
            raise CheckpointError(f"the Hub's file list is over {MAX_TREE_BYTES} bytes", url=self.url)
        try:
            entries = json.loads(raw)
            paths = [e["path"] for e in entries if e.get("type") == "file"]
        except (ValueError, TypeError, KeyError, AttributeError):
            raise CheckpointError("the Hub's file list is not the JSON list it should be", url=self.url) from None
        prefix = self._folder.rstrip("/") + "/" if self._folder else ""
        names = [p[len(prefix) :] for p in paths if isinstance(p, str) and p.startswith(prefix)]
        return sorted(n for n in names if "/" not in n and n.endswith(suffix))
