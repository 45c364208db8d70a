"""``aotx pull hf:ORG/REPO/FILE.gguf``: download a model into the models folder, checked first.

Owns, in order (nothing is written before step 4):

1. the reference: ``hf:ORG/REPO/PATH/FILE.gguf`` with an optional ``@REVISION``
   (default ``main``), on the endpoint ``$AOTX_HF_ENDPOINT``, else ``$HF_ENDPOINT``,
   else the Hugging Face Hub;
2. the file's metadata from the Hub (``huggingface_hub.get_hf_file_metadata``: size,
   the sha256 the Hub publishes for LFS files, the commit), refusing a file that is
   not ``.gguf``;
3. the GGUF header, read with HTTP range requests (the first megabytes, more when
   the vocabulary is large) before the download: a file that is not GGUF, whose
   architecture or tensor types AOTX cannot run, that would not fit the memory
   budget (at the engine's slots and context), or that would not fit the disk is
   refused with the numbers;
4. the download with ``huggingface_hub``'s ``http_get`` (its progress bar on stderr,
   its retries), into ``<models>/.partial/<file>.part``: an interrupted pull leaves the
   part there and the next pull of the same file resumes it with a range request, once a
   probe has seen the server answer one with 206 (a server or proxy that ignores Range
   answers 200 and the whole file: the part is emptied and the download starts at byte 0,
   whatever huggingface_hub's version does with such an answer);
5. the sha256 of the whole file against the Hub's; a mismatch removes the part and
   says so; then the file is moved into the models folder (fsync'd, renamed).

Leaves the header's parsing to ``model/gguf_header.py``, what can run to
``runtime/catalog.py``, and the memory estimate to ``runtime.models.header_terms``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotx.engine.errors import AotxError, EngineError, ModelError, UsageError
from aotx.engine.units import fmt_bytes, parse_size

DEFAULT_ENDPOINT = "https://huggingface.co"
HEADER_FIRST = 4 << 20  # bytes of the first range request; more when the header is longer
HEADER_MAX = 256 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


# the exception classes (and their bases) that mean "the server could not be reached"
_UNREACHABLE = {"ConnectError", "ConnectionError", "ConnectTimeout", "Timeout", "ReadTimeout", "TimeoutException",
                "gaierror", "OfflineModeIsEnabled", "NewConnectionError", "MaxRetryError"}


def hub_error(e: BaseException, ref: Any, base: str) -> str:
    """One line for a failed metadata request to the Hub, saying which of the usual causes it
    is (a name that names nothing, access, the network) instead of the library's raw text."""
    names = {c.__name__ for c in type(e).__mro__}
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    status = getattr(getattr(e, "response", None), "status_code", None)
    where = f"{ref.repo_id}/{ref.filename}@{ref.revision} on {base}"
    if "RepositoryNotFoundError" in names:
        return f"{where}: no repository {ref.repo_id} there (or it is private: set HF_TOKEN)"
    if "RevisionNotFoundError" in names:
        return f"{where}: {ref.repo_id} has no revision {ref.revision!r}"
    if "GatedRepoError" in names or status in (401, 403):
        return f"{where}: {ref.repo_id} needs access (accept its terms on the Hub, then set HF_TOKEN)"
    if "EntryNotFoundError" in names or status == 404:
        return (f"{where}: {ref.repo_id} has no file {ref.filename} (HTTP 404); the repository's files are listed "
                f"on its page")
    cause = e
    while cause is not None:
        if {c.__name__ for c in type(cause).__mro__} & _UNREACHABLE:
            return (f"{where}: cannot reach {base} ({msg}); check the network connection (HF_ENDPOINT names "
                    f"another server)")
        cause = cause.__cause__ or cause.__context__
    return f"{where}: {msg}"


class PullError(AotxError):
    """A pull was refused or failed (one line, exit code 2)."""


@dataclass(frozen=True)
class Ref:
    repo_id: str
    filename: str
    revision: str = "main"

    @property
    def basename(self) -> str:
        return self.filename.rsplit("/", 1)[-1]


def parse_ref(text: str) -> Ref:
    """``hf:ORG/REPO/FILE.gguf[@REV]`` (also without ``hf:``, and ``ORG/REPO:FILE``) -> Ref.
    Raises UsageError naming the expected form."""
    t = text.strip()
    t = t.removeprefix("hf:").removeprefix("hf.co/").removeprefix("https://huggingface.co/")
    rev = "main"
    if "@" in t:
        t, rev = t.rsplit("@", 1)
    if ":" in t:
        repo, _, fn = t.partition(":")
    else:
        parts = t.split("/")
        repo, fn = "/".join(parts[:2]), "/".join(parts[2:])
        if "/resolve/" in t:  # a pasted URL: ORG/REPO/resolve/REV/FILE
            repo = "/".join(parts[:2])
            rest = t.split("/resolve/", 1)[1].split("/", 1)
            rev, fn = rest[0], rest[1] if len(rest) > 1 else ""
    if repo.count("/") != 1 or not all(repo.split("/")) or not fn or not rev:
        raise UsageError(f"{text!r}: give hf:ORG/REPO/FILE.gguf, e.g. "
                         f"hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf")
    if not fn.lower().endswith(".gguf"):
        raise PullError(f"{fn}: AOTX runs GGUF files; this is not one (pick the repository's .gguf file, e.g. one "
                        f"ending in q4_k_m.gguf)")
    return Ref(repo, fn, rev)


def endpoint() -> str:
    """``$AOTX_HF_ENDPOINT``, else ``$HF_ENDPOINT``, else the Hugging Face Hub."""
    return (os.environ.get("AOTX_HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _hf():
    try:
        import huggingface_hub

        return huggingface_hub
    except ImportError as e:  # a dependency of AOTX: only a broken install lacks it
        raise PullError(f"aotx pull needs huggingface_hub ({e}): pip install huggingface_hub") from None


def _auth_headers() -> dict[str, str]:
    hf = _hf()
    return hf.utils.build_hf_headers(token=hf.get_token() or False)


def read_remote_header(url: str, headers: dict[str, str], what: str, size: int | None):
    """The GGUF header of the file at ``url``, read with range requests (no more than it
    needs). Raises ModelError (not GGUF), PullError (the server)."""
    import httpx

    from aotx.engine.model.gguf_header import Incomplete, read_header

    n = HEADER_FIRST if size is None else min(HEADER_FIRST, size)
    with httpx.Client(follow_redirects=True, timeout=60) as client:
        while True:
            try:
                r = client.get(url, headers={**headers, "Range": f"bytes=0-{n - 1}", "Accept-Encoding": "identity"})
            except httpx.HTTPError as e:
                raise PullError(f"cannot read the header of {what}: {e}") from None
            if r.status_code not in (200, 206):
                raise PullError(f"cannot read the header of {what}: HTTP {r.status_code}")
            data = r.content[:n]
            try:
                return read_header(data, what)
            except Incomplete as e:
                if r.status_code == 200 or (size is not None and n >= size) or n >= HEADER_MAX:
                    raise ModelError(f"{what}: the GGUF header does not end within {fmt_bytes(len(data))}: "
                                     f"truncated or not a model") from None
                n = min(max(e.need + (1 << 20), 2 * n), HEADER_MAX, size or HEADER_MAX)


def server_resumes(url: str, headers: dict[str, str], have: int) -> bool:
    """Whether the server at ``url`` honours a request for the bytes from ``have`` on: False
    when it answers 200 (it ignores Range and sends the whole file) instead of 206. Reads
    none of the body; a network error or another status is left to the download to report."""
    import httpx

    try:
        with httpx.Client(follow_redirects=True, timeout=60) as client:
            with client.stream("GET", url, headers={**headers, "Range": f"bytes={have}-",
                                                    "Accept-Encoding": "identity"}) as r:
                return r.status_code != 200
    except httpx.HTTPError:
        return True


def _engine_budget(args) -> tuple[int, int, int, int, str]:
    """(budget bytes, free bytes now, slots, context, where the numbers come from):
    from the running engine when one answers, else from the flags and the defaults."""
    import asyncio

    from aotx.engine.runtime import admission
    from aotx.engine.cli.serve import DEFAULT_CONTEXT, DEFAULT_SLOTS

    slots = args.slots or DEFAULT_SLOTS
    ctx = args.context or DEFAULT_CONTEXT
    if args.memory_budget:
        try:
            total = parse_size(args.memory_budget)
        except ValueError:
            raise UsageError(f"--memory-budget: cannot read {args.memory_budget!r} as a size (e.g. 4G)") from None
        return total, total, slots, ctx, "--memory-budget"

    async def ask():
        from aotx.engine.ipc.client import EngineClient

        try:
            c = await EngineClient.connect(None, spawn=False, client_name="aotx-pull")
        except EngineError:
            return None
        try:
            ml = await c.list_models()
            st = await c.status()
            return ml, st
        finally:
            await c.close()

    got = asyncio.run(ask())
    if got is not None and got[0].budget_bytes:
        ml, st = got
        n_slots = len({s.slot for s in st.slots if s.model == st.model}) or slots
        return ml.budget_bytes, ml.budget_bytes - ml.used_bytes, args.slots or n_slots, args.context or st.n_ctx, \
            "the running engine's budget"
    total = admission.default_cpu_budget()
    return total, total, slots, ctx, "the default budget (half the RAM)"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pull(args, out=None) -> Path:
    """The steps of the module docstring. Returns the installed file's path."""
    out = out or sys.stdout
    from aotx.engine import paths
    from aotx.engine.runtime.catalog import runnable_problem
    from aotx.engine.runtime.models import header_terms
    from aotx.engine.runtime.catalog import ModelEntry

    ref = parse_ref(args.ref)
    hf = _hf()
    base = endpoint()
    name = args.name or ref.basename
    if not name.lower().endswith(".gguf"):
        name += ".gguf"
    folder = paths.models_dir()
    dest = folder / name
    url = hf.hf_hub_url(ref.repo_id, ref.filename, revision=ref.revision, endpoint=base)
    headers = _auth_headers()
    try:
        meta = hf.get_hf_file_metadata(url, token=hf.get_token() or False, endpoint=base)
    except Exception as e:  # noqa: BLE001 - the Hub's errors are many classes; each is one line here
        raise PullError(hub_error(e, ref, base)) from None
    size = meta.size
    sha = (meta.etag or "").lower()
    sha = sha if _SHA256.match(sha) else ""
    what = f"{ref.repo_id}/{ref.filename}"
    if dest.exists():
        if sha and dest.stat().st_size == size and _sha256(dest) == sha:
            print(f"{name} is already installed ({dest}, sha256 {sha[:12]}...)", file=out)
            return dest
        raise PullError(f"{dest} exists and is another file; pass --name to install this one beside it")
    # 3. the header, before any byte is written
    h = read_remote_header(meta.location, headers, what, size)
    why = runnable_problem(h, what)
    if why:
        raise PullError(f"{why}: not downloaded")
    total, free_now, slots, ctx, source = _engine_budget(args)
    ctx_m = min(ctx, h.n_ctx_train) if h.n_ctx_train else ctx
    terms = header_terms(ModelEntry(name, "gguf", header=h, size_bytes=size or 0), slots, ctx_m, 256, 2,
                         capsule_host=0)
    need = sum(v for _, v in terms)
    parts = ", ".join(f"{n} {fmt_bytes(v)}" for n, v in terms)
    if need > total and not args.force:
        raise PullError(f"{what} would not fit the memory budget: at {slots} slots x {ctx_m} tokens it needs "
                        f"{fmt_bytes(need)} ({parts}); {source} is {fmt_bytes(total)}: not downloaded (lower "
                        f"--slots/--context, raise --memory-budget, or --force to download anyway)")
    if need > free_now and source == "the running engine's budget":
        print(f"aotx: note: it fits the budget but not beside the models loaded now ({fmt_bytes(free_now)} free): "
              f"unload one, or start the engine with --evict-idle", file=sys.stderr)
    part_dir = folder / ".partial"
    part_dir.mkdir(exist_ok=True)
    part = part_dir / f"{name}.{(sha or (meta.commit_hash or 'x'))[:16]}.part"
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        part.unlink()
        have = 0
    if have and (size is None or have < size) and not server_resumes(meta.location, headers, have):
        print(f"aotx: note: the server ignores range requests (it answered 200, not 206, to resuming at "
              f"{fmt_bytes(have)}): starting over from byte 0", file=sys.stderr)
        part.unlink()
        have = 0
    disk_free = shutil.disk_usage(folder).free
    if size is not None and size - have > disk_free:
        raise PullError(f"{what} is {fmt_bytes(size)}; {folder} has {fmt_bytes(disk_free)} free: not downloaded")
    print(f"pulling {what}@{ref.revision} from {base}: {fmt_bytes(size or 0)}, {h.arch} {h.quant}, context "
          f"{h.n_ctx_train}; needs {fmt_bytes(need)} at {slots} slots x {ctx_m} tokens (of {fmt_bytes(total)})"
          + (f"; resuming at {fmt_bytes(have)}" if have else ""), file=out)
    # 4. the download, resumable
    from huggingface_hub.file_download import http_get

    try:
        with open(part, "ab") as fh:
            http_get(meta.location, fh, resume_size=have, headers=headers, expected_size=size,
                     displayed_filename=name)
            fh.flush()
            os.fsync(fh.fileno())
    except KeyboardInterrupt:
        raise PullError(f"interrupted; {fmt_bytes(part.stat().st_size)} kept in {part}: pull again to resume") \
            from None
    except Exception as e:  # noqa: BLE001 - network, HTTP, size mismatch
        kept = part.stat().st_size if part.exists() else 0
        raise PullError(f"the download of {what} stopped ({str(e).splitlines()[0] if str(e) else type(e).__name__});"
                        f" {fmt_bytes(kept)} kept in {part}: pull again to resume") from None
    # 5. the checksum, then the move
    got = _sha256(part)
    if sha and got != sha:
        part.unlink()
        raise PullError(f"{what}: checksum mismatch: the Hub publishes sha256 {sha}, the download has {got}; the "
                        f"download was removed, nothing was installed (pull again)")
    if not sha:
        print(f"aotx: note: {base} publishes no sha256 for {what}; the file's sha256 is {got}", file=sys.stderr)
    os.replace(part, dest)
    _fsync_dir(folder)
    print(f"installed {dest} (sha256 {got}); run it with `aotx run --model {dest.stem} ...`", file=out)
    return dest


def cmd_pull(args) -> int:
    pull(args)
    return 0
